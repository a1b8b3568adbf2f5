"""The JSONL results file: append-only, one complete line per write, resumable.

A process killed at any moment (SIGKILL included) leaves whole lines plus at most one torn last
line; `recover` drops that torn line and returns the ids already done, so that re-running the
same command writes every missing record exactly once.

Only a completed request or a permanent per-prompt error (a malformed line, an invalid request,
a prompt too long) is a record; transient failures (the server shut down, a lost connection, an
internal error) write nothing, so that a resume retries them.

`open_results` guards a resume: an exclusive lock on the file (two runs never write one file),
and a fingerprint of what produced it (prompt file, sampling parameters, model) kept beside it
in PATH.fingerprint.json, so that results of different inputs are never mixed in one file.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import stat
import sys
from collections import deque


class ResultsFileError(ValueError):
    pass


def _is_regular(path: str) -> bool:
    try:
        return stat.S_ISREG(os.stat(path).st_mode)
    except FileNotFoundError:
        return False


def recover(path: str) -> set[str]:
    """Ids of the complete records in `path`; truncates a torn last line. Missing file, or not a
    regular file (a pipe, /dev/null, /dev/full): nothing to resume."""
    if path == "-" or not _is_regular(path):
        return set()
    done: set[str] = set()
    good_end = 0
    with open(path, "rb+") as f:
        number = 0
        while True:
            line = f.readline()
            if not line:
                break
            number += 1
            try:
                record = json.loads(line)
                rid = record["id"]
            except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError):
                if f.readline():  # not the last line: this is damage we did not cause
                    raise ResultsFileError(
                        f"{path}: line {number} is not a result record; fix or move the file before resuming"
                    ) from None
                break  # a torn last line from a hard kill: dropped below
            done.add(str(rid))
            good_end = f.tell()
            if not line.endswith(b"\n"):  # complete JSON whose newline never made it
                f.write(b"\n")
                good_end += 1
        f.truncate(good_end)
    return done


class ResultsFile:
    """Appends records; each is written with one os.write of a whole line (O_APPEND)."""

    def __init__(self, path: str, lock: bool = False):
        """`lock`: hold an exclusive lock on the file while it is open (regular files)."""
        self.path = path
        self.written = 0
        if path == "-":
            self._fd = sys.stdout.fileno()
            return
        try:
            self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        except OSError as e:
            raise OSError(f"{path}: cannot open the results file ({e.strerror})") from None
        if lock and _is_regular(path):
            try:
                fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(self._fd)
                raise ResultsFileError(
                    f"{path}: another flover run is writing to it; wait for it to end or choose another --out"
                ) from None

    def write(self, record: dict) -> None:
        data = (json.dumps(record, ensure_ascii=False) + "\n").encode()
        view = memoryview(data)
        try:
            while view:
                view = view[os.write(self._fd, view) :]
        except OSError as e:
            raise OSError(f"{self.path}: cannot write results ({e.strerror})") from None
        self.written += 1

    def close(self) -> None:
        if self.path != "-":
            os.close(self._fd)


def fingerprint(parts: dict) -> dict:
    """What produced a results file: `parts` as given (for the message) and their hash."""
    canonical = json.dumps(parts, sort_keys=True, default=str)
    return {"sha256": hashlib.sha256(canonical.encode()).hexdigest(), "parts": json.loads(canonical)}


def file_sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def open_results(path: str, parts: dict) -> tuple[ResultsFile, set[str]]:
    """Lock `path`, check that its records come from the same inputs (`parts`), drop a torn last
    line; returns the open file and the ids already done. Raises ResultsFileError otherwise."""
    out = ResultsFile(path, lock=True)
    try:
        if path == "-" or not _is_regular(path):
            return out, set()
        done = recover(path)
        mine = fingerprint(parts)
        sidecar = path + ".fingerprint.json"
        if os.path.getsize(path) == 0:
            _write_atomically(sidecar, mine)
            return out, done
        try:
            with open(sidecar) as f:
                theirs = json.load(f)
            if not isinstance(theirs, dict) or not isinstance(theirs.get("parts", {}), dict):
                raise ValueError("not a fingerprint")
        except (OSError, ValueError, RecursionError):
            raise ResultsFileError(
                f"{path}: holds results but not what produced them ({sidecar} is missing or "
                f"unreadable); choose another --out"
            ) from None
        if theirs.get("sha256") != mine["sha256"]:
            old = theirs.get("parts", {})
            changed = sorted(k for k in set(old) | set(mine["parts"]) if old.get(k) != mine["parts"].get(k))
            raise ResultsFileError(
                f"{path}: its results come from different inputs (changed: {', '.join(changed)}); "
                f"resuming would mix them: choose another --out"
            )
        return out, done
    except BaseException:
        out.close()
        raise


def _write_atomically(path: str, obj: dict) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
    os.replace(tmp, path)


MAX_HELD = 1024  # finished records an ordered run keeps behind a running earlier one


class OrderedWriter:
    """Writes records in input order. A finished record waits only while an earlier record is
    still running; it is written (and forgotten) as soon as that one is. Once `max_held` wait,
    the runner admits no new prompt (`full`) until the earlier one ends: memory stays bounded,
    and a killed run loses at most that many finished records (resume runs them again)."""

    def __init__(self, out: ResultsFile, max_held: int = MAX_HELD):
        self.out, self.max_held = out, max_held
        self._order: deque[int] = deque()  # indices submitted, not yet written, in input order
        self._ready: dict[int, dict] = {}

    def expect(self, index: int) -> None:
        self._order.append(index)

    def write(self, index: int, record: dict | None) -> None:
        """`record` None: the prompt ended without a record (a transient failure)."""
        self._ready[index] = record
        while self._order and self._order[0] in self._ready:
            ready = self._ready.pop(self._order.popleft())
            if ready is not None:
                self.out.write(ready)

    @property
    def held(self) -> int:
        return len(self._ready)

    @property
    def full(self) -> bool:
        return len(self._ready) >= self.max_held


class UnorderedWriter:
    full = False

    def __init__(self, out: ResultsFile):
        self.out = out
        self.held = 0

    def expect(self, index: int) -> None:
        pass

    def write(self, index: int, record: dict | None) -> None:
        if record is not None:
            self.out.write(record)
