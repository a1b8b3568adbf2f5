"""Structured output: what a request's text must match, and llguidance's matcher that allows, at
every step, only the tokens that can still lead to a match (docs/structured_output.md).

`Structured` is the request's contract (a value of SamplingParams, on the wire a map); `Grammars`
holds one model's view for llguidance (its tokenizer, built once) and the compiled grammars,
cached by their text; `GrammarState` is one request's matcher, advanced with every token."""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

from flover.child_process import memory_now
from flover.grammar_sandbox import GrammarSandbox
from flover.hardware import return_freed_heap

KINDS = ("json", "json_schema", "regex", "choice", "grammar")
MAX_SPEC_CHARS = 1 << 20  # a schema / regex / grammar's text; the HTTP body limit is the other bound
MAX_CHOICES = 1024
MAX_SCHEMA_DEPTH = 64  # nesting of a JSON schema (as of a request body: its compiler recurses)
MAX_ERROR_CHARS = 400  # of llguidance's messages that reach a client
COMPACT = {"whitespace_flexible": False}  # JSON without free whitespace, unless the schema's x-guidance asks
# What the grammar lets a number grow to, where the schema sets no bound of its own (llama.cpp's
# schema grammar allows 16 integer digits; xgrammar bounds them too): without a bound a model that
# repeats a digit writes one number until max_tokens.
NUMBER_BOUND = 10**15  # |a number| below this: at most 16 integer digits
NUMBER_STEP = "0.000001"  # multipleOf: at most 6 decimals (no exponent)


@dataclass(frozen=True)
class GrammarLimits:
    """What one structure may cost the server (docs/hardening.md). A compile is tried first in a
    child process held to `compile_seconds` and `compile_mib`; the compiled grammars kept for
    reuse hold at most `cache_mib`; a request's token masks may take `mask_ms_per_token` on
    average, with `mask_burst_ms` in hand (the first masks build the lexer)."""

    compile_seconds: float = 5.0
    compile_mib: int = 256  # far above a large real schema's (docs/hardening.md)
    cache_mib: int = 512
    mask_ms_per_token: float = 5.0
    mask_burst_ms: float = 250.0
    lexer_states: int = 20_000  # llguidance's lexer DFA per grammar (its own default: 250,000)
    lexer_fuel: int = 50_000  # llguidance's lexer work for one token mask (its own default: 200,000)


def parser_limits(limits: GrammarLimits):
    import llguidance

    return llguidance.LLParserLimits(
        verbose_errors=False, max_lexer_states=limits.lexer_states, step_lexer_fuel=limits.lexer_fuel
    )


class GrammarLimitReached(ValueError):
    """A structure that costs more than the server's limits: the request's own problem (a 400)."""


class RowFailure(str):
    """Why a row of an iteration failed, with the wire's error code (a plain str: internal_error)."""

    code = "invalid_request"


def short(text: str) -> str:
    """llguidance's message, cut to what a client can read (it can hold kilobytes of state)."""
    text = text.replace("\n<non-verbose/>", "").strip()
    return text if len(text) <= MAX_ERROR_CHARS else text[:MAX_ERROR_CHARS] + " ..."


def bound_numbers(schema):
    """`schema` with NUMBER_BOUND / NUMBER_STEP added to every number or integer it types without
    bounds of its own (a copy; iterative: the depth was checked)."""
    schema = json.loads(json.dumps(schema))
    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            stack.extend(node)
            continue
        if not isinstance(node, dict):
            continue
        types = node.get("type")
        types = [types] if isinstance(types, str) else types if isinstance(types, list) else []
        if ("number" in types or "integer" in types) and "enum" not in node and "const" not in node:
            if "minimum" not in node and "exclusiveMinimum" not in node:
                node["minimum"] = -NUMBER_BOUND + 1
            if "maximum" not in node and "exclusiveMaximum" not in node:
                node["maximum"] = NUMBER_BOUND - 1
            if "integer" not in types and "multipleOf" not in node:
                node["multipleOf"] = float(NUMBER_STEP)
        for key, value in node.items():
            if key not in ("enum", "const", "default", "examples") and isinstance(value, (dict, list)):
                stack.append(value)
    return schema


def _depth(value) -> int:
    """Nesting of a JSON value, iteratively (a schema's text can nest 5,000 deep)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, (dict, list)):
            deepest = max(deepest, depth)
            if depth <= MAX_SCHEMA_DEPTH:
                stack.extend((v, depth + 1) for v in (node.values() if isinstance(node, dict) else node))
    return deepest


# kind "json": any object whose numbers are bounded as above (llguidance's own "any JSON" is not)
ANY_JSON = {
    "$defs": {
        "v": {
            "anyOf": [
                {"type": "null"},
                {"type": "boolean"},
                {"type": "string"},
                {"type": "number"},
                {"type": "array", "items": {"$ref": "#/$defs/v"}},
                {"type": "object", "additionalProperties": {"$ref": "#/$defs/v"}},
            ]
        }
    },
    "type": "object",
    "additionalProperties": {"$ref": "#/$defs/v"},
}


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
                if _depth(schema) <= MAX_SCHEMA_DEPTH and isinstance(schema, (dict, bool)):
                    object.__setattr__(self, "value", json.dumps(schema, separators=(",", ":")))
                    object.__setattr__(self, "_checked", True)  # (problem() need not parse it again)
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
            if (
                not isinstance(self.value, tuple)
                or not 0 < len(self.value) <= MAX_CHOICES
                or not all(isinstance(c, str) and c for c in self.value)
            ):
                return f"kind choice needs 1 to {MAX_CHOICES} non-empty strings"
            return None if sum(map(len, self.value)) <= MAX_SPEC_CHARS else "the choices are too long"
        if not isinstance(self.value, str) or not self.value:
            return f"kind {self.kind} needs a non-empty string"
        if len(self.value) > MAX_SPEC_CHARS:
            return f"the {self.kind} is longer than {MAX_SPEC_CHARS} characters"
        if self.kind == "json_schema" and not getattr(self, "_checked", False):
            try:
                schema = json.loads(self.value)
            except ValueError as e:
                return f"the JSON schema is not JSON: {e}"
            except RecursionError:
                return f"the JSON schema nests deeper than {MAX_SCHEMA_DEPTH} levels"
            if _depth(schema) > MAX_SCHEMA_DEPTH:
                return f"the JSON schema nests deeper than {MAX_SCHEMA_DEPTH} levels"
            if not isinstance(schema, (dict, bool)):
                return "a JSON schema is an object (or true / false)"
        return None

    def grammar(self) -> str:
        """llguidance's grammar text for this contract."""
        import llguidance

        match = llguidance.LLMatcher
        if self.kind == "json":
            return match.grammar_from_json_schema(bound_numbers(ANY_JSON), defaults=COMPACT)
        if self.kind == "json_schema":
            schema = json.loads(self.value)
            return match.grammar_from_json_schema(
                json.dumps(bound_numbers(schema)) if isinstance(schema, dict) else self.value, defaults=COMPACT
            )
        if self.kind == "regex":
            return match.grammar_from_regex(self.value)
        if self.kind == "choice":  # Lark string literals take JSON's escapes
            return match.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in self.value))
        return match.grammar_from_lark(self.value)


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
