"""Qwen3.5 / 3.6 MoE: Qwen3.5's layers (families/qwen3_5.py) with experts in every layer (the
softmax over all in float32, the top k always renormalised) plus a shared expert whose output
is gated by sigmoid(shared_expert_gate(x))."""

import dataclasses

from flover.models.families import qwen3_5
from flover.models.families._shared import Family, expert_counts
from flover.models.model_config import MoEConfig, check_sizes

GGUF_NAMES = {
    **qwen3_5.GGUF_NAMES,
    "mlp.shared_expert.gate_proj.weight": "ffn_gate_shexp.weight",
    "mlp.shared_expert.up_proj.weight": "ffn_up_shexp.weight",
    "mlp.shared_expert.down_proj.weight": "ffn_down_shexp.weight",
    "mlp.shared_expert_gate.weight": "ffn_gate_inp_shexp.weight",
}


def from_hf(raw: dict) -> dict:
    experts, top_k = expert_counts(raw)
    widths = {k: raw.get(k, 512) for k in ("moe_intermediate_size", "shared_expert_intermediate_size")}
    check_sizes(widths, "config.json")
    moe = MoEConfig(
        experts=experts,
        top_k=top_k,
        intermediate=widths["moe_intermediate_size"],
        norm_topk_prob=True,
        layers=frozenset(range(raw["num_hidden_layers"])),
        shared_intermediate=widths["shared_expert_intermediate_size"],
    )
    fields = qwen3_5.from_hf({"intermediate_size": widths["moe_intermediate_size"], **raw})
    return fields | dict(moe=moe)


def from_gguf(file, cfg):
    """Its experts as every GGUF file's; the shared expert's width as llama.cpp reads it."""
    if cfg.moe is None:
        file.require(f"{file.arch}.expert_count")
    shared = file.integer(f"{file.arch}.expert_shared_feed_forward_length", required=True)
    check_sizes({f"{file.arch}.expert_shared_feed_forward_length": shared}, str(file.path))
    cfg = dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, shared_intermediate=shared))
    return qwen3_5.from_gguf(file, cfg)


def test_gguf_metadata(config: dict) -> dict:
    keys = qwen3_5.test_gguf_metadata(config) | {
        "expert_shared_feed_forward_length": config["shared_expert_intermediate_size"]
    }
    return {
        k.replace("qwen35.", "qwen35moe.") if k.startswith("qwen35.") else f"qwen35moe.{k}": v for k, v in keys.items()
    }


def test_kwargs(preset: dict, eos_id: int) -> dict:
    """As the hub's configs: no dense intermediate_size (so llama.cpp's converter writes no
    feed_forward_length either)."""
    kwargs = {k: v for k, v in qwen3_5.test_kwargs(preset, eos_id).items() if k != "intermediate_size"}
    return kwargs | dict(
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=64
    )


FAMILY = Family(
    name="qwen3_5_moe",
    hf_architectures=("Qwen3_5MoeForCausalLM", "Qwen3_5MoeForConditionalGeneration"),
    from_hf=from_hf,
    gguf_arch="qwen35moe",
    from_gguf=from_gguf,
    gguf_names=GGUF_NAMES,
    test_config="Qwen3_5MoeTextConfig",
    test_kwargs=test_kwargs,
    test_gguf_metadata=test_gguf_metadata,
    test_gguf_tensors=qwen3_5.test_gguf_tensors,
    number_fields=qwen3_5.FAMILY.number_fields,
)
