"""A bounded child process: work the server cannot afford to try itself (a grammar compile, a chat
template's rendering) runs in a child whose address space is capped and which is killed when its
answer is late. One question at a time (a lock); the child is started on first use and again after
it was killed or died.

The child idles (SCHED_IDLE: it runs only on a core nothing else wants; at nice 19 its work still
took slices from the engine's threads at every barrier: figures in docs/hardening.md), or, for work
a request waits on, runs at nice 19; it dies with the server (PR_SET_PDEATHSIG): work the server
no longer times never outlives it.

Frames both ways: 4-byte little-endian length + msgpack (no pickle). The child's entry is a
module's `_serve()`, which reads its setup frame, caps itself (`cap_address_space`) and answers
one frame with one frame until its stdin closes.
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

import msgpack

PAGE = os.sysconf("SC_PAGE_SIZE")


def memory_now() -> int:
    """This process's resident bytes."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


def cap_address_space(extra_mib: int) -> None:
    """The child's own cap: what it holds now + `extra_mib` (a MemoryError past it)."""
    with open("/proc/self/statm") as f:
        cap = int(f.read().split()[0]) * PAGE + (extra_mib << 20)
    resource.setrlimit(resource.RLIMIT_AS, (cap, cap))


def write_frame(stream, obj) -> None:
    data = msgpack.packb(obj, use_bin_type=True)
    stream.write(struct.pack("<I", len(data)) + data)
    stream.flush()


def read_frame(stream):
    head = stream.read(4)
    if len(head) < 4:
        return None
    (size,) = struct.unpack("<I", head)
    data = stream.read(size)
    return msgpack.unpackb(data, raw=False) if len(data) == size else None


class ChildStopped(Exception):
    """The child gave no answer: `timed_out` (killed at the deadline), else it died (over its
    memory cap, or a crash); `last_words`: the end of what it wrote to stderr; `at_start`: in its
    start-up (its greeting); `sent`: False when the job never reached it (it had died before)."""

    def __init__(self, timed_out: bool, last_words: str, at_start: bool = False, sent: bool = True):
        super().__init__("timed out" if timed_out else "stopped")
        self.timed_out, self.last_words, self.at_start, self.sent = timed_out, last_words, at_start, sent


class BoundedChild:
    """The server's side of one child: `ask(job, seconds)` -> its reply (a dict), or ChildStopped."""

    def __init__(self, module: str, setup: dict, env: dict | None = None, greets: bool = False, idle: bool = True):
        """`module`: whose `_serve()` the child runs; `setup`: its first frame. `greets`: the child
        answers its setup with a frame of its own (a compile at start-up: {"error": ...} or not).
        `idle`: SCHED_IDLE (work that may wait for an idle core), else nice 19 (work a request
        waits for, which a busy engine must not starve)."""
        self.module, self.setup, self.env, self.greets = module, setup, env or {}, greets
        self.idle = idle
        self.proc: subprocess.Popen | None = None
        self._stderr = None
        self.last_words = ""  # the end of what the last killed child wrote
        self._greeting_due = False  # a greeting child started, its greeting not read yet
        self._lock = threading.Lock()

    def ask(self, job: dict, seconds: float) -> dict:
        """One job, answered within `seconds` (killed after). A new child that greets with an
        error answers the job with it."""
        with self._lock:
            greeting = self._child(seconds)
            if greeting is not None and greeting.get("error") is not None:
                return greeting
            try:
                write_frame(self.proc.stdin, job)
            except (BrokenPipeError, OSError):
                self._kill()
                raise ChildStopped(False, self.last_words, sent=False) from None
            return self._reply(seconds)

    def _reply(self, seconds: float, at_start: bool = False) -> dict:
        started = time.monotonic()
        ready, _, _ = select.select([self.proc.stdout], [], [], seconds + 1.0)
        reply = read_frame(self.proc.stdout) if ready else None
        if reply is None:
            timed_out = not ready or time.monotonic() - started > seconds
            self._kill()
            raise ChildStopped(timed_out, self.last_words, at_start)
        return reply

    def start(self) -> None:
        """Start the child now (a server does at start-up, before it serves); its greeting (a
        compile at start-up) is read by the first job, so that nothing waits for it here."""
        with self._lock:
            if self.proc is None or self.proc.poll() is not None:
                self._spawn()

    def _child(self, seconds: float) -> dict | None:
        """The running child, started if there is none; its greeting if not read yet (else None)."""
        if self.proc is None or self.proc.poll() is not None:
            self._spawn()
        if not self._greeting_due:
            return None
        self._greeting_due = False
        return self._reply(seconds, at_start=True)

    def _spawn(self) -> None:
        env = {**os.environ, **self.env}
        self._stderr = tempfile.TemporaryFile()  # what a dying child says (Rust: why it aborted)
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _CHILD.format(module=self.module, idle=self.idle)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            env=env,
            start_new_session=True,
        )
        write_frame(self.proc.stdin, self.setup)
        self._greeting_due = self.greets

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
        """Kill the child now, also in the middle of a job (which then answers at once)."""
        proc = self.proc
        if proc is not None and proc.poll() is None:
            proc.kill()


_CHILD = (
    "import os, sys\n"
    "try:\n    if not {idle}:\n        raise OSError\n    os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))\n"
    "except (AttributeError, OSError):\n    os.nice(19)\n"
    "try:\n    import ctypes, signal\n    ctypes.CDLL('libc.so.6').prctl(1, signal.SIGKILL)\n"
    "except (OSError, AttributeError):\n    pass\n"
    "from {module} import _serve\nsys.exit(_serve())\n"
)
