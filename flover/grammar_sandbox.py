"""A child process that tries grammar compiles the server cannot afford to try itself.

llguidance compiles some small schemas for minutes and gigabytes (27 `allOf` string patterns: the
regex intersection it must prove non-empty grows exponentially), inside one native call that no
fuel limit stops. Here every new grammar is compiled first in a child whose address space is
capped (RLIMIT_AS: what it holds after start-up + `memory_mib`) and which is killed after
`seconds`: only a grammar that compiled there, within both, is compiled by the server, whose own
compile then costs the same bounded time and memory. The child reports what the compiled grammar
holds (its resident growth), the size the server's grammar cache counts it at.

Frames both ways: 4-byte little-endian length + msgpack (no pickle).

(GrammarSandbox starts the child: `_serve` below.)
"""

from __future__ import annotations

import os
import resource
import select
import struct
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict

import msgpack

PAGE = os.sysconf("SC_PAGE_SIZE")


def memory_now() -> int:
    """This process's resident bytes."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


def _address_space() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[0]) * PAGE


def _write(stream, obj) -> None:
    data = msgpack.packb(obj, use_bin_type=True)
    stream.write(struct.pack("<I", len(data)) + data)
    stream.flush()


def _read(stream):
    head = stream.read(4)
    if len(head) < 4:
        return None
    (size,) = struct.unpack("<I", head)
    data = stream.read(size)
    return msgpack.unpackb(data, raw=False) if len(data) == size else None


class GrammarSandbox:
    """The server's side: `check(grammar)` -> the bytes the compiled grammar holds, or
    GrammarLimitReached naming the limit, or ValueError with the compiler's message. One check
    at a time (a lock); the child is started on first use and again after it was killed."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos: list[int] | None, limits):
        """`limits`: structured.GrammarLimits."""
        self.setup = {"tokenizer": tokenizer_json, "vocab": vocab_size, "eos": eos, "limits": asdict(limits)}
        self.seconds, self.memory_mib = limits.compile_seconds, limits.compile_mib
        self.proc: subprocess.Popen | None = None
        self._stderr = None
        self.last_words = ""  # the end of what the last killed child wrote
        self._lock = threading.Lock()

    def check(self, grammar: str, kind: str) -> int:
        from flover.structured import GrammarLimitReached, short

        with self._lock:
            proc = self._child()
            started = time.monotonic()
            try:
                _write(proc.stdin, {"grammar": grammar})
            except (BrokenPipeError, OSError):
                self._kill()
                raise GrammarLimitReached("structured output: the grammar checker stopped; try again") from None
            ready, _, _ = select.select([proc.stdout], [], [], self.seconds + 1.0)
            reply = _read(proc.stdout) if ready else None
            if reply is None:
                timed_out = not ready or time.monotonic() - started > self.seconds
                self._kill()
                if timed_out:
                    raise GrammarLimitReached(
                        f"structured output: compiling the {kind} took longer than the server's "
                        f"limit of {self.seconds:g} s (--grammar-compile-seconds)"
                    )
                if "overflowed its stack" in self.last_words:
                    raise GrammarLimitReached(f"structured output: the {kind} nests too deeply to compile")
                raise GrammarLimitReached(
                    f"structured output: compiling the {kind} needed more memory than the "
                    f"server's limit of {self.memory_mib} MiB (--grammar-compile-mib)"
                )
            if reply.get("error") is not None:
                raise ValueError(f"SamplingParams.structured: the {kind} does not compile: {short(reply['error'])}")
            return int(reply["bytes"])

    def start(self) -> None:
        """Start the child now (a server does at start-up: its tokenizer is built before serving)."""
        with self._lock:
            self._child()

    def _child(self) -> subprocess.Popen:
        if self.proc is None or self.proc.poll() is not None:
            env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "RAYON_NUM_THREADS": "1"}
            self._stderr = tempfile.TemporaryFile()  # what a dying child says (Rust: why it aborted)
            self.proc = subprocess.Popen(
                [sys.executable, "-c", _CHILD],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=self._stderr,
                env=env,
                start_new_session=True,
            )
            _write(self.proc.stdin, self.setup)
        return self.proc

    def _kill(self) -> None:
        self.last_words = ""
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self._stderr.seek(0)
            self.last_words = self._stderr.read()[-4096:].decode(errors="replace")
            self._stderr.close()
            for stream in (self.proc.stdin, self.proc.stdout):
                try:
                    stream.close()
                except OSError:
                    pass
            self.proc = None

    def close(self) -> None:
        """Kill the child now, also in the middle of a check (which then answers at once)."""
        proc = self.proc
        if proc is not None and proc.poll() is None:
            proc.kill()


# The child idles before anything else (SCHED_IDLE: it runs only on a core nothing else wants; at
# nice 19 its compiles still took slices from the engine's threads at every barrier: figures in
# docs/hardening.md).
# It also dies with the server (PR_SET_PDEATHSIG): a compile the server no longer times never
# outlives it.
_CHILD = (
    "import os, sys\n"
    "try:\n    os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))\n"
    "except (AttributeError, OSError):\n    os.nice(19)\n"
    "try:\n    import ctypes, signal\n    ctypes.CDLL('libc.so.6').prctl(1, signal.SIGKILL)\n"
    "except (OSError, AttributeError):\n    pass\n"
    "from flover.grammar_sandbox import _serve\nsys.exit(_serve())\n"
)


def _serve() -> int:
    """The child: the tokenizer once, then one compile per frame, each answered with its error or
    the bytes it holds."""
    import ctypes

    import llguidance

    from flover.hardware import return_freed_heap
    from flover.structured import GrammarLimits, parser_limits

    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    setup = _read(stdin)
    if setup is None:
        return 1
    tokenizer = llguidance.LLTokenizer(setup["tokenizer"], n_vocab=setup["vocab"], eos_token=setup["eos"])
    grammar_limits = GrammarLimits(**setup["limits"])
    limits = parser_limits(grammar_limits)  # the server's own, so that what passes here passes there
    cap = _address_space() + (grammar_limits.compile_mib << 20)
    resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    words = (setup["vocab"] + 31) // 32
    mask = ctypes.create_string_buffer(words * 4)
    while True:
        job = _read(stdin)
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
        _write(stdout, {"error": error, "bytes": held})
