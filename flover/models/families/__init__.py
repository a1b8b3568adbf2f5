"""The registry of families: every module of this package but those starting with "_" is one
family and holds one `FAMILY` (a `_shared.Family`). Adding a family is adding its file.

`load_model_config(dir)` reads a Hugging Face directory's config.json through the family that
serves its architecture; gguf_file.GGUFFile asks `gguf_family(file)` for a GGUF file's.
"""

from __future__ import annotations

import importlib
import pkgutil
from pathlib import Path

from flover.models.families._shared import Family, check_fields, read_json, special_ids
from flover.models.model_config import CheckpointError, ModelConfig, validate_model_config


def _discover() -> dict[str, Family]:
    found = {}
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        if not info.name.startswith("_"):
            family = importlib.import_module(f"{__name__}.{info.name}").FAMILY
            assert family.name == info.name, f"{info.name}.py states the family {family.name!r}"
            found[family.name] = family
    return found


FAMILIES: dict[str, Family] = _discover()
BY_ARCHITECTURE = {arch: f for f in FAMILIES.values() for arch in f.hf_architectures}
SUPPORTED = tuple(BY_ARCHITECTURE)  # every config.json architecture served
GGUF_ARCHES = tuple(dict.fromkeys(a for f in FAMILIES.values() for a in f.gguf_arches))


def family_of(cfg: ModelConfig) -> Family:
    """The family of a model read from either kind of file."""
    return BY_ARCHITECTURE[cfg.architecture]


def runs_natively(cfg: ModelConfig) -> bool:
    """Whether the native step knows this model's features (its family's)."""
    return family_of(cfg).native


def gguf_family(file) -> Family | None:
    """The family of a GGUF file (gguf_file.GGUFFile): of its general.architecture, the one that
    claims it, else the one that claims nothing; None where no family reads that arch."""
    candidates = [f for f in FAMILIES.values() if file.arch in f.gguf_arches]
    claiming = [f for f in candidates if f.gguf_claims is not None and f.gguf_claims(file)]
    unclaiming = [f for f in candidates if f.gguf_claims is None]
    return (claiming or unclaiming or [None])[0]


def decoder_scorer(architectures) -> str | None:
    """For a decoder's *ForSequenceClassification (Qwen3-Reranker's "seq-cls" conversions: its base
    model and a `score` head on the last token), the *ForCausalLM whose family reads it; else None."""
    if not isinstance(architectures, list) or not architectures or not isinstance(architectures[0], str):
        return None
    stem = architectures[0].removesuffix("ForSequenceClassification")
    causal = stem + "ForCausalLM"
    return causal if stem != architectures[0] and causal in BY_ARCHITECTURE else None


def load_model_config(model_dir: str | Path) -> ModelConfig:
    """A Hugging Face directory's config.json (and generation_config.json's special ids), read by
    the family of its architecture and checked (model_config.validate_model_config)."""
    path = Path(model_dir) / "config.json"
    raw = read_json(path)
    archs = raw.get("architectures") or []
    arch = next((a for a in archs if a in BY_ARCHITECTURE), None) if isinstance(archs, list) else None
    scorer = arch is None and decoder_scorer(archs) is not None
    arch = decoder_scorer(archs) if scorer else arch
    if arch is None:
        raise CheckpointError(
            f"{path}: architecture {archs or raw.get('model_type')!r} is not supported; "
            f"flover serves {', '.join(SUPPORTED)}"
        )
    family = BY_ARCHITECTURE[arch]
    if isinstance(raw.get("text_config"), dict):  # (a multimodal checkpoint: its language model's fields)
        raw = {**raw, **raw["text_config"]}
    check_fields(raw, str(path), family.number_fields)
    try:
        fields = family.from_hf(raw)
    except KeyError as e:
        raise CheckpointError(f"{path}: missing field {e.args[0]!r} for {arch}") from None
    except (TypeError, ValueError, ZeroDivisionError, AttributeError) as e:
        raise CheckpointError(f"{path}: malformed ({e})") from None
    try:
        eos, bos = special_ids(Path(model_dir), raw)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{path}: eos_token_id / bos_token_id must be integers ({e})") from None
    dtype = raw.get("dtype") or raw.get("torch_dtype")
    if scorer:  # (no LM head in its files: the embedding stands in, and it serves scores only)
        fields["tie_word_embeddings"] = True
    config = ModelConfig(architecture=arch, eos_token_ids=eos, bos_token_id=bos, checkpoint_dtype=dtype, **fields)
    validate_model_config(config, str(path))
    return config
