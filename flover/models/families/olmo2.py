"""OLMo 2: norms after attention and the MLP, on their outputs before the residual add (none
before), their weights multiplied in float32; q and k each normed over the whole projection."""

import dataclasses

from flover.models.families._shared import Family, decoder_fields, eos_pad

FEATURES = dict(qk_norm="projection", norm_layout="post", norm_float32=True)

FAMILY = Family(
    name="olmo2",
    hf_architectures=("Olmo2ForCausalLM",),
    from_hf=lambda raw: decoder_fields(raw) | FEATURES,
    gguf_arch="olmo2",
    from_gguf=lambda file, cfg: dataclasses.replace(cfg, **FEATURES),
    gguf_names={"post_attention_layernorm.weight": "post_attention_norm.weight"},
    test_config="Olmo2Config",
    test_kwargs=eos_pad,
)
