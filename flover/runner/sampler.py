"""Vectorised sampling: every row of the logits has its own parameters, one pass for the batch.

Randomness is counter-based: the uniform number behind a request's n-th token is a hash of
(the request's seed, n). A request therefore draws the same numbers whatever it is batched with,
and a fixed seed gives the same tokens in any batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flover.structured.grammars import unpack_bits

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
    allowed: torch.Tensor | None = None  # [B, words] int32 bitmask: the tokens each row's structure allows
    bias: list[tuple[tuple[int, float], ...]] | None = None  # per row, (token, added to its logit) pairs

    def row(self, i: int) -> "SamplingTensors":
        """Row i alone (each tensor [1]): the engine resamples row by row to isolate a failure."""
        return self.select(torch.tensor([i], device=self.seed.device))

    def select(self, rows: torch.Tensor) -> "SamplingTensors":
        """These rows ([r] int64) only, in this order."""
        pick = lambda t: None if t is None else t[rows]  # noqa: E731
        take = lambda rows_of: None if rows_of is None else [rows_of[i] for i in rows.tolist()]  # noqa: E731
        return SamplingTensors(
            temperature=pick(self.temperature),
            top_k=pick(self.top_k),
            top_p=pick(self.top_p),
            min_p=pick(self.min_p),
            repetition_penalty=pick(self.repetition_penalty),
            seed=pick(self.seed),
            counter=pick(self.counter),
            all_greedy=bool((self.temperature[rows] == 0).all()),
            history=take(self.history),
            want_logprobs=self.want_logprobs,
            top_logprobs=self.top_logprobs,
            frequency_penalty=pick(self.frequency_penalty),
            presence_penalty=pick(self.presence_penalty),
            outputs=take(self.outputs),
            allowed=pick(self.allowed),
            bias=take(self.bias),
        )


def _seen(logits: torch.Tensor, tokens_of_rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every (row, token) pair the rows' lists hold, once: (rows [n], tokens [n], times seen [n])."""
    vocab = logits.shape[-1]
    flat = torch.tensor(
        [row * vocab + t for row, tokens in enumerate(tokens_of_rows) for t in tokens],
        dtype=torch.int64,
        device=logits.device,
    )
    pairs, counts = flat.unique(return_counts=True)
    return pairs // vocab, pairs % vocab, counts


def apply_repetition_penalty(logits: torch.Tensor, penalty: torch.Tensor, history: list[list[int]]) -> None:
    """transformers' definition: seen tokens' logits are divided (if > 0) or multiplied by it."""
    rows, ids, _ = _seen(logits, history)
    by = penalty.to(logits.dtype)[rows]
    seen = logits[rows, ids]
    logits[rows, ids] = torch.where(seen < 0, seen * by, seen / by)


def apply_frequency_presence(
    logits: torch.Tensor, frequency: torch.Tensor, presence: torch.Tensor, outputs: list[list[int]]
) -> None:
    """OpenAI's definition: logit[j] -= frequency x count[j] + presence x (count[j] > 0), counts
    over the tokens generated so far (not the prompt). Only the generated tokens are touched."""
    rows, ids, counts = _seen(logits, outputs)
    logits[rows, ids] -= frequency.to(logits.dtype)[rows] * counts.to(logits.dtype) + presence.to(logits.dtype)[rows]


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
    return TokenLogprobs(
        chosen=logp.gather(1, tokens[:, None]).squeeze(1),
        top_ids=top.indices if top else empty.long(),
        top_values=top.values if top else empty,
    )


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """What `sample` gives when every row is greedy, without penalties or log-probabilities:
    token ids [B] (argmax in float32 at least, where PyTorch's argmax is fastest)."""
    return greedy_ids(logits.to(torch.promote_types(logits.dtype, torch.float32)))


def sample(logits: torch.Tensor, st: SamplingTensors, native=None) -> tuple[torch.Tensor, TokenLogprobs | None]:
    """logits: [B, vocab] -> (token ids [B] int64, their log-probabilities (and the top
    `st.top_logprobs`) when any row asked for them, else None). `native`: the native step's
    sampler (flover/native/sampling.py), which draws the same ids from float32 logits on CPU."""
    work = torch.promote_types(logits.dtype, torch.float32)
    raw = logits.to(work)
    in_c = native is not None and work == torch.float32 and logits.device.type == "cpu"
    masked_here = st.allowed is not None and not in_c  # the C sampler masks in its first pass, copying nothing
    logits = raw.clone() if any(x is not None for x in (st.history, st.outputs, st.bias)) or masked_here else raw
    if st.bias is not None:  # OpenAI's logit_bias: added before anything else
        pairs = [(row, token, value) for row, row_bias in enumerate(st.bias) for token, value in row_bias]
        if pairs:
            rows, tokens, values = zip(*pairs)
            logits[list(rows), list(tokens)] += torch.tensor(values, dtype=logits.dtype, device=logits.device)
    if masked_here:  # structured output: every token its structure does not allow is out
        logits.masked_fill_(~unpack_bits(st.allowed.to(logits.device), logits.shape[-1]), float("-inf"))
    if st.history is not None:
        apply_repetition_penalty(logits, st.repetition_penalty, st.history)
    if st.outputs is not None:
        apply_frequency_presence(logits, st.frequency_penalty, st.presence_penalty, st.outputs)
    if in_c:
        allowed = None if st.allowed is None else st.allowed.contiguous()
        ids = native.sample(logits, st.temperature, st.top_k, st.top_p, st.min_p, st.seed, st.counter, allowed)
        return ids, token_logprobs(raw, ids, st.top_logprobs) if st.want_logprobs else None
    ids = greedy_ids(logits)
    if not st.all_greedy:
        rows = (st.temperature != 0).nonzero().squeeze(1)  # greedy rows keep their argmax
        ids[rows] = _sample_random(logits[rows], st.select(rows))
    return ids, token_logprobs(raw, ids, st.top_logprobs) if st.want_logprobs else None


ARGMAX_CHUNK = 1024


def greedy_ids(logits: torch.Tensor) -> torch.Tensor:
    """logits.argmax(-1) ([B, vocab] -> [B]), the same ids (the first maximum; NaN counts as the
    maximum). On CPU in two steps: PyTorch's argmax over a large vocabulary is a scalar loop,
    while amax is vectorised: the maximum of every chunk of 1024, the first chunk holding the row's
    maximum, then argmax inside that chunk only (docs/design_notes.md, "measured choices")."""
    rows, vocab = logits.shape
    if logits.device.type != "cpu" or rows < 4 or vocab < 4 * ARGMAX_CHUNK:  # few rows: argmax is as fast
        return logits.argmax(dim=-1)
    full = vocab // ARGMAX_CHUNK
    maxima = logits[:, : full * ARGMAX_CHUNK].reshape(rows, full, ARGMAX_CHUNK).amax(-1)  # [B, chunks]
    if full * ARGMAX_CHUNK < vocab:
        maxima = torch.cat([maxima, logits[:, full * ARGMAX_CHUNK :].amax(-1, keepdim=True)], 1)
    chunk = maxima.argmax(-1)  # [B]: the first chunk whose maximum is the row's
    # the last chunk may be short: its columns past the vocabulary repeat the last one, which
    # comes first, so argmax never picks a repeat
    cols = (chunk[:, None] * ARGMAX_CHUNK + torch.arange(ARGMAX_CHUNK)).clamp_(max=vocab - 1)  # [B, chunk]
    return chunk * ARGMAX_CHUNK + logits.gather(1, cols).argmax(-1)


def _sample_random(logits: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
    """logits [B, vocab] of sampled rows (temperature > 0) -> one drawn id per row. Each filter
    runs on the rows that ask for it only; a row whose nucleus a few hundred candidates settle is
    drawn among them, the others over the whole vocabulary."""
    vocab = logits.shape[-1]
    scaled = logits / st.temperature.to(logits.dtype)[:, None]  # [B, vocab]
    if not bool(torch.isfinite(scaled.amax(dim=-1)).all()):  # NaN, +inf, or no finite logit at all
        raise FloatingPointError("the logits hold NaN or +inf, or no finite value: nothing to sample from")
    # One topk serves top-k's thresholds and top-p's first candidates (softmax keeps the order)
    top_k = st.top_k.clamp(max=vocab)
    first = None  # [B, width] the most probable ids of every row, when every row has a filter
    rows = _rows_where((top_k > 0) | (st.top_p < 1))
    if rows is not None:
        some = scaled[rows]  # [r, vocab], a view when every row has a filter
        width = min(vocab, max(int(top_k[rows].max()), NUCLEUS_CANDIDATES if bool((st.top_p < 1).any()) else 0))
        top_values, top_ids = some.topk(width, dim=-1)  # [r, width]
        k = top_k[rows]
        if bool((k > 0).any()):
            kth = top_values.gather(1, (k - 1).clamp(min=0)[:, None]).masked_fill_(k[:, None] == 0, float("-inf"))
            some.masked_fill_(some < kth, float("-inf"))
            if not isinstance(rows, slice):
                scaled[rows] = some
        first = top_ids if isinstance(rows, slice) else None
    probs = torch.softmax(scaled, dim=-1)
    u = counter_uniform(st.seed, st.counter).to(probs.dtype)  # [B]
    min_p = st.min_p.to(probs.dtype)
    ids = torch.empty(len(probs), dtype=torch.int64, device=probs.device)
    rest = torch.ones(len(probs), dtype=torch.bool, device=probs.device)  # rows drawn over the vocabulary
    rows = _rows_where(st.top_p < 1)
    if rows is not None:
        some = probs[rows]
        top_p = st.top_p[rows].to(probs.dtype)
        for settled, cand_ids, cand_values in nucleus_candidates(some, top_p, None if first is None else first[rows]):
            at = _of(rows, settled)
            ids[at] = _draw_among(cand_ids, cand_values, min_p[at], u[at])
            rest[at] = False
        wide = _rows_where(rest[rows])
        if wide is not None:
            probs[_of(rows, wide)] = nucleus_by_sort(some[wide], top_p[wide])
    rows = _rows_where(rest)
    if rows is not None:
        some = probs[rows]
        if bool((min_p[rows] > 0).any()):
            some = some.masked_fill(some < min_p[rows, None] * some.max(dim=-1, keepdim=True).values, 0.0)
        ids[rows] = _draw(some.cumsum(dim=-1), u[rows])  # cumulative sums [r, vocab], unnormalised
    return ids


def _draw(cdf: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverts cumulative sums [r, n] at u [r] in [0, 1]: the first column whose sum passes u x
    the row's mass. u rounded up to 1 (float32, once in ~3e7 draws) takes the last column that
    adds mass, not one past it."""
    total = cdf[:, -1:].contiguous()  # [r, 1]
    drawn = torch.searchsorted(cdf, u[:, None] * total, right=True)
    return torch.minimum(drawn, torch.searchsorted(cdf, total))[:, 0]


def _rows_where(mask: torch.Tensor) -> torch.Tensor | slice | None:
    """The rows a filter applies to: None, every row (a slice: views, no copies), or their indices."""
    if bool(mask.all()):
        return slice(None)
    return mask.nonzero().squeeze(1) if bool(mask.any()) else None


def _of(rows: torch.Tensor | slice, sub: torch.Tensor | slice) -> torch.Tensor | slice:
    """`sub`, indices into `rows` (a `_rows_where` answer), as indices into the whole batch."""
    return sub if isinstance(rows, slice) else rows[sub]


def _draw_among(ids: torch.Tensor, probs: torch.Tensor, min_p: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The draw of the vocabulary-wide path, over candidates: ids [r, K] (the most probable first),
    probs [r, K] (0 outside the nucleus), min_p and u [r]. In id order with the others' zeros left
    out, the cumulative sums are the vocabulary's, bit for bit."""
    floor = min_p[:, None] * probs[:, :1]  # the row's maximum comes first
    probs = probs.masked_fill(probs < floor, 0.0)
    ids, order = ids.sort(dim=-1)
    return ids.gather(1, _draw(probs.gather(1, order).cumsum(dim=-1), u)[:, None])[:, 0]


def nucleus_by_sort(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """The definition of top-p: probs [R, vocab] with every token outside the nucleus set to 0.
    The nucleus: the most probable tokens (ties: the lower id first) while the mass strictly
    above a token is at most top_p [R]."""
    sorted_probs, order = probs.sort(dim=-1, descending=True, stable=True)
    before = sorted_probs.cumsum(dim=-1) - sorted_probs  # mass strictly above each token
    sorted_probs = sorted_probs.masked_fill(before > top_p[:, None], 0.0)
    return torch.zeros_like(probs).scatter_(1, order, sorted_probs)


NUCLEUS_CANDIDATES = 64  # the first try's candidates per row; x8 per retry
NUCLEUS_MARGIN = 1e-6  # above the rounding of a float32 cumulative sum near 1 (docs/sampling.md)


def nucleus_candidates(probs: torch.Tensor, top_p: torch.Tensor, first: torch.Tensor | None = None):
    """Yields (settled rows [s], their candidates' ids [s, K], probabilities [s, K] with 0 outside
    the nucleus) per try; rows never yielded need `nucleus_by_sort`. The K most probable tokens of
    a row, in the sort's order, give the sort's first cumulative sums exactly; once the mass above
    one of them passes top_p (with a margin for rounding), no later token is in the nucleus.
    `first` [R, K]: the first try's candidates, when the caller has them (the K most probable)."""
    vocab = probs.shape[-1]
    if probs.device.type != "cpu":  # a GPU sorts fast, and its scans round differently
        return
    todo = torch.arange(probs.shape[0], device=probs.device)  # rows not settled yet
    # k candidates cannot hold the nucleus unless k x the row's maximum passes top_p: after the
    # first try, flat rows skip the tries they would fail
    fewest = None  # [len(todo)] top_p / the row's largest probability
    k = NUCLEUS_CANDIDATES if first is None else first.shape[1]
    while len(todo) and (k * 8 <= vocab or first is not None):
        if first is not None:
            ids, first = first, None
            values = probs.gather(1, ids)
        elif fewest is not None and not bool((fewest < k).any()):
            k *= 8
            continue
        else:
            some = probs if len(todo) == len(probs) else probs[todo]
            values, ids = some.topk(k, dim=-1)  # [r, k], descending; ties in no set order
        ids, by_id = ids.sort(dim=-1)  # the sort's order: value descending, then id ascending
        values, by_value = values.gather(1, by_id).sort(dim=-1, descending=True, stable=True)
        ids = ids.gather(1, by_value)
        # tokens equal to the k-th value may lie outside the candidates: only those above are sure
        sure = values > values[:, -1:]  # [r, k], a prefix of each row
        before = values.cumsum(dim=-1) - values  # [r, k]: the sort's own sums on the sure prefix
        settled = (sure & (before > top_p[todo, None] + NUCLEUS_MARGIN)).any(dim=-1)  # [r]
        if bool(settled.any()):
            keep = sure & (before <= top_p[todo, None])
            yield todo[settled], ids[settled], values[settled] * keep[settled]
        fewest = (top_p[todo] / values[:, 0])[~settled]
        todo, k = todo[~settled], k * 8


def nucleus(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """`nucleus_by_sort(probs, top_p)`, bit for bit, sorting only the rows candidates do not settle."""
    out = torch.zeros_like(probs)
    left = torch.ones(len(probs), dtype=torch.bool, device=probs.device)
    for rows, ids, values in nucleus_candidates(probs, top_p):
        out[rows] = out[rows].scatter_(1, ids, values)
        left[rows] = False
    if bool(left.any()):
        out[left] = nucleus_by_sort(probs[left], top_p[left])
    return out
