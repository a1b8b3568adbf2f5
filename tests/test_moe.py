"""Mixtures of experts (Qwen3-MoE, Mixtral, gpt-oss): their configs from Hugging Face directories and GGUF
files, fused against solo on the native step and on PyTorch (routing where every row picks the
same experts and where the rows spread over them), a file's own codes, and the expert load an
operator sees. (float64 against transformers: test_reference.py and test_gguf.py; native against
PyTorch on every kernel family: test_native_forward.py; tensor parallelism: test_tensor_parallel.py.)"""

from __future__ import annotations

import json
import random
import shutil

import pytest
import torch

from flover import LLM, SamplingParams
from flover.models import CheckpointError, load_model_config
from flover.models.checkpoint import open_checkpoint
from flover.testing.tiny_model import write_gguf
from tests.helpers import Server

pytest.importorskip("gguf")


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
    (model / "config.json").write_text(json.dumps({**config, "num_experts": 5000}))
    with pytest.raises(CheckpointError, match="num_experts must be an integer in"):
        load_model_config(model)
    mixtral = load_model_config(make_model("mixtral")).moe
    assert (mixtral.experts, mixtral.top_k, mixtral.intermediate, mixtral.layers) == (4, 2, 64, {0, 1})
    assert mixtral.block == "block_sparse_moe" and mixtral.weights_float32


@pytest.mark.parametrize("variant", ["qwen3-moe", "mixtral", "gpt-oss"])
def test_a_gguf_file_says_what_the_directory_says(make_model, tmp_path, variant):
    """As llama.cpp's converter writes them: qwen3moe, Mixtral as a llama file with experts, and
    gpt-oss (its window every other layer, YaRN, sinks, biases); the layers of experts are those
    with a router (ffn_gate_inp)."""
    path = write_gguf(make_model(variant), tmp_path / f"{variant}.gguf", "Q8_0")
    from_file, from_dir = open_checkpoint(path).model_config(), load_model_config(make_model(variant))
    for field in ("architecture", "sliding_windows", "qkv_bias", "o_bias", "attn_sinks"):
        assert getattr(from_file, field) == getattr(from_dir, field), field
    fields = ("experts", "top_k", "intermediate", "norm_topk_prob", "layers", "weights_float32", "router_bias")
    for field in fields + ("softmax_after_topk", "expert_bias", "swiglu_limit", "swiglu_alpha"):
        assert getattr(from_file.moe, field) == getattr(from_dir.moe, field), field
    if variant == "gpt-oss":
        rope = {k: from_dir.rope_scaling[k] for k in from_file.rope_scaling}
        assert from_file.rope_scaling == rope


def with_router(model_dir: str, out, scale: float) -> str:
    """A copy of the checkpoint with every router's weights (and bias) times `scale` (0: every expert ties)."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(model_dir, out)
    weights = load_file(f"{out}/model.safetensors")
    for name in weights:
        if name.endswith((".gate.weight", ".router.weight", ".router.bias")):
            weights[name] = weights[name] * scale
    save_file(weights, f"{out}/model.safetensors", metadata={"format": "pt"})
    return str(out)


# the GGUF files (block type, and those of tensors named so) the "file" cases run on their own codes
FILES = {"qwen3-moe": ("Q4_0", None), "gpt-oss": ("Q8_0", {"_exps.weight": "MXFP4"})}
CASES = {  # name -> (variant, dtype, engine options)
    "qwen3-moe-native-float32": ("qwen3-moe", "float32", {}),
    "qwen3-moe-native-bfloat16": ("qwen3-moe", "bfloat16", {}),
    "qwen3-moe-pytorch-float64": ("qwen3-moe", "float64", {"native_forward": "off"}),  # (its exact dtype)
    "mixtral-native-bfloat16": ("mixtral", "bfloat16", {}),
    "qwen3-moe-Q4_0-file": ("qwen3-moe", "bfloat16", {"quantization": "file"}),
    "gpt-oss-native-bfloat16": ("gpt-oss", "bfloat16", {}),
    "gpt-oss-MXFP4-file": ("gpt-oss", "bfloat16", {"quantization": "file"}),
}


@pytest.mark.parametrize("routing", ["spread", "tied"])
@pytest.mark.parametrize("case", list(CASES))
def test_fused_rows_give_each_request_its_solo_tokens(make_model, tmp_path, case, routing):
    """Requests fused in one engine (prompt chunks and decode rows routed together) get the tokens
    each gets alone: a row's experts and sums do not depend on the other rows. "spread": routers
    times 50, so that the rows of one iteration go to most experts; "tied": routers of zeros, so
    that every row of every iteration picks the same experts (the lowest indices)."""
    variant, dtype, options = CASES[case]
    model = with_router(make_model(variant), tmp_path / "m", 50.0 if routing == "spread" else 0.0)
    if options.get("quantization") == "file":
        qtype, types = FILES[variant]
        model = str(write_gguf(model, tmp_path / "m.gguf", qtype, types=types))
    rng = random.Random(0)
    prompts = [[rng.randrange(1, 500) for _ in range(rng.randint(3, 40))] for _ in range(6)]
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    fused = LLM(model, dtype=dtype, max_slots=6, max_seq_len=128, max_batch_tokens=32, speculate=0, **options)
    assert (fused.engine.runner.native is None) == (options.get("native_forward") == "off")
    together = [o.token_ids for o in fused.generate(prompts, params)]
    load = fused.engine.stats().expert_load
    experts, top_k = fused.engine.model_config.moe.experts, fused.engine.model_config.moe.top_k
    rows = sum(len(p) + 24 - 1 for p in prompts)  # every prompt row and every decode row but the last
    for layer in load:  # each layer of experts saw every row, top_k times
        assert sum(layer["rows"]) == rows * top_k, layer
        used = sum(1 for n in layer["rows"] if n)
        if routing == "tied" and fused.engine.runner.native is not None:
            assert layer["rows"][:top_k] == [rows] * top_k, layer  # the first among equals, as torch.topk
        else:
            assert used >= (top_k if routing == "tied" else experts - 1), layer
    solo = LLM(model, dtype=dtype, max_slots=1, max_seq_len=128, **options)
    assert together == [solo.generate([p], params)[0].token_ids for p in prompts]


@pytest.mark.parametrize("variant", ["qwen3-moe", "gpt-oss"])
def test_an_iteration_past_the_fused_region_gets_the_same_tokens(make_model, tmp_path, variant):
    """A file's experts run in one parallel region for iterations of up to 512 / top_k rows
    (experts.c's experts_fused) and expert by expert beyond. A 300-token prompt prefilled as one
    iteration (past 256 rows at top 2) and as iterations of 32 rows gives the same tokens: the
    two paths take the same tiles and sum each row's experts in the same order."""
    model = with_router(make_model(variant), tmp_path / "m", 50.0)
    assert load_model_config(model).moe.top_k == 2
    qtype, types = FILES[variant]
    model = str(write_gguf(model, tmp_path / "m.gguf", qtype, types=types))
    prompt = [random.Random(1).randrange(1, 500) for _ in range(300)]
    params = SamplingParams(max_new_tokens=16, ignore_eos=True)
    tokens, widest = {}, {}
    for chunk in (512, 32):
        engine = LLM(
            model,
            dtype="bfloat16",
            max_slots=1,
            max_seq_len=400,
            max_batch_tokens=chunk,
            speculate=0,
            quantization="file",
        ).engine
        engine.add_request(prompt, params, request_id="long")
        done, widest[chunk] = [], 0
        while engine.has_unfinished():
            done += [o for o in engine.step() if o.finished]
            widest[chunk] = max([widest[chunk]] + [rows for _, rows in engine.timed_iterations()])
        tokens[chunk] = done[0].token_ids
    assert widest == {512: 300, 32: 32}
    assert tokens[512] == tokens[32]


def test_the_daemon_reports_the_rows_each_expert_took(make_model):
    """stats over the socket and /metrics' flover:expert_rows_total per layer and expert."""
    from prometheus_client.parser import text_string_to_metric_families

    from flover.server.prometheus import render

    server = Server(make_model("qwen3-moe"))
    try:
        with server.client() as c:
            out = c.generate(input_ids=[5, 6, 7, 8], max_new_tokens=6, ignore_eos=True)
            stats = c.stats()
    finally:
        server.stop()
    assert len(out["token_ids"]) == 6
    load = stats["expert_load"]
    assert [layer["layer"] for layer in load] == [0, 2] and all(len(layer["rows"]) == 8 for layer in load)
    assert all(sum(layer["rows"]) == (4 + 5) * 2 for layer in load)  # 4 prompt rows, 5 decode rows, 2 experts each
    samples = {
        (s.labels["layer"], s.labels["expert"]): s.value
        for family in text_string_to_metric_families(render(stats, "m").decode())
        for s in family.samples
        if s.name == "flover:expert_rows_total"
    }
    assert samples == {(str(layer["layer"]), str(e)): n for layer in load for e, n in enumerate(layer["rows"])}


def test_gpt_oss_config(make_model):
    """gpt-oss: attention sinks, a window then a full layer, YaRN, a biased router taking a softmax
    over its top k, biased experts with the clamped SwiGLU, stacked in the checkpoint."""
    cfg = load_model_config(make_model("gpt-oss"))
    moe = cfg.moe
    assert cfg.attn_sinks and cfg.sliding_windows == (8, None) and cfg.qkv_bias and cfg.o_bias
    assert cfg.rope_scaling["rope_type"] == "yarn" and cfg.rope_scaling["factor"] == 4.0
    assert (moe.experts, moe.top_k, moe.intermediate, moe.router) == (4, 2, 64, "router")
    assert moe.softmax_after_topk and moe.expert_bias and moe.stacked == "interleaved" and moe.swiglu_limit == 7.0


def test_a_layer_of_experts_holds_no_dense_mlp(make_model):
    """The dense MLP of a layer of experts does not exist (no memory for it); a dense layer's does."""
    llm = LLM(make_model("qwen3-moe"), dtype="float32", max_slots=1, native_forward="off")
    layers = llm.engine.runner.model.layers
    assert layers[0].gate_up is None and layers[0].experts is not None and layers[1].experts is None
    assert torch.count_nonzero(layers[0].experts.router) > 0


def test_a_stacked_experts_tensor_of_another_shape_or_with_nan_is_refused_by_name(make_model, tmp_path):
    """gpt-oss's stacked experts are input: fewer experts than config.json says, or a NaN, is a
    clear error naming the tensor (before anything is served)."""
    from safetensors.torch import load_file, save_file

    name = "model.layers.1.mlp.experts.gate_up_proj"
    for case, change in (
        ("short", lambda t: t[:2]),
        ("nan", lambda t: t.index_fill(1, torch.tensor([3]), float("nan"))),
    ):
        model = shutil.copytree(make_model("gpt-oss"), tmp_path / case)
        weights = load_file(f"{model}/model.safetensors")
        weights[name] = change(weights[name]).contiguous()
        save_file(weights, f"{model}/model.safetensors", metadata={"format": "pt"})
        expected = "expected \\[experts" if case == "short" else "not finite"
        with pytest.raises(CheckpointError, match=f"{name}.*{expected}"):
            LLM(str(model), dtype="float32", max_slots=1, native_forward="off")
