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

Only plain greedy requests draft (sampled ones would need rejection sampling), only on the
native CPU step (the PyTorch forward attends per slot, not per row), and only with the budget
left after decode and prompt tokens, so prompts never wait for drafts.
"""

from __future__ import annotations

from dataclasses import dataclass


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
        start = self._after.get(tuple(seq[-self.n:]))
        if start is None:
            return []
        period = len(seq) - start
        return [seq[start + i] if i < period else seq[start + i % period] for i in range(k)]


def drafts_for(requests, speculation: Speculation, budget: int) -> tuple[list[list[int]], int]:
    """Per request (decoding, in slot order), its draft within `budget` rows in all, and the
    rows they take. A request drafts if its sampling is plain greedy, and at most one token
    fewer than it may still produce (the verifier's own token is the last)."""
    drafts: list[list[int]] = []
    used = 0
    for r in requests:
        room = min(speculation.tokens, r.params.max_new_tokens - len(r.output_token_ids) - 1, budget - used)
        if room <= 0 or not r.params.plain_greedy:
            drafts.append([])
            continue
        lookup = r.lookup
        if lookup is None:
            lookup = r.lookup = NgramLookup(speculation.ngram, r.prompt_token_ids)
        lookup.extend(r.output_token_ids[len(lookup.tokens) - r.prompt_len:])
        draft = lookup.draft(room)
        drafts.append(draft)
        used += len(draft)
    return drafts, used


def verify(drafts: list[list[int]], row_ids: list[int], requests: int) -> tuple[list[int], dict[int, list[int]]]:
    """The ids of an iteration's sampled rows (a request's own row, then one per draft token;
    requests past len(drafts) have no draft) -> each request's first token, and the tokens after
    it that its accepted draft gives: {request index: tokens}."""
    firsts, more, row = [], {}, 0
    for i in range(requests):
        draft = drafts[i] if i < len(drafts) else ()
        ids = row_ids[row: row + 1 + len(draft)]
        firsts.append(ids[0])
        accepted = 0
        while accepted < len(draft) and draft[accepted] == ids[accepted]:
            accepted += 1
        if accepted:
            more[i] = ids[1: accepted + 1]
        row += 1 + len(draft)
    return firsts, more
