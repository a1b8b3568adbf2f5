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
import threading
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
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
    done: bool = False  # its work ended (set by the worker thread)


class FairWorker:
    """A worker pool shared fairly by connections (round robin over their queues): the daemon's
    tokenizing, chat-rendering and grammar-compiling lanes each are one. A worker thread takes its
    next job itself as soon as one ends, so jobs go on while the loop runs an iteration (taking one
    per loop turn gave a fused iteration one text input each: 300 iterations for 300 inputs)."""

    def __init__(self, work: Callable[[Any], Any], workers: int = 1):
        self.work, self.workers = work, workers
        self.pool = ThreadPoolExecutor(
            max_workers=workers, thread_name_prefix="flover-tokenize", initializer=background_thread
        )
        self._lock = threading.Lock()  # the queues below are shared with the worker threads
        self.waiting: dict[bytes, deque[Job]] = {}
        self.served: dict[bytes, int] = {}  # connection -> the turn it last had (its jobs wait -> kept)
        self._turns = itertools.count()
        self.running: list[Job] = []
        self._draining = 0  # worker threads taking jobs
        self.jobs: dict[str, Job] = {}  # engine id -> job, waiting or running
        # A worker that finishes writes a byte here, so that an idle loop's poll wakes up.
        self.wakeup_fd, self._wake = os.pipe()
        os.set_blocking(self.wakeup_fd, False)

    def __len__(self) -> int:
        return len(self.jobs)

    def wanted(self) -> int:
        """Jobs whose request will queue for a slot: a cancelled one is answered and goes, so it
        must not keep a new request out of the queue meanwhile. (`jobs` and the marks change on
        the loop's thread only, which asks this.)"""
        return sum(not job.cancelled for job in self.jobs.values())

    def submit(self, job: Job) -> None:
        with self._lock:
            self.jobs[job.engine_id] = job
            self.waiting.setdefault(job.connection, deque()).append(job)
            if self._draining < self.workers:
                self._draining += 1
                self.pool.submit(self._drain)

    def cancel(self, engine_id: str) -> bool:
        """Its result is not wanted: it finishes (or is dropped) and comes back marked cancelled."""
        job = self.jobs.get(engine_id)
        if job is not None:
            job.cancelled = True
        return job is not None

    def forget_connection(self, connection: bytes) -> None:
        """A gone client: its waiting jobs are dropped, its running ones come back unwanted."""
        with self._lock:
            for job in self.waiting.pop(connection, ()):
                del self.jobs[job.engine_id]
            self.served.pop(connection, None)
            for job in self.running:
                if job.connection == connection:
                    job.cancelled = True

    def finished(self) -> list[Job]:
        """Jobs whose work ended (in the order they ended)."""
        while True:
            try:
                if not os.read(self.wakeup_fd, 4096):
                    break
            except BlockingIOError:
                break
        with self._lock:
            done = [job for job in self.running if job.done]
            for job in done:
                self.running.remove(job)
                del self.jobs[job.engine_id]
        return done

    def _drain(self) -> None:
        """A worker thread: the next job, fairly chosen, until none waits."""
        while True:
            with self._lock:
                job = self._next_job()
                if job is None:
                    self._draining -= 1
                    return
            try:
                job.result = self.work(job.payload)
            except Exception as e:  # the request's own problem (too long, a template's refusal, ...)
                job.error = e
            except BaseException as e:  # (a library's panic): still that request's, never a lost worker
                job.error = RuntimeError(f"{type(e).__name__}: {e}")
            finally:
                job.done = True
                os.write(self._wake, b".")

    def _next_job(self) -> Job | None:
        """(Under the lock.) From the connection served longest ago; now running."""
        if not self.waiting:
            return None
        connection = min(self.waiting, key=lambda c: self.served.get(c, -1))
        queue = self.waiting[connection]
        job = queue.popleft()
        if not queue:
            del self.waiting[connection]
        self.served[connection] = next(self._turns)
        if len(self.served) > 4096:  # bounded: connections with nothing waiting start afresh
            self.served = {c: t for c, t in self.served.items() if c in self.waiting or c == connection}
        self.running.append(job)
        return job

    def close(self) -> None:
        with self._lock:
            self.waiting.clear()
        self.pool.shutdown(wait=True, cancel_futures=True)
        os.close(self.wakeup_fd)
        os.close(self._wake)
