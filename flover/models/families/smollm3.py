"""SmolLM3: Llama whose every 4th layer (`no_rope_layers`) skips RoPE; a window only where
use_sliding_window. llama.cpp's converter permutes Q and K's rows and does not store which
layers skip RoPE: every 4th, its n_no_rope_layer_step."""

import dataclasses

from flover.models.families._shared import Family, decoder_fields, eos_pad

NOPE_LAYER_STEP = 4


def nope_layers(raw: dict, layers: int) -> frozenset[int]:
    """The layers without RoPE: `no_rope_layers` (1: RoPE, 0: none, one per layer), else every
    `no_rope_layer_interval`-th layer (4 by default), as transformers builds the list."""
    flags = raw.get("no_rope_layers")
    if flags is None:
        interval = raw.get("no_rope_layer_interval", NOPE_LAYER_STEP)
        if isinstance(interval, bool) or not isinstance(interval, int) or interval < 1:
            raise ValueError(f"no_rope_layer_interval must be a positive integer, got {interval!r}")
        flags = [int((i + 1) % interval != 0) for i in range(layers)]
    if (
        not isinstance(flags, list)
        or len(flags) != layers
        or any(f not in (0, 1) or isinstance(f, float) for f in flags)
    ):
        raise ValueError(f"no_rope_layers must list 0 or 1 for each of the {layers} layers")
    return frozenset(i for i, use_rope in enumerate(flags) if not use_rope)


def from_hf(raw: dict) -> dict:
    return decoder_fields(raw, windows="opt_in") | dict(nope_layers=nope_layers(raw, raw["num_hidden_layers"]))


def from_gguf(file, cfg):
    layers = range(cfg.num_layers)
    return dataclasses.replace(cfg, nope_layers=frozenset(i for i in layers if (i + 1) % NOPE_LAYER_STEP == 0))


FAMILY = Family(
    name="smollm3",
    hf_architectures=("SmolLM3ForCausalLM",),
    from_hf=from_hf,
    gguf_arch="smollm3",
    gguf_qk_permuted=True,
    from_gguf=from_gguf,
    test_config="SmolLM3Config",
    test_kwargs=eos_pad,
)
