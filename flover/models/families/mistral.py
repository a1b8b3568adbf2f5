"""Mistral: Llama with a sliding window over every layer. (llama.cpp writes its GGUF files as
llama: they read as Llama, whose windows the file states.)"""

from flover.models.families._shared import Family, decoder_fields

FAMILY = Family(
    name="mistral",
    hf_architectures=("MistralForCausalLM",),
    from_hf=lambda raw: decoder_fields(raw, windows="every_layer"),
    test_config="MistralConfig",
)
