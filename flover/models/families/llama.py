"""Llama 1-3 (and the models that reuse its architecture name: SmolLM2, TinyLlama, ...): the
decoder in its plain form. llama.cpp's converter permutes Q and K's rows; a llama GGUF file with
experts is Mixtral's (mixtral.py)."""

from flover.models.families._shared import Family, decoder_fields

FAMILY = Family(
    name="llama",
    hf_architectures=("LlamaForCausalLM",),
    from_hf=decoder_fields,
    gguf_arch="llama",
    gguf_qk_permuted=True,
    test_config="LlamaConfig",
)
