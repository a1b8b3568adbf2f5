"""Vectorised sampling against its definitions (and transformers' repetition penalty)."""

from __future__ import annotations

import functools

import pytest
import torch
import transformers

from flover.native.abi import load_library
from flover.native.build import NativeUnavailable, runnable_families
from flover.native.sampling import NativeSampler
from flover.runner.sampler import SamplingTensors, counter_uniform, greedy_ids, sample


@functools.cache
def native_sampler(family: str = "auto") -> NativeSampler:
    return NativeSampler(load_library(family), threads=2)


@pytest.fixture(params=["pytorch", "native"])
def draw(request):
    """`sample` on each of its paths: PyTorch's tensor operations, and the native step's C
    (flover/native/sampling.c) for float32 logits on CPU."""
    if request.param == "pytorch":
        return sample
    try:
        return functools.partial(sample, native=native_sampler())
    except NativeUnavailable as e:
        pytest.skip(f"the native step cannot be built here: {e}")


def tensors(
    rows: int,
    *,
    temperature=1.0,
    top_k=0,
    top_p=1.0,
    min_p=0.0,
    penalty=1.0,
    seed=0,
    counter=None,
    history=None,
    logprobs=False,
) -> SamplingTensors:
    full = lambda v, dt: torch.full((rows,), v, dtype=dt)  # noqa: E731
    return SamplingTensors(
        temperature=full(temperature, torch.float32),
        top_k=full(top_k, torch.int64),
        top_p=full(top_p, torch.float32),
        min_p=full(min_p, torch.float32),
        repetition_penalty=full(penalty, torch.float32),
        seed=full(seed, torch.int64),
        counter=torch.arange(rows) if counter is None else counter,
        all_greedy=temperature == 0,
        history=history,
        want_logprobs=logprobs,
    )


def test_counter_uniform_is_deterministic_and_uniform():
    seeds = torch.full((100_000,), 42, dtype=torch.int64)
    u = counter_uniform(seeds, torch.arange(100_000))
    assert torch.equal(u, counter_uniform(seeds, torch.arange(100_000)))
    assert 0 <= u.min() and u.max() < 1
    hist = torch.histc(u.float(), bins=10, min=0, max=1) / u.numel()
    assert (hist - 0.1).abs().max() < 0.005
    other = counter_uniform(torch.full((100_000,), 43, dtype=torch.int64), torch.arange(100_000))
    assert (u - other).abs().mean() > 0.2


def test_empirical_distribution_matches_softmax(draw):
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0])
    n = 40_000
    ids, _ = draw(logits.repeat(n, 1), tensors(n, temperature=0.8, seed=7))
    freq = torch.bincount(ids, minlength=5).double() / n
    assert (freq - torch.softmax(logits.double() / 0.8, 0)).abs().max() < 0.01


def test_filters_keep_only_allowed_tokens(draw):
    torch.manual_seed(0)
    logits = torch.randn(1, 100).repeat(5000, 1)
    top5 = set(logits[0].topk(5).indices.tolist())
    ids, _ = draw(logits, tensors(5000, top_k=5, seed=1))
    assert set(ids.tolist()) <= top5 and len(set(ids.tolist())) == 5

    probs = torch.softmax(logits[0], 0)
    order = probs.argsort(descending=True)
    nucleus = set(order[: int((probs[order].cumsum(0) < 0.5).sum()) + 1].tolist())
    ids, _ = draw(logits, tensors(5000, top_p=0.5, seed=2))
    assert set(ids.tolist()) == nucleus

    allowed = set((probs >= 0.3 * probs.max()).nonzero().flatten().tolist())
    ids, _ = draw(logits, tensors(5000, min_p=0.3, seed=3))
    assert set(ids.tolist()) == allowed


def test_greedy_rows_and_degenerate_filters_pick_the_argmax(draw):
    torch.manual_seed(1)
    logits = torch.randn(6, 50)
    best = logits.argmax(-1)
    for st in (tensors(6, temperature=0.0), tensors(6, top_k=1), tensors(6, min_p=1.0)):
        ids, _ = draw(logits, st)
        assert torch.equal(ids, best)
    mixed = tensors(6)
    mixed.temperature[::2] = 0  # greedy and sampled rows in one batch
    ids, _ = draw(logits, mixed)
    assert torch.equal(ids[::2], best[::2])


def test_repetition_penalty_matches_transformers(draw):
    torch.manual_seed(2)
    logits = torch.randn(2, 30)
    history = [[1, 5, 5, 7], [2, 3]]
    expected = logits.clone()
    for row, penalty in enumerate((1.3, 0.7)):
        proc = transformers.RepetitionPenaltyLogitsProcessor(penalty)
        expected[row] = proc(torch.tensor([history[row]]), logits[row : row + 1].clone())[0]
    st = tensors(2, temperature=0.0, history=history, logprobs=True)
    st.repetition_penalty.copy_(torch.tensor([1.3, 0.7]))
    st.top_logprobs = 3
    ids, logprobs = draw(logits, st)
    assert torch.equal(ids, expected.argmax(-1))
    # log-probabilities are reported for the model's own distribution (before the penalty)
    reference = torch.log_softmax(logits, -1)
    assert torch.allclose(logprobs.chosen, reference.gather(1, ids[:, None]).squeeze(1))
    top = reference.topk(3, dim=-1)
    assert torch.equal(logprobs.top_ids, top.indices) and torch.allclose(logprobs.top_values, top.values)
    rows = logprobs.rows()
    assert [len(alternatives) for _, alternatives in rows] == [3, 3]
    assert rows[1][1][0] == (int(top.indices[1, 0]), float(top.values[1, 0]))


def test_frequency_and_presence_penalties_follow_openais_definition(draw):
    """logit[j] -= frequency x count[j] + presence x (count[j] > 0), over generated tokens only.
    Row 0: token 4 (generated 3x) loses 3 x 0.5 + 1 = 2.5, token 2 (once) 1.5, and the unpenalised
    token 6 wins; row 1 has the same history with the penalties off; row 2: a negative presence
    penalty favours a repeat."""
    from flover.runner.sampler import apply_frequency_presence

    logits = torch.zeros(3, 8)
    logits[:, 4], logits[:, 6], logits[:, 2] = 3.0, 1.0, 2.0
    outputs = [[4, 4, 4, 2], [4, 4, 4, 2], [6]]
    frequency, presence = torch.tensor([0.5, 0.0, 0.0]), torch.tensor([1.0, 0.0, -2.5])
    expected = logits.clone()
    for row, tokens in enumerate(outputs):
        for j in set(tokens):
            expected[row, j] -= frequency[row] * tokens.count(j) + presence[row]
    penalised = logits.clone()
    apply_frequency_presence(penalised, frequency, presence, outputs)
    assert torch.equal(penalised, expected)
    st = tensors(3, temperature=0.0)
    st.frequency_penalty, st.presence_penalty, st.outputs = frequency, presence, outputs
    ids, _ = draw(logits, st)
    assert ids.tolist() == [6, 4, 6]  # row 0: 4 -> 0.5, 2 -> 0.5, 6 stays 1; row 2: 6 -> 3.5 > 3


@pytest.mark.parametrize("vocab", [4096, 49152, 50257, 4097])
def test_greedy_ids_are_argmax_with_ties_nans_and_a_short_last_chunk(vocab):
    """The two-step CPU argmax gives torch.argmax's ids: the first maximum, ties across and
    inside chunks, NaN as the maximum, -inf rows, the maximum in the short last chunk."""
    generator = torch.Generator().manual_seed(vocab)
    logits = torch.randn(12, vocab, generator=generator)
    logits[1, 5000 % vocab] = logits[1, 3 * vocab // 4] = 100.0  # a tie across chunks
    logits[2, 10] = logits[2, 11] = 100.0  # inside one chunk
    logits[3, vocab // 2] = float("nan")
    logits[4] = float("-inf")
    logits[5, vocab - 1] = 100.0  # last column (in the short chunk when vocab % 1024)
    logits[6] = 0.0  # all equal: id 0
    logits[7, vocab - 2] = logits[7, vocab - 1] = 100.0
    for dtype in (torch.float32, torch.bfloat16):
        x = logits.to(dtype)
        assert torch.equal(greedy_ids(x), x.argmax(-1)), dtype


def reference_sample(logits: torch.Tensor, st: SamplingTensors, filtered: bool = False) -> torch.Tensor:
    """The sampler's definition, over the whole vocabulary with a full sort: penalties on dense
    [B, vocab] counts, top-k, softmax, top-p by sorting (ties: lower id first), min-p, then the
    row's counter-based uniform number inverted through the cumulative sum in id order."""
    work = torch.promote_types(logits.dtype, torch.float32)
    logits = logits.to(work).clone()
    vocab = logits.shape[-1]
    if st.history is not None:
        for row, tokens in enumerate(st.history):
            if tokens and float(st.repetition_penalty[row]) != 1.0:
                ids = torch.tensor(sorted(set(tokens)))
                seen = logits[row, ids]
                logits[row, ids] = torch.where(
                    seen < 0, seen * st.repetition_penalty[row], seen / st.repetition_penalty[row]
                )
    if st.outputs is not None:
        counts = torch.zeros_like(logits)
        for row, tokens in enumerate(st.outputs):
            for j in tokens:
                counts[row, j] += 1
        logits -= st.frequency_penalty.to(work)[:, None] * counts + st.presence_penalty.to(work)[:, None] * (counts > 0)
    greedy = logits.argmax(-1)
    temperature = torch.where(st.temperature == 0, 1.0, st.temperature).to(work)
    scaled = logits / temperature[:, None]
    k = torch.where(st.top_k > 0, st.top_k.clamp(max=vocab), vocab)
    kth = scaled.sort(dim=-1, descending=True).values.gather(1, (k - 1)[:, None])
    scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    sorted_probs, order = probs.sort(dim=-1, descending=True, stable=True)
    before = sorted_probs.cumsum(dim=-1) - sorted_probs
    # top_p 1 is off, not a filter: the sums' rounding past 1 would drop a row's rarest tokens
    outside = (before > st.top_p[:, None].to(work)) & (st.top_p < 1)[:, None]
    probs = torch.zeros_like(probs).scatter_(1, order, sorted_probs.masked_fill(outside, 0.0))
    floor = st.min_p[:, None].to(work) * probs.max(dim=-1, keepdim=True).values
    probs = probs.masked_fill(probs < floor, 0.0)
    if filtered:
        return probs  # [B, vocab]: 0 outside the filters
    cdf = probs.cumsum(dim=-1)
    u = counter_uniform(st.seed, st.counter).to(work) * cdf[:, -1]
    drawn = torch.searchsorted(cdf, u[:, None], right=True).squeeze(1)
    last = torch.searchsorted(cdf, cdf[:, -1:].contiguous()).squeeze(1)  # u rounded to 1: the last token with mass
    return torch.where(st.temperature == 0, greedy, torch.minimum(drawn, last))


def shaped_logits(rows: int, vocab: int, seed: int) -> torch.Tensor:
    """Rows from flat to very peaked (a real model's rows are mostly peaked), some with ties:
    logits rounded to quarters, the top value repeated, all equal."""
    generator = torch.Generator().manual_seed(seed)
    scales = torch.tensor([0.3, 1.0, 3.0, 6.0, 10.0, 30.0])[torch.arange(rows) % 6]
    logits = torch.randn(rows, vocab, generator=generator) * scales[:, None]
    logits[1::5] = (logits[1::5] * 4).round() / 4  # many ties, also at the nucleus' edge
    top = logits[2::7].argmax(-1)
    logits[2::7, :16] = logits[2::7].gather(1, top[:, None])  # the maximum 17 times
    logits[3::11] = 0.5  # all equal
    return logits


SAMPLING_SETTINGS = [
    dict(top_p=0.95),
    dict(top_p=0.5),
    dict(top_p=0.999999),
    dict(top_p=0.95, top_k=40),
    dict(top_p=0.9, min_p=0.05),
    dict(top_k=1),
    dict(top_k=40),
    dict(min_p=0.1),
    dict(top_p=0.95, top_k=40, penalty=1.1),
    dict(top_p=0.95, frequency=0.5, presence=0.3),
    dict(top_k=100_000, top_p=0.8),
    dict(),
]


def setting_tensors(rows: int, kw: dict, temperature: float, seed: int, history=None) -> SamplingTensors:
    """One of SAMPLING_SETTINGS on every row, row 5 greedy."""
    st = tensors(
        rows,
        temperature=temperature,
        top_k=kw.get("top_k", 0),
        top_p=kw.get("top_p", 1.0),
        min_p=kw.get("min_p", 0.0),
        penalty=kw.get("penalty", 1.0),
        seed=seed,
        history=history,
    )
    st.temperature[5] = 0.0  # a greedy row
    st.all_greedy = False
    return st


@pytest.mark.parametrize("vocab", [3000, 49152])
@pytest.mark.parametrize("temperature", [0.05, 0.8, 50.0])
@pytest.mark.parametrize("setting", range(len(SAMPLING_SETTINGS)))
def test_sampled_tokens_equal_the_full_sort_definition(vocab, temperature, setting, draw):
    """The same tokens as the definition for every filter combination, tiny and huge temperatures,
    ties, penalties, a greedy row among sampled ones, float32 and float64 logits."""
    kw = dict(SAMPLING_SETTINGS[setting])
    rows = 24
    logits = shaped_logits(rows, vocab, seed=vocab + setting)
    generator = torch.Generator().manual_seed(setting)
    history = [
        torch.randint(0, vocab, (int(n),), generator=generator).tolist()
        for n in torch.randint(0, 40, (rows,), generator=generator)
    ]
    st = setting_tensors(rows, kw, temperature, seed=setting, history=history if "penalty" in kw else None)
    if "frequency" in kw:
        st.frequency_penalty = torch.full((rows,), kw["frequency"])
        st.presence_penalty = torch.full((rows,), kw["presence"])
        st.outputs = history
    for dtype in (torch.float32, torch.float64):
        for step in range(2):
            st.counter = torch.arange(rows) * 7 + step
            ids, _ = draw(logits.to(dtype), st)
            assert torch.equal(ids, reference_sample(logits.to(dtype), st)), (dtype, step)


@pytest.mark.parametrize("vocab", [4096, 49152, 128256])
def test_the_nucleus_equals_the_sort_and_peaked_rows_need_no_sort(vocab, monkeypatch):
    """`nucleus` zeroes exactly what the sort does, bit for bit, on flat rows (where it falls back
    to the sort), middling and peaked rows, and with ties at the edge; rows with a nucleus of a few
    hundred tokens never reach the sort."""
    from flover.runner import sampler

    logits = shaped_logits(18, vocab, seed=vocab)
    for top_p in (0.5, 0.9, 0.95, 0.99):
        p = torch.full((18,), top_p)
        for temperature in (0.7, 1.5):
            probs = torch.softmax(logits / temperature, dim=-1)
            assert torch.equal(sampler.nucleus(probs, p), sampler.nucleus_by_sort(probs, p))
    peaked = torch.softmax(torch.randn(8, vocab, generator=torch.Generator().manual_seed(1)) * 10, dim=-1)

    def no_sort(*args):
        raise AssertionError("a peaked row was sorted")

    expected = sampler.nucleus_by_sort(peaked, torch.full((8,), 0.95))
    monkeypatch.setattr(sampler, "nucleus_by_sort", no_sort)
    assert torch.equal(sampler.nucleus(peaked, torch.full((8,), 0.95)), expected)


def test_sampled_rows_with_nan_or_infinite_logits_are_refused(draw):
    """A sampled row whose logits hold NaN or +inf (or nothing finite) raises: the engine then
    fails that request alone. Greedy rows keep torch.argmax's answer."""
    logits = torch.randn(4, 5000)
    for bad in (float("nan"), float("inf")):
        broken = logits.clone()
        broken[2, 17] = bad
        with pytest.raises(FloatingPointError):
            draw(broken, tensors(4, temperature=0.8, top_p=0.9))
        greedy, _ = draw(broken, tensors(4, temperature=0.0))
        assert int(greedy[2]) == 17
    with pytest.raises(FloatingPointError):
        draw(torch.full((1, 5000), float("-inf")), tensors(1, temperature=0.8))


def test_the_nucleus_at_exact_edges_and_ties_across_the_candidates():
    """Hand-made rows (binary fractions, so sums are exact): the mass above a token equal to
    top_p keeps it; a run of equal tokens that starts inside the first candidates and goes on
    past them is kept lowest ids first, as the sort keeps it."""
    from flover.runner.sampler import NUCLEUS_CANDIDATES, nucleus, nucleus_by_sort

    vocab = 32768  # wide enough for a second try (2048 candidates) before the sort
    edge = torch.zeros(vocab)
    edge[[7, 900, 4000]] = 0.25
    edge[5000:6024] = 2.0**-12  # 1024 x 2^-12 = the last quarter
    ties = torch.zeros(vocab)
    order = torch.randperm(vocab, generator=torch.Generator().manual_seed(3))
    n = NUCLEUS_CANDIDATES - 14  # distinct values first, 0.595 of the mass ...
    ties[order[:n]] = torch.linspace(2.0, 1.0, n) * (0.595 / torch.linspace(2.0, 1.0, n).sum())
    ties[order[n : n + 1000]] = (1 - ties.sum()) / 1000  # ... then 1000 equal tokens at scattered ids
    for probs, top_p in ((edge, 0.5), (edge, 0.75), (ties, 0.6), (ties, 0.7), (ties, 0.9)):
        rows = probs[None].repeat(2, 1)
        p = torch.tensor([top_p, top_p])
        expected = nucleus_by_sort(rows, p)
        assert torch.equal(nucleus(rows, p), expected), top_p
        if probs is ties and top_p == 0.6:  # the nucleus' edge inside the run, within the first candidates
            kept = expected[0].nonzero().squeeze(1)
            assert n < len(kept) < NUCLEUS_CANDIDATES
    assert int((nucleus_by_sort(edge[None], torch.tensor([0.5]))[0] > 0).sum()) == 3


def test_a_uniform_number_rounded_up_to_one_draws_the_last_allowed_token(draw):
    """counter_uniform(0, 1869153) rounds to 1.0 in float32: the draw
    lands on the mass' very end, which must be the last token the filters allow (it was the
    vocabulary's last id, whatever the filters), on both of the sampler's paths."""
    seed, counter = torch.tensor([0]), torch.tensor([1869153])
    assert float(counter_uniform(seed, counter).float()) == 1.0
    logits = torch.randn(1, 49152, generator=torch.Generator().manual_seed(5)) * 4
    for kw in (dict(top_k=5), dict(top_p=0.9), dict(top_p=0.999999), dict(min_p=0.2), dict()):
        st = tensors(1, temperature=0.8, seed=0, counter=counter, **kw)
        ids, _ = draw(logits, st)
        assert torch.equal(ids, reference_sample(logits, st)), kw
        allowed = reference_sample(logits, st, filtered=True)[0]
        assert allowed[ids] > 0 and ids >= allowed.nonzero().max() - 50, kw  # at the mass' end


def test_rows_with_different_filters_in_one_batch_draw_what_each_draws_alone(draw):
    """Every setting on its own rows of one batch (and a greedy row): the same tokens as the
    definition, and as each row sampled alone — a filter on some rows changes no other row."""
    vocab, rows = 49152, 2 * len(SAMPLING_SETTINGS) + 1
    logits = shaped_logits(rows, vocab, seed=11)
    st = tensors(rows, temperature=0.8, seed=4)
    st.frequency_penalty, st.presence_penalty = torch.zeros(rows), torch.zeros(rows)
    st.outputs = [[row, 2 * row] for row in range(rows)]
    for row in range(rows - 1):
        kw = SAMPLING_SETTINGS[row % len(SAMPLING_SETTINGS)]
        st.top_k[row], st.top_p[row], st.min_p[row] = kw.get("top_k", 0), kw.get("top_p", 1.0), kw.get("min_p", 0.0)
        st.frequency_penalty[row], st.presence_penalty[row] = kw.get("frequency", 0.0), kw.get("presence", 0.0)
    st.temperature[-1] = 0.0
    st.all_greedy = False
    ids, _ = draw(logits, st)
    assert torch.equal(ids, reference_sample(logits, st))
    alone = torch.cat([draw(logits[row : row + 1], st.row(row))[0] for row in range(rows)])
    assert torch.equal(ids, alone)


@functools.cache
def definition_cases() -> list[tuple[torch.Tensor, SamplingTensors, torch.Tensor]]:
    """(logits, parameters, the definition's tokens) for every filter setting without penalties
    at three temperatures, a greedy row in each: computed once for all kernel families."""
    vocab, rows = 49152, 24
    logits = shaped_logits(rows, vocab, seed=21)
    cases = []
    for setting, kw in enumerate(SAMPLING_SETTINGS):
        if "penalty" in kw or "frequency" in kw:
            continue
        for temperature in (0.05, 0.8, 50.0):
            st = setting_tensors(rows, kw, temperature, seed=setting)
            cases.append((logits, st, reference_sample(logits, st)))
    return cases


@pytest.mark.parametrize("family", runnable_families())
def test_every_kernel_family_this_cpu_runs_draws_the_definitions_tokens(family):
    """sampling.c is written on simd.h's 16 lanes: the build of every kernel family this CPU
    executes (the portable one too) draws the definition's tokens, greedy rows among them."""
    try:
        native = native_sampler(family)
    except NativeUnavailable as e:
        pytest.skip(f"the native step cannot be built here: {e}")
    for logits, st, expected in definition_cases():
        assert torch.equal(sample(logits, st, native)[0], expected), (st.top_k[0], st.top_p[0], st.temperature[0])


def test_a_structure_bitmask_draws_what_the_definition_draws_on_the_masked_logits(draw):
    """Structured output's bitmask ([rows, words] int32; the PyTorch path masks a copy, the C
    sampler masks in its first pass): the ids are the definition's on logits with every
    disallowed token at -inf, greedy and sampled rows alike, a NaN among disallowed tokens
    ignored; rows without a structure (every bit set) are unchanged."""
    from flover.structured.grammars import unpack_bits

    vocab, rows = 49152, 12
    logits = shaped_logits(rows, vocab, seed=31)
    generator = torch.Generator().manual_seed(2)
    bits = torch.randint(-(2**31), 2**31, (rows, vocab // 32), generator=generator, dtype=torch.int64).to(torch.int32)
    bits[3] = -1  # a row without a structure
    bits[4] = 0
    bits[4, 100] = 1 << 7  # one token allowed: id 100 * 32 + 7
    logits[5, 5] = float("nan")  # disallowed below
    bits[5, 0] &= ~(1 << 5)
    for temperature in (0.0, 0.8):
        st = tensors(rows, temperature=temperature, top_p=0.9, seed=3)
        st.temperature[1] = 0.0
        st.all_greedy = temperature == 0
        st.allowed = bits
        masked = logits.masked_fill(~unpack_bits(bits, vocab), float("-inf"))
        plain = tensors(rows, temperature=temperature, top_p=0.9, seed=3)
        plain.temperature[1], plain.all_greedy = 0.0, st.all_greedy
        ids, _ = draw(logits, st)
        assert torch.equal(ids, reference_sample(masked, plain)), temperature
        assert int(ids[4]) == 100 * 32 + 7 and bool(unpack_bits(bits, vocab)[torch.arange(rows), ids].all())
