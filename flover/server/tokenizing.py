"""Tokenizing and chat rendering for the daemon, off its loop and fair between connections.

A text prompt costs tokenizer time in proportion to its length (up to ~1 s for one that just
fits a 2k context), a chat its template's rendering too. Done on the engine loop, that time is a
gap in every running stream. Here it runs in worker threads (`tokenizers` releases the GIL), and
connections take turns: a connection's jobs wait in its own queue, and the next job always comes
from the connection that was served longest ago, so one client's pile of long prompts delays
another client's prompt by at most one job per worker.
"""

from __future__ import annotations

import itertools
import os
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable

from flover.hardware import background_thread


@dataclass
class Job:
    connection: bytes  # whose turn it takes
    engine_id: str
    payload: Any  # what `work` gets (the parsed request)
    result: Any = None  # what `work` returned ...
    error: BaseException | None = None  # ... or raised
    cancelled: bool = False  # its client cancelled it while it waited or ran
    future: Future | None = field(default=None, repr=False)


class FairWorker:
    """A worker pool shared fairly by connections (round robin over their queues): the daemon's
    tokenizing, chat-rendering and grammar-compiling lanes each are one."""

    def __init__(self, work: Callable[[Any], Any], workers: int = 1):
        self.work, self.workers = work, workers
        self.pool = ThreadPoolExecutor(
            max_workers=workers, thread_name_prefix="flover-tokenize", initializer=background_thread
        )
        self.waiting: dict[bytes, deque[Job]] = {}
        self.served: dict[bytes, int] = {}  # connection -> the turn it last had (its jobs wait -> kept)
        self._turns = itertools.count()
        self.running: list[Job] = []
        self.jobs: dict[str, Job] = {}  # engine id -> job, waiting or running
        # A worker that finishes writes a byte here, so that an idle loop's poll wakes up.
        self.wakeup_fd, self._wake = os.pipe()
        os.set_blocking(self.wakeup_fd, False)

    def __len__(self) -> int:
        return len(self.jobs)

    def submit(self, job: Job) -> None:
        self.jobs[job.engine_id] = job
        self.waiting.setdefault(job.connection, deque()).append(job)
        self._start()

    def cancel(self, engine_id: str) -> bool:
        """Its result is not wanted: it finishes (or is dropped) and comes back marked cancelled."""
        job = self.jobs.get(engine_id)
        if job is not None:
            job.cancelled = True
        return job is not None

    def forget_connection(self, connection: bytes) -> None:
        """A gone client: its waiting jobs are dropped, its running ones come back unwanted."""
        for job in self.waiting.pop(connection, ()):
            del self.jobs[job.engine_id]
        self.served.pop(connection, None)
        for job in self.running:
            if job.connection == connection:
                job.cancelled = True

    def finished(self) -> list[Job]:
        """Jobs whose work ended (in the order they ended), and the next ones started."""
        while True:
            try:
                if not os.read(self.wakeup_fd, 4096):
                    break
            except BlockingIOError:
                break
        done = [job for job in self.running if job.future.done()]
        for job in done:
            self.running.remove(job)
            del self.jobs[job.engine_id]
            try:
                job.result = job.future.result()
            except Exception as e:  # the request's own problem (too long, a template's refusal, ...)
                job.error = e
        self._start()
        return done

    def _start(self) -> None:
        while len(self.running) < self.workers and self.waiting:
            connection = min(self.waiting, key=lambda c: self.served.get(c, -1))  # served longest ago
            queue = self.waiting[connection]
            job = queue.popleft()
            if not queue:
                del self.waiting[connection]
            self.served[connection] = next(self._turns)
            if len(self.served) > 4096:  # bounded: connections with nothing waiting start afresh
                self.served = {c: t for c, t in self.served.items() if c in self.waiting or c == connection}
            job.future = self.pool.submit(self.work, job.payload)
            job.future.add_done_callback(lambda _: os.write(self._wake, b"."))
            self.running.append(job)

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)
        os.close(self.wakeup_fd)
        os.close(self._wake)
