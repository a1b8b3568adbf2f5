"""Vectorised sampling: every row of the logits has its own parameters, one pass for the batch.

Randomness is counter-based: the uniform number behind a request's n-th token is a hash of
(the request's seed, n). A request therefore draws the same numbers whatever it is batched with,
and a fixed seed gives the same tokens in any batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_MASK64 = (1 << 64) - 1


def _signed(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value


_GOLDEN = _signed(0x9E3779B97F4A7C15)
_MIX1 = _signed(0xBF58476D1CE4E5B9)
_MIX2 = _signed(0x94D049BB133111EB)


def _shr(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def counter_uniform(seed: torch.Tensor, counter: torch.Tensor) -> torch.Tensor:
    """splitmix64(seed, counter) -> float64 uniform in [0, 1). Both: [B] int64."""
    z = seed ^ (counter * _GOLDEN)  # int64 arithmetic wraps like uint64
    z = z + _GOLDEN
    z = (z ^ _shr(z, 30)) * _MIX1
    z = (z ^ _shr(z, 27)) * _MIX2
    z = z ^ _shr(z, 31)
    return _shr(z, 11).to(torch.float64) / float(1 << 53)


@dataclass
class SamplingTensors:
    """Per-row parameters, each [B]."""

    temperature: torch.Tensor  # float; 0 = greedy
    top_k: torch.Tensor  # int64; 0 = off
    top_p: torch.Tensor  # float; 1 = off
    min_p: torch.Tensor  # float; 0 = off
    repetition_penalty: torch.Tensor  # float; 1 = off
    seed: torch.Tensor  # int64
    counter: torch.Tensor  # int64: index of the token being sampled within its request
    all_greedy: bool
    history: list[list[int]] | None = None  # per row, tokens the repetition penalty looks at
    want_logprobs: bool = False
    top_logprobs: int = 0  # alternatives to report: the largest k any row asked for
    frequency_penalty: torch.Tensor | None = None  # float [B]; with presence_penalty and outputs,
    presence_penalty: torch.Tensor | None = None  # set only when some row uses either
    outputs: list[list[int]] | None = None  # per row, the tokens generated so far

    def row(self, i: int) -> "SamplingTensors":
        """Row i alone (each tensor [1]): the engine resamples row by row to isolate a failure."""
        return self.select(torch.tensor([i], device=self.seed.device))

    def select(self, rows: torch.Tensor) -> "SamplingTensors":
        """These rows ([r] int64) only, in this order."""
        pick = lambda t: None if t is None else t[rows]  # noqa: E731
        take = lambda rows_of: None if rows_of is None else [rows_of[i] for i in rows.tolist()]  # noqa: E731
        return SamplingTensors(
            temperature=pick(self.temperature), top_k=pick(self.top_k), top_p=pick(self.top_p),
            min_p=pick(self.min_p), repetition_penalty=pick(self.repetition_penalty), seed=pick(self.seed),
            counter=pick(self.counter), all_greedy=bool((self.temperature[rows] == 0).all()),
            history=take(self.history), want_logprobs=self.want_logprobs, top_logprobs=self.top_logprobs,
            frequency_penalty=pick(self.frequency_penalty), presence_penalty=pick(self.presence_penalty),
            outputs=take(self.outputs))


def apply_repetition_penalty(logits: torch.Tensor, penalty: torch.Tensor, history: list[list[int]]) -> None:
    """transformers' definition: seen tokens' logits are divided (if > 0) or multiplied by it."""
    for row, tokens in enumerate(history):
        if not tokens or float(penalty[row]) == 1.0:
            continue
        ids = torch.tensor(sorted(set(tokens)), device=logits.device)
        seen = logits[row, ids]
        logits[row, ids] = torch.where(seen < 0, seen * penalty[row], seen / penalty[row])


def apply_frequency_presence(logits: torch.Tensor, frequency: torch.Tensor, presence: torch.Tensor,
                             outputs: list[list[int]]) -> None:
    """OpenAI's definition: logit[j] -= frequency x count[j] + presence x (count[j] > 0), counts
    over the tokens generated so far (not the prompt). Only the generated tokens are touched."""
    for row, tokens in enumerate(outputs):
        if not tokens:
            continue
        ids, counts = torch.tensor(tokens, device=logits.device).unique(return_counts=True)
        counts = counts.to(logits.dtype)
        logits[row, ids] -= frequency[row].to(logits.dtype) * counts + presence[row].to(logits.dtype)


@dataclass
class TokenLogprobs:
    """Log-probabilities under the model's own distribution (before any penalty or filter) of
    chosen tokens, and the k most likely tokens of each row."""

    chosen: torch.Tensor  # [R] float
    top_ids: torch.Tensor  # [R, k] int64, most likely first (k may be 0)
    top_values: torch.Tensor  # [R, k] float

    def rows(self) -> list[tuple[float, list[tuple[int, float]]]]:
        """Per row: (the chosen token's logprob, [(id, logprob)] of the k most likely)."""
        ids, values = self.top_ids.tolist(), self.top_values.tolist()
        return [(c, list(zip(i, v))) for c, i, v in zip(self.chosen.tolist(), ids, values)]


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, k: int) -> TokenLogprobs:
    """logits [R, vocab] (any float dtype), tokens [R] -> their log-probabilities and the top k."""
    logp = torch.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), dim=-1)  # [R, vocab]
    top = logp.topk(k, dim=-1) if k else None
    empty = torch.empty(logp.shape[0], 0, device=logp.device)
    return TokenLogprobs(chosen=logp.gather(1, tokens[:, None]).squeeze(1),
                         top_ids=top.indices if top else empty.long(), top_values=top.values if top else empty)


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """What `sample` gives when every row is greedy, without penalties or log-probabilities:
    token ids [B] (argmax in float32 at least, where PyTorch's argmax is fastest)."""
    return greedy_ids(logits.to(torch.promote_types(logits.dtype, torch.float32)))


def sample(logits: torch.Tensor, st: SamplingTensors) -> tuple[torch.Tensor, TokenLogprobs | None]:
    """logits: [B, vocab] -> (token ids [B] int64, their log-probabilities (and the top
    `st.top_logprobs`) when any row asked for them, else None)."""
    work = torch.promote_types(logits.dtype, torch.float32)
    raw = logits.to(work)
    logits = raw.clone() if st.history is not None or st.outputs is not None else raw
    if st.history is not None:
        apply_repetition_penalty(logits, st.repetition_penalty, st.history)
    if st.outputs is not None:
        apply_frequency_presence(logits, st.frequency_penalty, st.presence_penalty, st.outputs)
    ids = greedy_ids(logits)
    if not st.all_greedy:
        rows = (st.temperature != 0).nonzero().squeeze(1)  # greedy rows keep their argmax
        ids[rows] = _sample_random(logits[rows], st.select(rows))
    return ids, token_logprobs(raw, ids, st.top_logprobs) if st.want_logprobs else None


ARGMAX_CHUNK = 1024


def greedy_ids(logits: torch.Tensor) -> torch.Tensor:
    """logits.argmax(-1) ([B, vocab] -> [B]), the same ids (the first maximum; NaN counts as the
    maximum). On CPU in two steps: PyTorch's argmax over a large vocabulary is a scalar loop
    (~1.2 ms for 32 rows of 49152 on 2 cores, a few % of a decode iteration), while amax is
    vectorised: the maximum of every chunk of 1024, the first chunk holding the row's maximum,
    then argmax inside that chunk only (~0.2 ms)."""
    rows, vocab = logits.shape
    if logits.device.type != "cpu" or rows < 4 or vocab < 4 * ARGMAX_CHUNK:  # few rows: argmax is as fast
        return logits.argmax(dim=-1)
    full = vocab // ARGMAX_CHUNK
    maxima = logits[:, : full * ARGMAX_CHUNK].reshape(rows, full, ARGMAX_CHUNK).amax(-1)  # [B, chunks]
    if full * ARGMAX_CHUNK < vocab:
        maxima = torch.cat([maxima, logits[:, full * ARGMAX_CHUNK:].amax(-1, keepdim=True)], 1)
    chunk = maxima.argmax(-1)  # [B]: the first chunk whose maximum is the row's
    # the last chunk may be short: its columns past the vocabulary repeat the last one, which
    # comes first, so argmax never picks a repeat
    cols = (chunk[:, None] * ARGMAX_CHUNK + torch.arange(ARGMAX_CHUNK)).clamp_(max=vocab - 1)  # [B, chunk]
    return chunk * ARGMAX_CHUNK + logits.gather(1, cols).argmax(-1)


def _sample_random(logits: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
    """logits [B, vocab] of sampled rows (temperature > 0) -> one drawn id per row. Each filter
    runs on the rows that ask for it only."""
    vocab = logits.shape[-1]
    scaled = logits / st.temperature.to(logits.dtype)[:, None]  # [B, vocab]
    if not bool(torch.isfinite(scaled.amax(dim=-1)).all()):  # NaN, +inf, or no finite logit at all
        raise FloatingPointError("the logits hold NaN or +inf, or no finite value: nothing to sample from")
    rows = (st.top_k > 0).nonzero().squeeze(1)
    if len(rows):
        k = st.top_k[rows].clamp(max=vocab)  # [r]
        top = scaled[rows].topk(int(k.max()), dim=-1).values  # [r, kmax], descending
        kth = top.gather(1, (k - 1)[:, None])  # [r, 1]
        scaled[rows] = scaled[rows].masked_fill(scaled[rows] < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    rows = (st.top_p < 1).nonzero().squeeze(1)
    if len(rows):
        probs[rows] = nucleus(probs[rows], st.top_p[rows].to(probs.dtype))
    if bool((st.min_p > 0).any()):
        floor = st.min_p[:, None].to(probs.dtype) * probs.max(dim=-1, keepdim=True).values
        probs = probs.masked_fill(probs < floor, 0.0)
    cdf = probs.cumsum(dim=-1)  # [B, vocab], unnormalised after the filters
    u = counter_uniform(st.seed, st.counter).to(cdf.dtype) * cdf[:, -1]
    return torch.searchsorted(cdf, u[:, None], right=True).squeeze(1).clamp_(max=vocab - 1)


def nucleus_by_sort(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """The definition of top-p: probs [R, vocab] with every token outside the nucleus set to 0.
    The nucleus: the most probable tokens (ties: the lower id first) while the mass strictly
    above a token is at most top_p [R]."""
    sorted_probs, order = probs.sort(dim=-1, descending=True, stable=True)
    before = sorted_probs.cumsum(dim=-1) - sorted_probs  # mass strictly above each token
    sorted_probs = sorted_probs.masked_fill(before > top_p[:, None], 0.0)
    return torch.zeros_like(probs).scatter_(1, order, sorted_probs)


NUCLEUS_CANDIDATES = 256  # the first try's candidates per row; x8 per retry
NUCLEUS_MARGIN = 1e-6  # above the rounding of a float32 cumulative sum near 1 (docs/sampling.md)


def nucleus(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """`nucleus_by_sort(probs, top_p)`, bit for bit, without sorting the vocabulary: the K most
    probable tokens of a row, in the sort's order, give the sort's first cumulative sums exactly;
    once the mass above one of them passes top_p (with a margin for rounding) no later token is
    kept. Rows whose nucleus is wider try 8x the candidates, then the full sort."""
    vocab = probs.shape[-1]
    if probs.device.type != "cpu":  # a GPU sorts fast, and its scans round differently
        return nucleus_by_sort(probs, top_p)
    out = torch.zeros_like(probs)
    todo = torch.arange(probs.shape[0], device=probs.device)  # rows not settled yet
    k = NUCLEUS_CANDIDATES
    while len(todo) and k * 8 <= vocab:
        values, ids = probs[todo].topk(k, dim=-1)  # [r, k], descending; ties in no set order
        ids, by_id = ids.sort(dim=-1)  # the sort's order: value descending, then id ascending
        values, by_value = values.gather(1, by_id).sort(dim=-1, descending=True, stable=True)
        ids = ids.gather(1, by_value)
        # tokens equal to the k-th value may lie outside the candidates: only those above are sure
        sure = values > values[:, -1:]  # [r, k], a prefix of each row
        before = values.cumsum(dim=-1) - values  # [r, k]: the sort's own sums on the sure prefix
        settled = (sure & (before > top_p[todo, None] + NUCLEUS_MARGIN)).any(dim=-1)  # [r]
        keep = sure & (before <= top_p[todo, None])
        rows = todo[settled]
        out[rows] = out[rows].scatter_(1, ids[settled], values[settled] * keep[settled])
        todo, k = todo[~settled], k * 8
    if len(todo):
        out[todo] = nucleus_by_sort(probs[todo], top_p[todo])
    return out
