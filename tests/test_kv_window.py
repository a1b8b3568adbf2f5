"""Sliding-window layers keep only their window (flover/runner/kv_window.py): the arithmetic
alone, then engines with the bound against engines without it (--full-window-kv) on prompts and
generations far past the window, with and without the prefix cache, on every path."""

from __future__ import annotations

import random

import pytest
import torch

from flover import Engine, EngineConfig, SamplingParams
from flover.engine.prefix_cache import PrefixCache
from flover.native.build import runnable_families
from flover.runner.kv_buffer import kv_cache_bytes
from flover.runner.kv_window import WindowedKV

T = 16  # block tokens


def test_the_bound_is_planned_only_where_it_saves_memory():
    assert WindowedKV.plan((None, None), 4096, 512, T) is None
    bound = WindowedKV.plan((512, 512, None, 512), 8192, 512, T)
    assert (bound.window, bound.chunk, bound.capacity, bound.layers) == (512, 512, 512 + T + 512, {0, 1, 3})
    assert WindowedKV.plan((8, None), 4096, 2048, T).chunk == 512  # a slot's writes per iteration, capped
    assert WindowedKV.plan((4096, None), 4096, 512, T) is None  # a window as long as the context: no gain


@pytest.mark.parametrize("seed", range(30))
def test_a_sliding_slot_always_holds_the_keys_its_queries_read(seed):
    """One slot's writes (prompt chunks, then decode rows with drafts) against its bound: every
    write lands inside the rows, every key a query of it reads is kept, and the base only rises."""
    rng = random.Random(seed)
    bound = WindowedKV.plan((rng.randint(1, 90), None), 10_000, rng.randint(16, 70), T)
    base, position, slides = 0, 0, 0
    while position < 2000:
        end = position + rng.randint(1, bound.chunk)
        shift = bound.shift(3, base, position, end)
        if shift is not None:
            assert shift.base > base and shift.base % T == 0 and shift.start == shift.base - base
            assert shift.count == position - shift.base  # the rows kept are the ones written since the new base
            base, slides = shift.base, slides + 1
        assert end - base <= bound.capacity  # every write lands in the slot's rows
        assert base <= max(0, position - bound.window + 1)  # the first query's window is kept whole
        position = end
    assert slides >= (2000 - bound.capacity) // bound.capacity  # it does slide (at least once a capacity)


def test_the_prefix_index_serves_only_prefixes_whose_window_it_kept():
    bound = WindowedKV(window=20, capacity=64, chunk=16, block_tokens=T, layers=frozenset({0}))
    cache = PrefixCache(32, T, bound)
    tokens = list(range(200))
    # saved from a slot whose windowed rows start at position 96: blocks 0-5 partial, 6-9 whole
    saved = cache.store(tokens, 160, slot=0, window_base=96)
    assert [c.window_row for c in saved] == [None] * 6 + [0, 16, 32, 48]
    copies = cache.lookup(tokens, 199, slot=2)
    # all 10 blocks match, and the 10th block's first query (160) reads back to 141: blocks 8-9, whole
    assert len(copies) == 10 and bound.base_for(160) == 128
    assert [c.window_row for c in copies] == [None] * 8 + [0, 16]
    # a prompt that shares only 100 tokens: a start after 6 blocks (96) needs block 4 and 5, partial
    other = tokens[:100] + [999] * 50
    assert cache.lookup(other, 149, slot=2) == []
    assert PrefixCache(32, T).lookup(other, 149, slot=2) == []  # (an index without the bound has nothing yet)


def long_jobs(seed: int, vocab: int = 500) -> list[tuple]:
    """Requests far past an 8-position window: prompts of 40-150 tokens, 20-60 generated, greedy
    and sampled, arriving over the first 30 iterations."""
    rng = random.Random(seed)
    jobs = []
    for i in range(8):
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(40, 150))]
        params = SamplingParams(
            max_new_tokens=rng.randint(20, 60),
            ignore_eos=True,
            temperature=rng.choice([0.0, 0.9]),
            seed=rng.randrange(1000),
            logprobs=True,
        )
        jobs.append((rng.randrange(30), prompt, params))
    return jobs


def run(engine: Engine, jobs: list[tuple]) -> dict[str, tuple[list[int], list[float]]]:
    finals, iteration = {}, 0
    while len(finals) < len(jobs):
        for i, (arrives, prompt, params) in enumerate(jobs):
            if arrives == iteration:
                engine.add_request(prompt, params, request_id=str(i))
        finals.update({o.request_id: (o.token_ids, o.logprobs) for o in engine.step() if o.finished})
        iteration += 1
    return finals


def generate(engine: Engine, prompt: list[int], params: SamplingParams):
    """One request alone, to its end: its final output."""
    engine.add_request(prompt, params)
    while True:
        for output in engine.step():
            if output.finished:
                return output


def engines(model_dir: str, dtype: str, **config) -> tuple[Engine, Engine]:
    """The same engine twice: sliding-window layers bounded (the default), and keeping everything."""
    settings = {**dict(dtype=dtype, max_slots=4, max_seq_len=256, max_batch_tokens=24, speculate=0), **config}
    return Engine(EngineConfig(model_dir, **settings)), Engine(EngineConfig(model_dir, full_window_kv=True, **settings))


PATHS = [("float64", "pytorch")] + [
    (dtype, family) for dtype in ("float32", "bfloat16") for family in runnable_families()
]


@pytest.mark.parametrize("dtype,family", PATHS)
@pytest.mark.parametrize("variant", ["gemma3", "mistral-window8"])
def test_bounded_windows_give_the_unbounded_tokens(make_model, monkeypatch, variant, dtype, family):
    """Same tokens as keeping every position; on the native step the same logprobs bit for bit (a
    query reads the same keys in the same order); the KV takes what the bound promises."""
    if family != "pytorch":
        monkeypatch.setenv("FLOVER_NATIVE_KERNELS", family)
    bounded, full = engines(make_model(variant), dtype, native_forward="off" if family == "pytorch" else "auto")
    assert (bounded.runner.native is None) == (family == "pytorch") == (full.runner.native is None)
    jobs = long_jobs(seed=len(variant))
    got, want = run(bounded, jobs), run(full, jobs)
    assert {k: v[0] for k, v in got.items()} == {k: v[0] for k, v in want.items()}
    if family == "pytorch":  # float64: the summation order over a shorter key range may differ
        for k in got:
            assert got[k][1] == pytest.approx(want[k][1], abs=1e-9)
    else:
        assert got == want

    window = bounded.buffer.window
    cfg = bounded.runner.model.cfg
    assert window is not None and full.buffer.window is None
    windowed = sum(w is not None for w in cfg.sliding_windows)
    kv = lambda layers, positions: kv_cache_bytes(  # noqa: E731
        layers, 4, bounded.tp.kv_heads, positions, cfg.head_dim, getattr(torch, dtype)
    )
    assert bounded.buffer.nbytes == kv(cfg.num_layers - windowed, 256) + kv(windowed, window.capacity)
    assert full.buffer.nbytes == kv(cfg.num_layers, 256)
    assert window.capacity == 16 + 16 + 32  # the window (8) and one block, rounded up, and the chunk (24, 32)


@pytest.mark.parametrize("native", ["off", "auto"])
def test_prefix_cache_with_bounded_windows(make_model, native):
    """A conversation's next turn starts after its cached history (whose last window the slot
    kept); a prompt that shares only an early part, whose windowed rows were gone, starts from
    scratch. Either way the tokens are those of an engine with neither the bound nor the cache."""
    model_dir = make_model("gemma3")
    settings = dict(dtype="float32", max_slots=2, max_seq_len=256, max_batch_tokens=24, speculate=0)
    cached = Engine(EngineConfig(model_dir, native_forward=native, **settings))
    plain = Engine(EngineConfig(model_dir, native_forward=native, full_window_kv=True, prefix_cache_mib=0, **settings))
    rng = random.Random(5)
    history = [rng.randrange(500) for _ in range(120)]
    params = SamplingParams(max_new_tokens=30, ignore_eos=True)
    first = generate(cached, history, params)
    turn = history + first.token_ids + [rng.randrange(500) for _ in range(10)]
    early = history[:90] + [rng.randrange(500) for _ in range(30)]
    outputs = {name: generate(cached, prompt, params) for name, prompt in (("turn", turn), ("early", early))}
    assert outputs["turn"].cached_tokens >= 144  # the history's blocks, up to the last whole window
    assert outputs["early"].cached_tokens == 0
    for name, prompt in (("turn", turn), ("early", early)):
        assert outputs[name].token_ids == generate(plain, prompt, params).token_ids
    assert generate(plain, history, params).token_ids == first.token_ids


def test_speculative_drafts_slide_the_window_too(make_model):
    """Greedy requests with prompt-lookup drafts (several positions a slot writes in one
    iteration, on the native step): the bounded engine gives the unbounded one's tokens, and
    drafts were verified."""
    bounded, full = engines(make_model("gemma3"), "float32", speculate=4, speculate_ngram=1)
    assert bounded.runner.native is not None
    for engine in (bounded, full):  # drafts sized by a fixed cost fit, not by this machine's timing (it flaked)
        engine.scheduler.iteration_cost.leader_knee = 64.0
    rng = random.Random(3)
    loop = [rng.randrange(500) for _ in range(12)]
    jobs = [
        (i, loop * 6 + [rng.randrange(500) for _ in range(i)], SamplingParams(max_new_tokens=100, ignore_eos=True))
        for i in range(4)
    ]
    assert run(bounded, jobs) == run(full, jobs)
    assert bounded.draft_tokens > 0 and bounded.accepted_tokens > 0, (bounded.draft_tokens, bounded.accepted_tokens)
