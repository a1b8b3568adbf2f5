"""Structured output: what a request's text must match, and llguidance's matcher that allows, at
every step, only the tokens that can still lead to a match (docs/structured_output.md).

`Structured` is the request's contract (a value of SamplingParams, on the wire a map); `Grammars`
holds one model's view for llguidance (its tokenizer, built once) and the compiled grammars,
cached by their text; `GrammarState` is one request's matcher, advanced with every token."""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass

KINDS = ("json", "json_schema", "regex", "choice", "grammar")
MAX_SPEC_CHARS = 1 << 20  # a schema / regex / grammar's text; the HTTP body limit is the other bound
MAX_CHOICES = 1024
COMPACT = {"whitespace_flexible": False}  # JSON without free whitespace, unless the schema's x-guidance asks


@dataclass(frozen=True)
class Structured:
    """kind "json": any JSON object; "json_schema": `value` the schema (JSON text); "regex":
    Rust-regex syntax; "choice": `value` a tuple of strings, the text is exactly one of them;
    "grammar": a Lark grammar as llguidance takes it (docs/structured_output.md)."""

    kind: str
    value: str | tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if self.kind == "json_schema" and isinstance(self.value, (dict, str)):  # compact text: one cache entry
            try:  # (keys keep their order: the output's properties come in the schema's order)
                schema = json.loads(self.value) if isinstance(self.value, str) else self.value
                object.__setattr__(self, "value", json.dumps(schema, separators=(",", ":")))
            except (ValueError, TypeError, RecursionError):
                pass  # problem() names it
        if self.kind == "choice" and isinstance(self.value, list):
            object.__setattr__(self, "value", tuple(self.value))
        why = self.problem()
        if why:
            raise ValueError(f"SamplingParams.structured: {why}")

    @classmethod
    def of(cls, value) -> "Structured":
        """From the wire: a map {"kind": ..., "value": ...} (or a Structured)."""
        if isinstance(value, Structured):
            return value
        if not isinstance(value, dict) or set(value) - {"kind", "value"} or "kind" not in value:
            raise ValueError('SamplingParams.structured: must be a map {"kind": ..., "value": ...}')
        return cls(value["kind"], value.get("value"))

    def problem(self) -> str | None:
        """What is wrong with the shape (the grammar itself is checked when compiled), or None."""
        if self.kind not in KINDS:
            return f"kind {self.kind!r} is not one of {', '.join(KINDS)}"
        if self.kind == "json":
            return None if self.value is None else "kind json takes no value"
        if self.kind == "choice":
            if (not isinstance(self.value, tuple) or not 0 < len(self.value) <= MAX_CHOICES
                    or not all(isinstance(c, str) and c for c in self.value)):
                return f"kind choice needs 1 to {MAX_CHOICES} non-empty strings"
            return None if sum(map(len, self.value)) <= MAX_SPEC_CHARS else "the choices are too long"
        if not isinstance(self.value, str) or not self.value:
            return f"kind {self.kind} needs a non-empty string"
        if len(self.value) > MAX_SPEC_CHARS:
            return f"the {self.kind} is longer than {MAX_SPEC_CHARS} characters"
        if self.kind == "json_schema":
            try:
                schema = json.loads(self.value)
            except ValueError as e:
                return f"the JSON schema is not JSON: {e}"
            if not isinstance(schema, (dict, bool)):
                return "a JSON schema is an object (or true / false)"
        return None

    def grammar(self) -> str:
        """llguidance's grammar text for this contract."""
        import llguidance

        match = llguidance.LLMatcher
        if self.kind == "json":
            return match.grammar_from_json_schema({"type": "object"}, defaults=COMPACT)
        if self.kind == "json_schema":
            return match.grammar_from_json_schema(self.value, defaults=COMPACT)
        if self.kind == "regex":
            return match.grammar_from_regex(self.value)
        if self.kind == "choice":  # Lark string literals take JSON's escapes
            return match.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in self.value))
        return match.grammar_from_lark(self.value)


class Grammars:
    """One model's grammars: llguidance's tokenizer (from the checkpoint's, once) and the
    matchers compiled from each structure (its value canonical), kept for reuse (each request
    gets a copy)."""

    CACHED = 256

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: tuple[int, ...]):
        import llguidance

        self.vocab_size = vocab_size
        self.tokenizer = llguidance.LLTokenizer(tokenizer.backend_json(), n_vocab=vocab_size,
                                                eos_token=list(eos_token_ids) or None)
        self._compiled: OrderedDict[Structured, object] = OrderedDict()
        self._lock = threading.Lock()  # the daemon compiles on worker threads

    def compile(self, structured: Structured):
        """The compiled matcher of `structured` (cached); ValueError naming the problem when the
        library cannot compile it."""
        import llguidance

        with self._lock:  # (a hit costs no grammar text: the daemon compiles first, the loop finds it)
            if structured in self._compiled:
                self._compiled.move_to_end(structured)
                return self._compiled[structured]
        matcher = llguidance.LLMatcher(self.tokenizer, structured.grammar(), log_level=0)
        if matcher.is_error():
            raise ValueError(f"SamplingParams.structured: the {structured.kind} does not compile: "
                             f"{matcher.get_error()}")
        with self._lock:
            self._compiled[structured] = matcher
            while len(self._compiled) > self.CACHED:
                self._compiled.popitem(last=False)
        return matcher

    def start(self, structured: Structured) -> "GrammarState":
        return GrammarState(self.compile(structured).deep_copy(), self.vocab_size)


class GrammarState:
    """One request's matcher: the tokens allowed next, advanced by each token drawn."""

    def __init__(self, matcher, vocab_size: int):
        self.matcher, self.words = matcher, (vocab_size + 31) // 32

    def fill_allowed(self, bits, draft: list[int] = ()) -> None:
        """Into `bits` ([1 + len(draft), words] int32, CPU, contiguous): row j's bit t set where
        token t is allowed after the first j tokens of `draft` (which the grammar allows)."""
        for j in range(len(draft) + 1):
            self.matcher.unsafe_compute_mask_ptr(bits[j].data_ptr(), self.words * 4)
            if j < len(draft) and not self.matcher.consume_token(draft[j]):
                raise ValueError(f"draft token {draft[j]} is not allowed: {self.matcher.get_error()}")
        self.matcher.rollback(len(draft))

    def forced(self) -> list[int]:
        """The tokens the grammar forces next (none where it leaves a choice)."""
        return self.matcher.compute_ff_tokens()

    def valid_prefix(self, tokens: list[int]) -> list[int]:
        """The longest start of `tokens` the grammar allows from here."""
        return tokens[: self.matcher.validate_tokens(tokens)] if tokens else tokens

    def advance(self, token: int) -> str | None:
        """Follow `token`; why it broke the grammar, or None."""
        if self.matcher.consume_token(token):
            return None
        return f"the output left its structure: {self.matcher.get_error()}"

    @property
    def done(self) -> bool:
        """The text is complete and nothing may follow (the matcher took its end)."""
        return self.matcher.is_stopped()


def allowed_bits(states: list[GrammarState | None], vocab: int, drafts: list[list[int]] | None = None):
    """[rows, words] int32 tensor (llguidance's bitmask): per state its row, bit t set where it
    allows token t now, then a row per token of its draft (drafts: one per state, if any: the
    tokens allowed after the draft's tokens before it); every bit set in the rows of a state None."""
    import torch  # (the HTTP front imports this module for the contract only)

    drafts = drafts if drafts is not None else [[] for _ in states]
    bits = torch.full((len(states) + sum(map(len, drafts)), (vocab + 31) // 32), -1, dtype=torch.int32)
    row = 0
    for state, draft in zip(states, drafts):
        if state is not None:
            state.fill_allowed(bits[row: row + 1 + len(draft)], draft)
        row += 1 + len(draft)
    return bits


def unpack_bits(bits, vocab: int):
    """[rows, words] int32 bitmask -> [rows, vocab] bool."""
    import torch

    shifts = torch.arange(32, dtype=torch.int32, device=bits.device)
    return ((bits[:, :, None] >> shifts) & 1).bool().reshape(len(bits), -1)[:, :vocab]
