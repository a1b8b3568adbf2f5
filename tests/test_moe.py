"""Mixtures of experts (Qwen3-MoE) on the PyTorch path: the config, fused against solo, what is
refused. (float64 tokens and logits against transformers: test_reference.py's qwen3-moe variant.)"""

from __future__ import annotations

import json
import random

import pytest
import torch

from flover import LLM, SamplingParams
from flover.models.llama import LlamaForCausalLM
from flover.models.model_config import CheckpointError, load_model_config
from flover.models.tp_layout import TPLayout


def test_the_config_says_which_layers_have_experts(make_model, tmp_path):
    cfg = load_model_config(make_model("qwen3-moe"))
    moe = cfg.moe
    assert (moe.experts, moe.top_k, moe.intermediate, moe.norm_topk_prob) == (8, 2, 32, True)
    assert moe.layers == {0, 2} and cfg.qk_norm == "head"  # layer 1 is in mlp_only_layers
    model = tmp_path / "m"
    model.mkdir()
    with open(f"{make_model('qwen3-moe')}/config.json") as f:
        config = json.load(f)
    (model / "config.json").write_text(json.dumps({**config, "decoder_sparse_step": 2, "mlp_only_layers": []}))
    assert load_model_config(model).moe.layers == {1}
    (model / "config.json").write_text(json.dumps({**config, "num_experts_per_tok": 9}))
    with pytest.raises(CheckpointError, match="num_experts_per_tok 9 of 8 experts"):
        load_model_config(model)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fused_rows_give_each_request_its_solo_tokens(make_model, dtype):
    """Requests fused in one engine (prompt chunks and decode rows routed together) get the
    tokens each gets alone: a row's experts and sums do not depend on the other rows."""
    model = make_model("qwen3-moe")
    rng = random.Random(0)
    prompts = [[rng.randrange(1, 500) for _ in range(rng.randint(3, 40))] for _ in range(6)]
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    fused = LLM(model, dtype=dtype, max_slots=6, max_seq_len=128, max_batch_tokens=32)
    assert fused.engine.runner.native is None  # experts run on PyTorch (the native step declines them)
    together = [o.token_ids for o in fused.generate(prompts, params)]
    solo = LLM(model, dtype=dtype, max_slots=1, max_seq_len=128)
    assert together == [solo.generate([p], params)[0].token_ids for p in prompts]


def test_tensor_parallelism_is_refused_with_the_reason(make_model):
    cfg = load_model_config(make_model("qwen3-moe"))
    with pytest.raises(ValueError, match="mixtures of experts do not run under tensor parallelism"):
        LlamaForCausalLM(cfg, TPLayout.build(cfg, 0, 2), None, 64, torch.float32, torch.device("cpu"))
