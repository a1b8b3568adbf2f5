"""What a request's structured output must match (`Structured`, a value of SamplingParams, on the
wire a map) and what one grammar may cost (`GrammarLimits`): the contract, importable without
llguidance or the grammar checker's child (flover/config.py reads it)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from flover.flags import flag

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

    compile_seconds: float = field(
        default=5.0,
        metadata=flag(
            "--grammar-compile-seconds",
            "structured output: a new grammar compiles first in a child process, killed after S "
            "seconds (the request gets a 400 naming the limit; default %(default)g)",
            metavar="S",
        ),
    )
    compile_mib: int = field(  # far above a large real schema's (docs/hardening.md)
        default=256,
        metadata=flag("--grammar-compile-mib", "... and held to MIB of memory (default %(default)d)", metavar="MIB"),
    )
    cache_mib: int = field(
        default=512,
        metadata=flag(
            "--grammar-cache-mib",
            "compiled grammars kept for reuse, least recently used first out (default %(default)d)",
            metavar="MIB",
        ),
    )
    mask_ms_per_token: float = field(
        default=5.0,
        metadata=flag(
            "--grammar-mask-ms",
            "a request's token masks may take MS a token on average; a request past it ends with an "
            "error naming the limit (default %(default)g)",
            metavar="MS",
        ),
    )
    mask_burst_ms: float = field(
        default=250.0,
        metadata=flag(
            "--grammar-mask-burst-ms",
            "... with MS in hand at any time (the first masks build the lexer; default %(default)g)",
            metavar="MS",
        ),
    )
    lexer_states: int = 20_000  # llguidance's lexer DFA per grammar (its own default: 250,000)
    lexer_fuel: int = field(  # llguidance's lexer work for one token mask (its own default: 200,000)
        default=50_000,
        metadata=flag(
            "--grammar-lexer-fuel",
            "llguidance's lexer work for one token mask (its step_lexer_fuel; default %(default)d, "
            "llguidance's own 200000); a grammar past it ends its request with an error",
            metavar="N",
        ),
    )


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
