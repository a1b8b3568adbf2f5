"""Vectorised sampling against its definitions (and transformers' repetition penalty)."""

from __future__ import annotations

import pytest
import torch
import transformers

from flover.runner.sampler import SamplingTensors, counter_uniform, greedy_ids, sample


def tensors(rows: int, *, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, penalty=1.0, seed=0,
            counter=None, history=None, logprobs=False) -> SamplingTensors:
    full = lambda v, dt: torch.full((rows,), v, dtype=dt)  # noqa: E731
    return SamplingTensors(
        temperature=full(temperature, torch.float32), top_k=full(top_k, torch.int64),
        top_p=full(top_p, torch.float32), min_p=full(min_p, torch.float32),
        repetition_penalty=full(penalty, torch.float32), seed=full(seed, torch.int64),
        counter=torch.arange(rows) if counter is None else counter,
        all_greedy=temperature == 0, history=history, want_logprobs=logprobs)


def test_counter_uniform_is_deterministic_and_uniform():
    seeds = torch.full((100_000,), 42, dtype=torch.int64)
    u = counter_uniform(seeds, torch.arange(100_000))
    assert torch.equal(u, counter_uniform(seeds, torch.arange(100_000)))
    assert 0 <= u.min() and u.max() < 1
    hist = torch.histc(u.float(), bins=10, min=0, max=1) / u.numel()
    assert (hist - 0.1).abs().max() < 0.005
    other = counter_uniform(torch.full((100_000,), 43, dtype=torch.int64), torch.arange(100_000))
    assert (u - other).abs().mean() > 0.2


def test_empirical_distribution_matches_softmax():
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0])
    n = 40_000
    ids, _ = sample(logits.repeat(n, 1), tensors(n, temperature=0.8, seed=7))
    freq = torch.bincount(ids, minlength=5).double() / n
    assert (freq - torch.softmax(logits.double() / 0.8, 0)).abs().max() < 0.01


def test_filters_keep_only_allowed_tokens():
    torch.manual_seed(0)
    logits = torch.randn(1, 100).repeat(5000, 1)
    top5 = set(logits[0].topk(5).indices.tolist())
    ids, _ = sample(logits, tensors(5000, top_k=5, seed=1))
    assert set(ids.tolist()) <= top5 and len(set(ids.tolist())) == 5

    probs = torch.softmax(logits[0], 0)
    order = probs.argsort(descending=True)
    nucleus = set(order[: int((probs[order].cumsum(0) < 0.5).sum()) + 1].tolist())
    ids, _ = sample(logits, tensors(5000, top_p=0.5, seed=2))
    assert set(ids.tolist()) == nucleus

    allowed = set((probs >= 0.3 * probs.max()).nonzero().flatten().tolist())
    ids, _ = sample(logits, tensors(5000, min_p=0.3, seed=3))
    assert set(ids.tolist()) == allowed


def test_greedy_rows_and_degenerate_filters_pick_the_argmax():
    torch.manual_seed(1)
    logits = torch.randn(6, 50)
    best = logits.argmax(-1)
    for st in (tensors(6, temperature=0.0), tensors(6, top_k=1), tensors(6, min_p=1.0)):
        ids, _ = sample(logits, st)
        assert torch.equal(ids, best)
    mixed = tensors(6)
    mixed.temperature[::2] = 0  # greedy and sampled rows in one batch
    ids, _ = sample(logits, mixed)
    assert torch.equal(ids[::2], best[::2])


def test_repetition_penalty_matches_transformers():
    torch.manual_seed(2)
    logits = torch.randn(2, 30)
    history = [[1, 5, 5, 7], [2, 3]]
    expected = logits.clone()
    for row, penalty in enumerate((1.3, 0.7)):
        proc = transformers.RepetitionPenaltyLogitsProcessor(penalty)
        expected[row] = proc(torch.tensor([history[row]]), logits[row: row + 1].clone())[0]
    st = tensors(2, temperature=0.0, history=history, logprobs=True)
    st.repetition_penalty.copy_(torch.tensor([1.3, 0.7]))
    st.top_logprobs = 3
    ids, logprobs = sample(logits, st)
    assert torch.equal(ids, expected.argmax(-1))
    # log-probabilities are reported for the model's own distribution (before the penalty)
    reference = torch.log_softmax(logits, -1)
    assert torch.allclose(logprobs.chosen, reference.gather(1, ids[:, None]).squeeze(1))
    top = reference.topk(3, dim=-1)
    assert torch.equal(logprobs.top_ids, top.indices) and torch.allclose(logprobs.top_values, top.values)
    rows = logprobs.rows()
    assert [len(alternatives) for _, alternatives in rows] == [3, 3]
    assert rows[1][1][0] == (int(top.indices[1, 0]), float(top.values[1, 0]))


def test_frequency_and_presence_penalties_follow_openais_definition():
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
    ids, _ = sample(logits, st)
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
