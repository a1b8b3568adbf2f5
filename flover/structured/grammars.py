"""llguidance's matcher that allows, at every step, only the tokens that can still lead to a match
(docs/structured_output.md): `Grammars` holds one model's view for llguidance (its tokenizer,
built once) and the compiled grammars, cached by their text; `GrammarState` is one request's
matcher, advanced with every token."""

from __future__ import annotations

import threading
import time
from collections import OrderedDict

from flover.child_process import memory_now
from flover.hardware import return_freed_heap
from flover.structured.grammar_sandbox import GrammarSandbox
from flover.structured.spec import GrammarLimitReached, GrammarLimits, RowFailure, Structured, parser_limits, short


class Grammars:
    """One model's grammars: llguidance's tokenizer (from the checkpoint's, once) and the
    matchers compiled from each structure (its value canonical), kept for reuse up to
    `limits.cache_mib` (each request gets a copy). With `sandboxed` every new grammar is compiled
    first in a child process held to the compile limits (grammar_sandbox.py): only one that
    compiles there within them is compiled here."""

    def __init__(
        self,
        tokenizer,
        vocab_size: int,
        eos_token_ids: tuple[int, ...],
        limits: GrammarLimits = GrammarLimits(),
        sandboxed: bool = False,
    ):
        import llguidance

        self.vocab_size, self.limits = vocab_size, limits
        backend = tokenizer.backend_json()
        self.eos = list(eos_token_ids) or None
        self.tokenizer = llguidance.LLTokenizer(backend, n_vocab=vocab_size, eos_token=self.eos)
        self.parser_limits = parser_limits(limits)
        self.sandbox = GrammarSandbox(backend, vocab_size, self.eos, limits) if sandboxed else None
        self._compiled: OrderedDict[Structured, tuple[object, int]] = OrderedDict()  # -> (matcher, bytes)
        self.cached_bytes = 0
        self._lock = threading.Lock()  # the daemon compiles on worker threads

    def cached(self, structured: Structured) -> bool:
        with self._lock:
            return structured in self._compiled

    def compile(self, structured: Structured):
        """The compiled matcher of `structured` (cached); ValueError naming the problem when the
        library cannot compile it, GrammarLimitReached when it costs more than the limits."""
        import llguidance

        with self._lock:  # (a hit costs no grammar text: the daemon compiles first, the loop finds it)
            if structured in self._compiled:
                self._compiled.move_to_end(structured)
                return self._compiled[structured][0]
        try:
            grammar = structured.grammar()
        except (ValueError, RecursionError) as e:
            raise ValueError(f"SamplingParams.structured: the {structured.kind} does not compile: {short(str(e))}")
        measured = 0
        if self.sandbox is not None:
            measured = self.sandbox.check(grammar, structured.kind)  # raises what the child found
        before = memory_now()
        matcher = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0, limits=self.parser_limits)
        if matcher.is_error():
            raise ValueError(
                f"SamplingParams.structured: the {structured.kind} does not compile: {short(matcher.get_error())}"
            )
        cost = max(measured, memory_now() - before, len(grammar))
        budget = self.limits.cache_mib << 20
        with self._lock:
            if structured not in self._compiled and cost <= budget:
                self._compiled[structured] = (matcher, cost)
                self.cached_bytes += cost
            while self.cached_bytes > budget:
                _, (_, freed) = self._compiled.popitem(last=False)
                self.cached_bytes -= freed
        return matcher

    def start(self, structured: Structured) -> "GrammarState":
        return GrammarState(
            self.compile(structured).deep_copy(), self.vocab_size, self.limits, on_limit=lambda: self.forget(structured)
        )

    def forget(self, structured: Structured) -> None:
        """Drop a grammar whose request reached a limit: its lexer grew in the cached matcher
        (copies share it), and what it holds goes back to the system."""
        with self._lock:
            entry = self._compiled.pop(structured, None)
            if entry is not None:
                self.cached_bytes -= entry[1]
        if entry is not None:
            del entry
            return_freed_heap()

    def close(self) -> None:
        if self.sandbox is not None:
            self.sandbox.close()


class GrammarState:
    """One request's matcher: the tokens allowed next, advanced by each token drawn."""

    def __init__(self, matcher, vocab_size: int, limits: GrammarLimits = GrammarLimits(), on_limit=None):
        self.matcher, self.words, self.limits = matcher, (vocab_size + 31) // 32, limits
        self.on_limit = on_limit  # called once a limit ends the request (the cache drops the grammar)
        self.mask_budget_ms = limits.mask_burst_ms  # in hand; each token adds mask_ms_per_token
        self.mask_ms = 0.0  # spent, in all

    def fill_allowed(self, bits, draft: list[int] = ()) -> None:
        """Into `bits` ([1 + len(draft), words] int32, CPU, contiguous): row j's bit t set where
        token t is allowed after the first j tokens of `draft` (which the grammar allows).
        GrammarLimitReached when the masks took more time than the request has in hand."""
        started = time.perf_counter()
        for j in range(len(draft) + 1):
            self.matcher.unsafe_compute_mask_ptr(bits[j].data_ptr(), self.words * 4)
            if self.matcher.is_error():  # (llguidance's lexer limits: --grammar-lexer-fuel)
                raise GrammarLimitReached(
                    f"structured output: {short(self.matcher.get_error())} (the grammar "
                    f"needs more lexer work than the server allows: --grammar-lexer-fuel)"
                )
            if j < len(draft) and not self.matcher.consume_token(draft[j]):
                raise ValueError(f"draft token {draft[j]} is not allowed: {short(self.matcher.get_error())}")
        self.matcher.rollback(len(draft))
        spent = 1000 * (time.perf_counter() - started)
        self.mask_ms += spent
        self.mask_budget_ms -= spent
        if self.mask_budget_ms < 0:
            raise GrammarLimitReached(
                f"structured output: the grammar's token masks took {self.mask_ms:.0f} ms, more than the server "
                f"allows ({self.limits.mask_ms_per_token:g} ms a token, {self.limits.mask_burst_ms:g} ms at once: "
                f"--grammar-mask-ms, --grammar-mask-burst-ms)"
            )

    def forced(self) -> list[int]:
        """The tokens the grammar forces next (none where it leaves a choice)."""
        return self.matcher.compute_ff_tokens()

    def valid_prefix(self, tokens: list[int]) -> list[int]:
        """The longest start of `tokens` the grammar allows from here."""
        return tokens[: self.matcher.validate_tokens(tokens)] if tokens else tokens

    def advance(self, token: int) -> str | None:
        """Follow `token`; why it broke the grammar, or None."""
        self.mask_budget_ms = min(self.limits.mask_burst_ms, self.mask_budget_ms + self.limits.mask_ms_per_token)
        if self.matcher.consume_token(token):
            return None
        return f"the output left its structure: {short(self.matcher.get_error())}"

    @property
    def done(self) -> bool:
        """The text is complete and nothing may follow (the matcher took its end)."""
        return self.matcher.is_stopped()


def allowed_bits(states: list[GrammarState | None], vocab: int, drafts: list[list[int]] | None = None):
    """([rows, words] int32 tensor (llguidance's bitmask), {row: RowFailure}): per state its row,
    bit t set where it allows token t now, then a row per token of its draft (drafts: one per
    state, if any: the tokens allowed after the draft's tokens before it); every bit set in the
    rows of a state None, and in those of a state that failed (its request ends with the reason,
    the others' rows are unaffected)."""
    import torch  # (the HTTP front imports this module for the contract only)

    drafts = drafts if drafts is not None else [[] for _ in states]
    bits = torch.full((len(states) + sum(map(len, drafts)), (vocab + 31) // 32), -1, dtype=torch.int32)
    failed: dict[int, RowFailure] = {}
    row = 0
    for state, draft in zip(states, drafts):
        if state is not None:
            try:
                state.fill_allowed(bits[row : row + 1 + len(draft)], draft)
            except GrammarLimitReached as e:
                failed[row] = RowFailure(str(e))
                bits[row : row + 1 + len(draft)] = -1
                if state.on_limit is not None:
                    state.on_limit()
            except Exception as e:  # llguidance's own failure: this request's, not the iteration's
                failed[row] = f"structured output failed: {short(str(e))}"
                bits[row : row + 1 + len(draft)] = -1
        row += 1 + len(draft)
    return bits, failed


def unpack_bits(bits, vocab: int):
    """[rows, words] int32 bitmask -> [rows, vocab] bool."""
    import torch

    shifts = torch.arange(32, dtype=torch.int32, device=bits.device)
    return ((bits[:, :, None] >> shifts) & 1).bool().reshape(len(bits), -1)[:, :vocab]
