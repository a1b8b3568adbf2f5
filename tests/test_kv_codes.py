"""--kv-dtype: K and V rows in llama.cpp's q8_0 / q4_0 blocks (models/kv_codes.py in PyTorch,
native/kv_codes.h in the native step): the bytes gguf-py's quantizer makes, the same bytes and
values from C on every kernel family, the native step's logits against PyTorch's on the same
codes, a row's tokens the same alone and fused, and the copies (shuffle, prefix cache, windows,
the prefix cache on disk) moving codes as they move 16-bit rows."""

from __future__ import annotations

import random
import signal

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

from flover.config import EngineConfig, SamplingParams
from flover.engine.engine import LLM, Engine
from flover.models.kv_codes import (
    CodeRows,
    code_scores,
    code_values,
    dequantize,
    position_bytes,
    quantize,
    quantize_queries,
    row_bytes,
)
from flover.native.abi import KV_Q4_0, KV_Q8_0, load_library
from flover.native.build import KERNELS_ENV, runnable_families
from tests.test_engine import check_fused_equals_solo

GGUF = {"q8_0": GGMLQuantizationType.Q8_0, "q4_0": GGMLQuantizationType.Q4_0}
CODES = {"q8_0": KV_Q8_0, "q4_0": KV_Q4_0}


def rows_to_quantize(seed: int, d: int = 64) -> torch.Tensor:
    """Rows of every kind a cache sees: normal values, a zero block, tiny scales (float16
    subnormals), ties of the largest magnitude with either sign, bfloat16 values."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(40, d, generator=g) * torch.logspace(-6, 2, 40)[:, None]
    x[0, :32] = 0
    x[1, :32] = 1e-7 * torch.randn(32, generator=g)
    x[2, 3], x[2, 9] = 4.0, -4.0  # (q4_0: the first of the largest magnitudes sets the sign)
    x[3] = x[3].to(torch.bfloat16).float()
    return x


@pytest.mark.parametrize("kind", ["q8_0", "q4_0"])
def test_pytorchs_codes_are_ggufs_bytes_and_values(kind):
    x = rows_to_quantize(0)
    ours = quantize(x, kind)
    assert ours.shape == (40, row_bytes(kind, 64))
    theirs = quants.quantize(x.numpy(), GGUF[kind])
    assert np.array_equal(ours.numpy().reshape(theirs.shape), theirs)
    assert np.array_equal(dequantize(ours, kind, 64).numpy(), quants.dequantize(theirs, GGUF[kind]).reshape(40, 64))


@pytest.mark.parametrize("kind", ["q8_0", "q4_0"])
def test_attention_on_codes_is_the_quantized_queries_against_the_keys_values_and_the_values(kind):
    """code_scores: the queries' int8 codes are gguf's q8_0 codes of them (the scale kept in
    float32), and the scores are those queries' dot products with the keys' values; code_values
    weighs the values' values (float64 references)."""
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 3, 5, 64, generator=g) * torch.logspace(-3, 1, 5)[:, None]  # [.., queries, d]
    keys = quantize(torch.randn(2, 1, 7, 64, generator=g), kind)  # [.., keys, bytes]: broadcast over dim 1
    codes, scales = quantize_queries(q)
    q8 = torch.from_numpy(quants.quantize(q.reshape(-1, 64).numpy(), GGMLQuantizationType.Q8_0)).reshape(30, 2, 34)
    assert torch.equal(codes.reshape(30, 2, 32), q8[..., 2:].contiguous().view(torch.int8).float())
    assert torch.equal(
        scales.to(torch.float16), q8[..., :2].contiguous().view(torch.float16)[..., 0].reshape(2, 3, 5, 2)
    )
    queries = (codes.double() * scales.double()[..., None]).reshape(2, 3, 5, 64)
    values = dequantize(keys, kind, 64).double()
    expect = queries @ values.transpose(-1, -2)
    got = code_scores(q, CodeRows(keys, kind, 64))
    assert got.shape == (2, 3, 5, 7) and torch.allclose(got.double(), expect, rtol=1e-5, atol=1e-6 * expect.abs().max())
    weights = torch.softmax(torch.randn(2, 3, 5, 7, generator=g), dim=-1)
    expect = weights.double() @ values
    got = code_values(weights, CodeRows(keys, kind, 64))
    assert got.shape == (2, 3, 5, 64) and torch.allclose(got.double(), expect, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("family", runnable_families())
@pytest.mark.parametrize("kind", ["q8_0", "q4_0"])
def test_the_native_steps_codes_and_values_are_pytorchs_on_every_kernel_family(kind, family):
    """kv_codes.h's quantizer writes PyTorch's bytes; its reader gives PyTorch's values, in float32
    and rounded to bfloat16 (each family's own vector code)."""
    lib = load_library(family)
    x = rows_to_quantize(1, 96)
    out = torch.empty(40, row_bytes(kind, 96), dtype=torch.uint8)
    lib.flover_kv_quantize(x.data_ptr(), out.data_ptr(), 40, 96, CODES[kind])
    assert torch.equal(out, quantize(x, kind))
    for bf, dtype in ((0, torch.float32), (1, torch.bfloat16)):
        values = torch.empty(40, 96)
        lib.flover_kv_dequantize(out.data_ptr(), 40, 96, CODES[kind], bf, values.data_ptr())
        assert torch.equal(values, dequantize(out, kind, 96).to(dtype).float())


def test_the_cache_takes_the_bytes_its_kinds_say_and_refuses_what_they_cannot_hold(make_model):
    """A position's bytes: K's row then V's; --kv-dtype's choices, heads of whole blocks, the CPU."""
    assert position_bytes(64, torch.bfloat16, None) == 256
    assert position_bytes(64, torch.bfloat16, ("q8_0", "q4_0")) == 68 + 36
    engine = Engine(EngineConfig(make_model("llama-head64"), dtype="bfloat16", kv_dtype="q8_0,q4_0", max_slots=2))
    kv = engine.runner.buffer.layers[0]
    assert kv.rows.dtype == torch.uint8 and kv.rows.shape[-1] == 104 and kv.v.start == 68
    assert engine.stats().kv_bytes_per_token == 2 * 2 * 104  # 2 layers, 2 kv heads
    with pytest.raises(ValueError, match="auto, or K"):
        EngineConfig(make_model("llama"), kv_dtype="q5_0").validate()
    with pytest.raises(ValueError, match="heads have 16 dims"):
        Engine(EngineConfig(make_model("llama"), kv_dtype="q8_0"))


@pytest.mark.parametrize("variant", ["llama-head64", "mistral-window8-head32"])
@pytest.mark.parametrize("kv_dtype", ["q8_0", "q4_0", "q8_0,q4_0"])
def test_native_step_gives_the_pytorch_logits_on_kv_codes(make_model, variant, kv_dtype, monkeypatch):
    """The native step reads the codes (decode rows, prompt blocks, a sliding window) as PyTorch
    does (int8 queries against the keys' codes, value scales in the weights), in float32: the
    summation order's noise (2e-7 of the logits, as with float32 KV), and where the two paths'
    inputs differ in their last bit a code (of a key, a value or a query) may round the other way
    (one step of its block: up to ~1e-4 of a logit here and there). A scale read from the wrong
    block or row is off by the logits' own size."""
    from tests.test_native_forward import compare_on_random_arrivals

    for family in runnable_families():
        monkeypatch.setenv(KERNELS_ENV, family)
        compared, engine = compare_on_random_arrivals(make_model(variant), "float32", kv_dtype=kv_dtype)
        assert engine.runner.buffer.kv_kinds is not None
        relative = sorted(diff / max(1.0, scale) for _, _, diff, scale, _ in compared)
        assert relative[len(relative) // 2] <= 2e-6 and relative[-1] <= 1e-3, (family, relative[-5:])
        assert sum(1 for decode, prompt, *_ in compared if decode and prompt) > 5


@pytest.mark.parametrize(
    "variant,seed,dtype,kv_dtype",
    [
        ("llama-head64", 0, "bfloat16", "q8_0"),
        ("llama-head64", 1, "float32", "q4_0"),
        ("mistral-window8-head32", 2, "bfloat16", "q8_0,q4_0"),
        ("llama-head64", 3, "float64", "q4_0,q8_0"),  # (PyTorch's forward)
    ],
)
def test_a_requests_tokens_on_kv_codes_do_not_depend_on_what_it_is_fused_with(
    make_model, variant, seed, dtype, kv_dtype
):
    """The quantization of a row's keys and values never depends on other rows: fused = solo, bit
    for bit, through holes, chunked prompts and the shuffle."""
    check_fused_equals_solo(make_model(variant), seed, dtype, kv_dtype=kv_dtype)


def test_cached_prefixes_and_their_files_carry_codes(make_model, tmp_path):
    """The prefix cache's copies and its files move the codes: a resent history (from memory, and
    after a restart from disk) gives the tokens of a run without any cache."""
    model = make_model("llama-head64")
    options = dict(dtype="bfloat16", kv_dtype="q8_0,q4_0", max_slots=2, max_seq_len=256, speculate=0)
    rng = random.Random(4)
    first = [[rng.randrange(3, 500) for _ in range(70)] for _ in range(2)]
    greedy = SamplingParams(max_new_tokens=5, ignore_eos=True)
    before = LLM(model, prefix_cache_dir=str(tmp_path), **options)
    answers = before.generate(first, greedy)
    turns = [p + list(a.token_ids) + [9] for p, a in zip(first, answers)]
    in_memory = before.generate(turns, greedy)
    before.engine.shutdown()
    after = LLM(model, prefix_cache_dir=str(tmp_path), **options).generate(turns, greedy)
    cold = LLM(model, prefix_cache_mib=0, **options).generate(turns, greedy)
    assert all(o.cached_tokens >= 64 for o in in_memory + after)
    assert [o.token_ids for o in in_memory] == [o.token_ids for o in after] == [o.token_ids for o in cold]


def test_tp2_and_pp2_on_kv_codes_give_the_single_engines_tokens(make_model, tmp_path):
    """Each rank keeps its kv heads' codes (--tp 2), each stage its layers' (--pp 2, plans in
    flight): both give one engine's greedy tokens (float32, the native step; only the
    all-reduces' order differs, and no stage changes a number)."""
    from tests.helpers import REQUESTS, flover_run_ok, tokens_by_id, write_jsonl

    prompts = tmp_path / "in.jsonl"
    write_jsonl(prompts, REQUESTS)
    results = {}
    for name, ranks, flags in (("one", 1, ()), ("tp2", 2, ("--tp", "2")), ("pp2", 2, ("--pp", "2"))):
        out = tmp_path / f"{name}.jsonl"
        flover_run_ok(
            ranks, make_model("llama-head64"), prompts, out, "--dtype", "float32", "--kv-dtype", "q8_0,q4_0", *flags
        )
        results[name] = tokens_by_id(out)
    assert len(results["one"]) == len(REQUESTS) and results["tp2"] == results["one"] == results["pp2"]


def test_flover_serve_answers_from_codes_over_zeromq_and_http_as_llm_does(make_model):
    """A real daemon with --kv-dtype q8_0,q4_0 (float32, the native step): the ZeroMQ client gets
    LLM's tokens on the same codes, stats count the codes' bytes, and the HTTP front's completion
    of the same prompt is the same text."""
    import httpx

    from tests.helpers import Server, free_port

    model, codes = make_model("llama-head64"), ("--dtype", "float32", "--kv-dtype", "q8_0,q4_0")
    prompt = [(7 * i) % 400 + 1 for i in range(40)]
    offline = LLM(model, dtype="float32", kv_dtype="q8_0,q4_0", max_seq_len=256)
    want = offline.generate([prompt], SamplingParams(max_new_tokens=8, ignore_eos=True))[0]
    port = free_port()
    server = Server(model, *codes, "--http", f"127.0.0.1:{port}")
    try:
        with server.client() as c:
            got = c.generate(input_ids=prompt, max_new_tokens=8, ignore_eos=True)
            stats = c.stats()
        body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
        answer = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=60)
    finally:
        server.stop(signal.SIGKILL)
    assert got["token_ids"] == want.token_ids
    cfg = offline.engine.model_config  # (a K row of q8_0 and a V row of q4_0 a layer and kv head)
    per_token = cfg.num_layers * cfg.num_kv_heads * position_bytes(cfg.head_dim, torch.float32, ("q8_0", "q4_0"))
    assert stats["kv_bytes_per_token"] == offline.engine.stats().kv_bytes_per_token == per_token
    assert answer.status_code == 200, answer.text
    assert answer.json()["choices"][0]["text"] == want.text
