"""The JSONL results file: append-only, one complete line per write, resumable.

A process killed at any moment (SIGKILL included) leaves whole lines plus at most one torn last
line; `recover` drops that torn line and returns the ids already done, so that re-running the
same command writes every missing record exactly once.
"""

from __future__ import annotations

import json
import os
import sys
from collections import deque


class ResultsFileError(ValueError):
    pass


def recover(path: str) -> set[str]:
    """Ids of the complete records in `path`; truncates a torn last line. Missing file: empty."""
    if path == "-" or not os.path.exists(path):
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
                    raise ResultsFileError(f"{path}: line {number} is not a result record; "
                                           f"fix or move the file before resuming") from None
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

    def __init__(self, path: str):
        self.path = path
        self._fd = sys.stdout.fileno() if path == "-" else os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self.written = 0

    def write(self, record: dict) -> None:
        data = (json.dumps(record, ensure_ascii=False) + "\n").encode()
        view = memoryview(data)
        while view:
            view = view[os.write(self._fd, view):]
        self.written += 1

    def close(self) -> None:
        if self.path != "-":
            os.close(self._fd)


class OrderedWriter:
    """Writes records in input order. A finished record waits only while an earlier record is
    still running; it is written (and forgotten) as soon as that one is."""

    def __init__(self, out: ResultsFile):
        self.out = out
        self._order: deque[int] = deque()  # indices submitted, not yet written, in input order
        self._ready: dict[int, dict] = {}

    def expect(self, index: int) -> None:
        self._order.append(index)

    def write(self, index: int, record: dict) -> None:
        self._ready[index] = record
        while self._order and self._order[0] in self._ready:
            self.out.write(self._ready.pop(self._order.popleft()))

    @property
    def held(self) -> int:
        return len(self._ready)


class UnorderedWriter:
    def __init__(self, out: ResultsFile):
        self.out = out
        self.held = 0

    def expect(self, index: int) -> None:
        pass

    def write(self, index: int, record: dict) -> None:
        self.out.write(record)
