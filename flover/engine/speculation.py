"""Prompt-lookup (n-gram) speculation: drafts for greedy requests, taken from their own sequence.

A request's next tokens often repeat what came before (a passage it quotes, code it edits, a
small model that loops). A decoding request's draft is the tokens that followed the latest
earlier occurrence of its last n tokens (prompt and output so far). The iteration computes the
request's last token and its draft as consecutive decode rows of its slot: each row writes its
K/V at its own position and attends to the keys up to it, which the rows before it wrote in the
same layer. The greedy id of each row checks the next draft token; the longest matching prefix
is accepted, and the id after it comes free. Every accepted token is the one greedy decoding
would have given one at a time, bit for bit: the native step computes each row's numbers in the
same order whatever shares the iteration, so only the number of iterations changes. Rows of
rejected draft tokens leave K/V beyond the request's new length, overwritten before being read.

A request whose output follows a structure drafts the tokens its grammar forces next where it
forces any (llguidance's fast-forward tokens: a JSON key, say), else, in iterations of few rows,
its n-gram draft cut where the grammar would refuse a token; each draft row is sampled under the
mask its grammar gives after the draft tokens before it, so the accepted tokens are still those of
one token at a time.

Only greedy requests draft (sampled ones would need rejection sampling), only on the
native CPU step (the PyTorch forward attends per slot, not per row; under TP on every rank, all
drafting by the leader's fit of the cost below, which the step plan carries), and only with the
budget left after decode and prompt tokens, so prompts never wait for drafts.

How long a draft is weighs what a draft row costs against what it is likely to give. A row costs b
of an iteration that takes a + b x (its rows) (IterationCost fits a and b to the iterations as they
run). Spent on the iteration's R requests it yields R tokens, so a draft token pays when the chance
that it is accepted is at least R / (a / b + rows): ~0.04 for one request alone, ~0.5 for 32 (where
the iteration is compute-bound and a row costs what it yields). Each request keeps a running count
of its accepted draft tokens and of its rejections: with q its acceptance per token, the draft
token i is accepted with chance q^i, so a draft takes the tokens for which that is above the line
(none when q is below it; its rejections fade while it does not draft, so it tries again).
The figures behind the rule: docs/design_notes.md, "draft length".
"""

from __future__ import annotations

import math
from dataclasses import dataclass

DEFAULT_DRAFT_TOKENS = 8  # where the engine speculates unless told otherwise
# A constrained request's n-gram draft rows each need a mask too: they pay where rows are cheap (a
# few requests), not in a full iteration (the tokens its grammar forces are drafted at any size).
# Figures: docs/journal.md, "(h)".
STRUCTURED_NGRAMS_BELOW = 0.25


@dataclass(frozen=True)
class Speculation:
    tokens: int = 0  # draft tokens per request and iteration at most; 0 = off
    ngram: int = 3  # the suffix looked up (shorter ones find more drafts, more of them wrong)


class NgramLookup:
    """Where the token after the latest occurrence of each n-gram of a sequence sits, kept up to
    date as tokens are appended (a dict update per token; a draft is one lookup)."""

    def __init__(self, n: int, tokens: list[int] = ()):
        self.n = n
        self.tokens: list[int] = []
        self._after: dict[tuple[int, ...], int] = {}  # n-gram -> index of the token that followed it
        self.extend(tokens)

    def extend(self, tokens) -> None:
        n, seq, after = self.n, self.tokens, self._after
        for token in tokens:
            if len(seq) >= n:
                after[tuple(seq[-n:])] = len(seq)
            seq.append(token)

    def draft(self, k: int) -> list[int]:
        """Up to k tokens that followed the latest earlier occurrence of the last n tokens. Where
        that occurrence runs into the end of the sequence, the repeat continues with its own
        period (a sequence ending "a b c a b" drafts "c a b ...")."""
        seq = self.tokens
        if k <= 0 or len(seq) <= self.n:
            return []
        start = self._after.get(tuple(seq[-self.n :]))
        if start is None:
            return []
        period = len(seq) - start
        return [seq[start + i] if i < period else seq[start + i % period] for i in range(k)]


class IterationCost:
    """An iteration's seconds as a + b x rows, fitted to the iterations as they run (least
    squares with older iterations fading), for `knee` = a / b: the rows at which an iteration
    costs twice its fixed part."""

    DEFAULT_KNEE = 16.0  # until the iterations have varied enough to fit

    def __init__(self, fade: float = 0.98):
        self.fade = fade
        self._sums = [0.0] * 5  # weight, rows, seconds, rows^2, rows x seconds
        self.leader_knee: float | None = None  # under TP, every rank drafts by the leader's fit

    def observe(self, rows: int, seconds: float) -> None:
        f, s = self.fade, self._sums
        for i, value in enumerate((1.0, rows, seconds, rows * rows, rows * seconds)):
            s[i] = s[i] * f + value

    @property
    def knee(self) -> float:
        if self.leader_knee is not None:
            return self.leader_knee
        n, x, y, xx, xy = self._sums
        spread = n * xx - x * x
        if n < 4 or spread <= 1e-9 * n * n:
            return self.DEFAULT_KNEE
        b = (n * xy - x * y) / spread
        a = (y - b * x) / n
        return min(4096.0, max(1.0, a / b)) if b > 0 and a > 0 else self.DEFAULT_KNEE


@dataclass
class Drafting:
    """One request's speculation state: its lookup, and how its drafts fared."""

    lookup: NgramLookup
    # draft tokens accepted, older drafts fading; it starts at one (with the prior below, q = 3/4)
    # so that a request that arrives into a full iteration still tries a short draft
    accepted: float = 1.0
    rejected: float = 0.0  # drafts that ended in a rejection, likewise

    FADE = 0.8  # per draft; per iteration without one, rejections fade by REJECTIONS_FADE
    REJECTIONS_FADE = 0.9

    def learn(self, drafted: int, accepted: int) -> None:
        """After each iteration the request decoded in: how many draft tokens it ran, and how
        many of them were accepted."""
        if not drafted:
            self.rejected *= self.REJECTIONS_FADE
            return
        self.accepted = self.accepted * self.FADE + accepted
        self.rejected = self.rejected * self.FADE + (accepted < drafted)

    def length(self, min_acceptance: float, most: int) -> int:
        """Draft tokens whose chance of being accepted (q^i) is above `min_acceptance` (in (0, 1))."""
        q = (self.accepted + 0.5) / (self.accepted + self.rejected + 1.0)  # half a token of each, a prior
        if q <= min_acceptance:
            return 0
        return min(most, int(math.log(min_acceptance) / math.log(q)))


def drafts_for(requests, speculation: Speculation, budget: int, min_acceptance: float) -> list[list[int]]:
    """Per request (decoding, in slot order), its draft, within `budget` rows in all. A request
    drafts if its sampling is greedy (SamplingParams.may_draft), the tokens whose chance of
    acceptance is above `min_acceptance`, and at most one token fewer than it may still produce (the
    verifier's own token is the last); one with a structure only tokens its grammar allows."""
    drafts: list[list[int]] = []
    used = 0
    for r in requests:
        if not r.params.may_draft:
            drafts.append([])
            continue
        state = r.drafting
        if state is None:
            state = r.drafting = Drafting(NgramLookup(speculation.ngram, r.prompt_token_ids))
        outputs = len(r.output_token_ids)
        room = min(
            state.length(min_acceptance, speculation.tokens), r.params.max_new_tokens - outputs - 1, budget - used
        )
        state.lookup.extend(r.output_token_ids[len(state.lookup.tokens) - r.prompt_len :])
        if r.grammar is not None:
            draft = r.grammar.forced()[:room] if room > 0 else []
            if not draft and min_acceptance < STRUCTURED_NGRAMS_BELOW:
                draft = r.grammar.valid_prefix(state.lookup.draft(room))
        else:
            draft = state.lookup.draft(room)
        drafts.append(draft)
        used += len(draft)
    return drafts
