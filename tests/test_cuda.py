"""The CUDA path: the same engine on a GPU. Skipped, with the reason, where no GPU is present."""

from __future__ import annotations

import pytest
import torch
import transformers

from flover import LLM, SamplingParams
from tests.helpers import PROMPTS

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device on this machine (the CUDA path runs on GPU hosts)"
)


@pytest.mark.parametrize("variant", ["llama", "gptj"])
def test_cuda_logits_and_greedy_tokens_match_transformers(make_model, variant):
    model_dir = make_model(variant)
    llm = LLM(model_dir, dtype="float64", device="cuda", max_slots=4, max_seq_len=256)
    ref = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64).to("cuda").eval()
    outs = llm.generate(PROMPTS, SamplingParams(max_new_tokens=32, ignore_eos=True))
    for prompt, out in zip(PROMPTS, outs):
        ids = llm.tokenizer.encode(prompt)
        with torch.no_grad():
            expected_logits = ref(torch.tensor([ids], device="cuda")).logits[0]
            expected = ref.generate(
                torch.tensor([ids], device="cuda"), max_new_tokens=32, min_new_tokens=32, do_sample=False
            )
        # Not 1e-9 as on CPU: both normalise in float32 (as LlamaRMSNorm does, even for float64
        # models), and on CUDA our fused RMSNorm kernel and transformers' pow/mean/rsqrt sum in
        # different orders, in float32: ~1e-8 here. A wrong position, head or mask is >1e-2.
        assert (llm.engine.score(ids) - expected_logits).abs().max() <= 1e-6
        assert out.token_ids == expected[0, len(ids) :].tolist()
    assert llm.engine.runner.graphs.replays > 0  # the decode steps replayed captured graphs


@pytest.mark.parametrize("seed", [0, 1])
def test_cuda_graph_replays_give_the_eager_tokens(make_model, seed):
    """Requests of every length arriving at random iterations: the tokens with captured decode
    graphs (padded rows and key buckets) equal those of eager iterations (float64)."""
    from tests.helpers import run_random_arrivals

    model_dir = make_model("llama")
    captured, engine = run_random_arrivals(model_dir, seed, "auto", device="cuda")
    eager, _ = run_random_arrivals(model_dir, seed, "off", device="cuda")
    assert captured == eager
    graphs = engine.runner.graphs
    assert graphs.count == 4 * 2 and graphs.replays > 0 and graphs.padding_rows > 0


def test_cuda_float32_matches_cpu(make_model):
    model_dir = make_model("llama")
    ids = [3, 5, 7, 11, 13]
    gpu = LLM(model_dir, dtype="float32", device="cuda").engine.score(ids).cpu()
    cpu = LLM(model_dir, dtype="float32").engine.score(ids)
    assert (gpu - cpu).abs().max() <= 1e-4 * cpu.abs().max()


def _nccl_ready() -> str | None:
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        return "needs 2 CUDA devices"
    try:
        import cupy.cuda.nccl  # noqa: F401
    except ImportError:
        return "needs the gpu extra (cupy-cuda12x, nvidia-nccl-cu12)"
    return None


@pytest.mark.skipif(_nccl_ready() is not None, reason=f"NCCL tensor parallelism: {_nccl_ready()}")
def test_nccl_tp2_gives_the_tp1_tokens(make_model, tmp_path):
    from tests.helpers import REQUESTS, flover_run_ok, tokens_by_id, write_jsonl

    model_dir = make_model("llama")
    prompts = tmp_path / "in.jsonl"
    write_jsonl(prompts, REQUESTS)
    results = {}
    for ranks in (1, 2):
        out = tmp_path / f"tp{ranks}.jsonl"
        flover_run_ok(ranks, model_dir, prompts, out, "--device", "cuda", timeout=300)
        results[ranks] = tokens_by_id(out)
    assert results[2] == results[1] and len(results[1]) == len(REQUESTS)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_rms_norm_gives_llamarmsnorms_bits(dtype):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from flover.models.layers import rms_norm

    torch.manual_seed(0)
    x = (torch.randn(9, 576, device="cuda") * 4).to(dtype)
    ref = LlamaRMSNorm(576, eps=1e-5).to(device="cuda", dtype=dtype)
    with torch.no_grad():
        ref.weight.copy_(torch.randn(576))
        expected = ref(x)
    assert torch.equal(rms_norm(x, ref.weight.detach(), 1e-5), expected)
