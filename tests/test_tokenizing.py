"""The daemon's tokenizer queue: off the loop, connections take turns, errors and cancels come back."""

from __future__ import annotations

import select
import threading
import time

from flover.server.tokenizing import FairWorker, Job


def collect(tok: FairWorker, count: int, timeout: float = 10.0) -> list[Job]:
    done: list[Job] = []
    deadline = time.monotonic() + timeout
    while len(done) < count and time.monotonic() < deadline:
        select.select([tok.wakeup_fd], [], [], 0.1)  # the loop's poll: woken when a job ends
        done += tok.finished()
    return done


def test_connections_take_turns_and_one_pile_delays_another_by_one_job():
    order, gate = [], threading.Event()

    def work(payload):
        gate.wait(10)
        order.append(payload)
        return payload.upper()

    tok = FairWorker(work, workers=1)
    for i in range(5):
        tok.submit(Job(b"A", f"a{i}", f"a{i}"))
    tok.submit(Job(b"B", "b0", "b0"))
    tok.submit(Job(b"C", "c0", "c0"))
    assert len(tok) == 7
    gate.set()
    done = collect(tok, 7)
    assert order == ["a0", "b0", "c0", "a1", "a2", "a3", "a4"]
    assert [j.result for j in done] == [p.upper() for p in order] and len(tok) == 0
    tok.close()


def test_a_job_that_raises_past_exception_is_its_error_and_the_worker_goes_on():
    """A library's panic (pyo3's PanicException is a BaseException) ends that job with an error;
    the worker thread lives on to take the next one."""

    class Panic(BaseException):
        pass

    def work(payload):
        if payload == "panics":
            raise Panic("index out of bounds")
        return payload

    tok = FairWorker(work, workers=1)
    tok.submit(Job(b"A", "1", "panics"))
    tok.submit(Job(b"A", "2", "fine"))
    done = {j.engine_id: j for j in collect(tok, 2)}
    assert isinstance(done["1"].error, RuntimeError) and "index out of bounds" in str(done["1"].error)
    assert done["2"].result == "fine" and done["2"].error is None
    tok.submit(Job(b"A", "3", "again"))
    assert [j.result for j in collect(tok, 1)] == ["again"]
    tok.close()


def test_errors_cancels_and_gone_connections():
    gate = threading.Event()

    def work(payload):
        gate.wait(10)
        if payload == "bad":
            raise ValueError("the template refused")
        return payload

    tok = FairWorker(work, workers=1)
    tok.submit(Job(b"A", "1", "bad"))
    tok.submit(Job(b"A", "2", "ok"))
    tok.submit(Job(b"B", "3", "gone"))
    tok.submit(Job(b"B", "4", "gone too"))
    assert tok.cancel("2") and not tok.cancel("nope")
    tok.forget_connection(b"B")  # its waiting jobs are dropped
    gate.set()
    done = {j.engine_id: j for j in collect(tok, 2)}
    assert set(done) == {"1", "2"} and len(tok) == 0
    assert isinstance(done["1"].error, ValueError) and done["1"].result is None
    assert done["2"].cancelled and done["2"].result == "ok"
    tok.close()


def test_the_worker_goes_on_to_the_next_job_while_the_loop_is_busy():
    """The loop collects results between iterations; meanwhile the worker must not wait for it to
    start the next job (it did: a fused iteration then got one text input each)."""
    tok = FairWorker(lambda payload: payload * 2, workers=1)
    for i in range(20):
        tok.submit(Job(bytes([i % 3]), str(i), i))
    deadline = time.monotonic() + 10
    while sum(job.done for job in tok.jobs.values()) < 20 and time.monotonic() < deadline:
        time.sleep(0.01)  # (the loop inside an iteration: finished() is not called)
    done = tok.finished()
    assert len(done) == 20 and sorted(j.result for j in done) == [2 * i for i in range(20)] and len(tok) == 0
    tok.close()


def test_cancelled_jobs_stop_counting_as_wanted_at_once():
    """The daemon's queue bound counts `wanted()`: a request cancelled while its prompt waits to be
    tokenized (a nice-19 thread on a busy machine can wait long) must free its place at once, or a
    new request is refused `overloaded` with nothing left waiting (it was, in CI)."""
    gate = threading.Event()
    tok = FairWorker(lambda payload: gate.wait(10) and payload, workers=1)
    for i in range(4):
        tok.submit(Job(b"A", str(i), i))
    tok.submit(Job(b"B", "b", "b"))
    assert tok.wanted() == len(tok) == 5
    assert tok.cancel("1") and tok.cancel("2") and tok.cancel("2")  # (twice counts once)
    assert tok.wanted() == 3 and len(tok) == 5  # still to be answered: the loop collects them
    tok.forget_connection(b"B")
    assert tok.wanted() == 2 and len(tok) == 4
    gate.set()
    done = collect(tok, 4)
    assert sorted(j.engine_id for j in done if j.cancelled) == ["1", "2"]
    assert tok.wanted() == len(tok) == 0
    tok.close()
