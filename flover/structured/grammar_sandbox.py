"""A child process that tries grammar compiles the server cannot afford to try itself.

llguidance compiles some small schemas for minutes and gigabytes (27 `allOf` string patterns: the
regex intersection it must prove non-empty grows exponentially), inside one native call that no
fuel limit stops. Here every new grammar is compiled first in a child (child_process.py) whose
address space is capped (what it holds after start-up + `memory_mib`) and which is killed after
`seconds`: only a grammar that compiled there, within both, is compiled by the server, whose own
compile then costs the same bounded time and memory. The child reports what the compiled grammar
holds (its resident growth), the size the server's grammar cache counts it at.
"""

from __future__ import annotations

import sys
from dataclasses import asdict

from flover.child_process import BoundedChild, ChildStopped, cap_address_space, memory_now, read_frame, write_frame
from flover.structured.spec import GrammarLimitReached, GrammarLimits, parser_limits, short


class GrammarSandbox:
    """The server's side: `check(grammar)` -> the bytes the compiled grammar holds, or
    GrammarLimitReached naming the limit, or ValueError with the compiler's message. One check
    at a time; the child is started on first use and again after it was killed."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos: list[int] | None, limits):
        """`limits`: structured.GrammarLimits."""
        setup = {"tokenizer": tokenizer_json, "vocab": vocab_size, "eos": eos, "limits": asdict(limits)}
        self.seconds, self.memory_mib = limits.compile_seconds, limits.compile_mib
        self.child = BoundedChild(
            "flover.structured.grammar_sandbox",
            setup,
            env={"TOKENIZERS_PARALLELISM": "false", "RAYON_NUM_THREADS": "1"},
        )

    def check(self, grammar: str, kind: str) -> int:
        try:
            reply = self.child.ask({"grammar": grammar}, self.seconds)
        except ChildStopped as stopped:
            if not stopped.sent:
                raise GrammarLimitReached("structured output: the grammar checker stopped; try again") from None
            if stopped.timed_out:
                raise GrammarLimitReached(
                    f"structured output: compiling the {kind} took longer than the server's "
                    f"limit of {self.seconds:g} s (--grammar-compile-seconds)"
                ) from None
            if "overflowed its stack" in stopped.last_words:
                raise GrammarLimitReached(f"structured output: the {kind} nests too deeply to compile") from None
            raise GrammarLimitReached(
                f"structured output: compiling the {kind} needed more memory than the "
                f"server's limit of {self.memory_mib} MiB (--grammar-compile-mib)"
            ) from None
        if reply.get("error") is not None:
            raise ValueError(f"SamplingParams.structured: the {kind} does not compile: {short(reply['error'])}")
        return int(reply["bytes"])

    @property
    def proc(self):
        return self.child.proc

    def start(self) -> None:
        """Start the child now (a server does at start-up: its tokenizer is built before serving)."""
        self.child.start()

    def close(self) -> None:
        """Kill the child now, also in the middle of a check (which then answers at once)."""
        self.child.close()


def _serve() -> int:
    """The child: the tokenizer once, then one compile per frame, each answered with its error or
    the bytes it holds."""
    import ctypes

    import llguidance

    from flover.hardware import return_freed_heap

    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    setup = read_frame(stdin)
    if setup is None:
        return 1
    tokenizer = llguidance.LLTokenizer(setup["tokenizer"], n_vocab=setup["vocab"], eos_token=setup["eos"])
    grammar_limits = GrammarLimits(**setup["limits"])
    limits = parser_limits(grammar_limits)  # the server's own, so that what passes here passes there
    cap_address_space(grammar_limits.compile_mib)
    words = (setup["vocab"] + 31) // 32
    mask = ctypes.create_string_buffer(words * 4)
    while True:
        job = read_frame(stdin)
        if job is None:
            return 0
        before = memory_now()
        try:
            matcher = llguidance.LLMatcher(tokenizer, job["grammar"], log_level=0, limits=limits)
            if not matcher.is_error():  # the first mask builds the lexer's start: part of the cost
                matcher.unsafe_compute_mask_ptr(ctypes.addressof(mask), words * 4)
            error = matcher.get_error() if matcher.is_error() else None
            held = memory_now() - before
        except MemoryError:
            return 3  # the parent reads EOF: over the memory limit
        except Exception as e:
            error, held = str(e) or type(e).__name__, 0
        matcher = None
        return_freed_heap()
        write_frame(stdout, {"error": error, "bytes": held})
