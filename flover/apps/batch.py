"""Prompt-file processing: every prompt of a file through the temporal-fusion engine.

The engine is kept full: a prompt joins as soon as a slot frees (or, with an arrival schedule,
as soon as it "arrives"), and each result is appended to the output the moment it finishes.
Re-running the same command resumes: ids already in the output are skipped.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Iterable, Iterator

from flover.apps.prompt_file import EMBED_KEYS, PromptRecord
from flover.apps.results_file import MAX_HELD, OrderedWriter, ResultsFile, UnorderedWriter
from flover.client import FloverError, embed_message
from flover.config import SamplingParams
from flover.engine.intake import PromptTooLong
from flover.engine.interface import ServingEngine
from flover.protocol import PERMANENT
from flover.request import EmbedParams, Request, RequestInput, RequestOutput

log = logging.getLogger(__name__)


def arrival_offsets(
    arrival: str | None, rate: float | None = None, interval_ms: float | None = None, seed: int = 0
) -> Iterator[float] | None:
    """Seconds after the start at which each successive prompt arrives; None: no schedule (a
    prompt arrives when the engine has room for it)."""
    if arrival in (None, "none"):
        return None
    if arrival == "interval":
        return (i * interval_ms / 1000 for i in itertools.count())
    if arrival == "poisson":
        return _poisson(rate, seed)
    raise ValueError(f"unknown arrival schedule {arrival!r} (none, interval, poisson)")


def _poisson(rate: float, seed: int) -> Iterator[float]:
    rng, t = random.Random(seed), 0.0
    while True:
        yield t
        t += rng.expovariate(rate)


@dataclass
class BatchSummary:
    prompts: int = 0  # records in the input
    skipped: int = 0  # already in the output (resumed)
    completed: int = 0
    errors: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    wall_s: float = 0.0
    iterations: int = 0
    finish_reasons: dict = field(default_factory=dict)
    incomplete: dict = field(default_factory=dict)  # why -> prompts that ended without a record (retried on resume)
    stopped: str | None = None  # why the run stopped before every prompt was sent
    stage_busy: list[float] | None = None  # pipeline stages: each one's share of the run's time at work

    @property
    def not_done(self) -> int:
        return self.prompts - self.skipped - self.completed - self.errors

    @property
    def tokens_per_s(self) -> float:
        return self.completion_tokens / self.wall_s if self.wall_s else 0.0

    def line(self) -> str:
        return (
            f"{self.prompts} prompts: {self.completed} completed, {self.errors} errors, {self.skipped} already "
            f"done; {self.prompt_tokens} tokens in, {self.completion_tokens} out in {self.wall_s:.1f} s "
            f"({self.tokens_per_s:.1f} tok/s, {self.iterations} iterations"
            + (f"; pipeline stages busy {' / '.join(f'{b:.0%}' for b in self.stage_busy)}" if self.stage_busy else "")
            + ")"
        )

    def count_incomplete(self, why: str) -> None:
        self.incomplete[why] = self.incomplete.get(why, 0) + 1

    def incomplete_line(self) -> str | None:
        """None when every prompt has its record."""
        if self.not_done <= 0:
            return None
        reasons = ", ".join(f"{n} {why}" for why, n in sorted(self.incomplete.items()))
        stopped = f"; stopped: {self.stopped}" if self.stopped else ""
        return (
            f"incomplete: {self.not_done} prompt(s) have no record ({reasons or 'not sent'}{stopped}); "
            f"re-run the same command to retry them"
        )


class Progress:
    """tqdm bar on a terminal; a plain log line every `interval` seconds otherwise."""

    def __init__(self, total: int, enabled: bool = True, interval: float = 10.0):
        self.total, self.done, self.interval = total, 0, interval
        self.bar = None
        self._last = time.perf_counter()
        self._start = self._last
        self.enabled = enabled
        if enabled and sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total, unit="prompt", file=sys.stderr, dynamic_ncols=True)

    def update(self, finished: int, tokens: int, in_flight: int) -> None:
        if not self.enabled:
            return
        self.done += finished
        elapsed = time.perf_counter() - self._start
        rate = tokens / elapsed if elapsed > 0 else 0.0
        if self.bar is not None:
            if finished:
                self.bar.update(finished)
            self.bar.set_postfix({"tok/s": f"{rate:.0f}", "in flight": in_flight}, refresh=False)
        elif time.perf_counter() - self._last >= self.interval:
            self._last = time.perf_counter()
            log.info("%d/%d prompts done, %.0f tok/s, %d in flight", self.done, self.total, rate, in_flight)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


LOGPROB_FIELDS = ("logprobs", "top_logprobs", "prompt_logprobs", "prompt_top_logprobs")  # when asked


def embedding_record(request_id: str, vector: list[float], prompt_tokens: int, queue_s, e2e_s) -> dict:
    """An embedding input's record (`flover run --embed`), locally or through a daemon."""
    return {
        "id": request_id,
        "embedding": vector,
        "usage": {"prompt_tokens": prompt_tokens},
        "latency": {"queue_s": queue_s, "e2e_s": e2e_s},
    }


def result_record(out: RequestOutput, with_token_ids: bool) -> dict:
    t = out.timings
    if out.embedding is not None:
        return embedding_record(out.request_id, out.embedding, len(out.prompt_token_ids), t["queue_time"], t["e2e"])
    record = {
        "id": out.request_id,
        "text": out.text,
        "finish_reason": out.finish_reason,
        "usage": out.usage,
        "latency": {"queue_s": t["queue_time"], "ttft_s": t["ttft"], "tpot_s": t["tpot"], "e2e_s": t["e2e"]},
    }
    if with_token_ids:
        record["token_ids"] = out.token_ids
    for key in LOGPROB_FIELDS:
        if getattr(out, key) is not None:
            record[key] = getattr(out, key)
    return record


def check_kind(record: PromptRecord, embedding: bool) -> None:
    """A record's fields against the run's kind (`flover run --embed` or not); ValueError if they clash."""
    if embedding and (record.messages is not None or record.sampling):
        raise ValueError("with --embed a line is an input (prompt or input_ids): no messages or sampling fields")
    if not embedding and record.embed_options:
        raise ValueError(f"{', '.join(sorted(record.embed_options))} go with flover run --embed")


def error_record(record: PromptRecord, code: str, message: str) -> dict:
    return {"id": record.id, "finish_reason": "error", "line": record.line, "error": {"code": code, "message": message}}


class BatchRunner:
    """Feeds records into an engine as they arrive and slots free, writes results as they finish."""

    def __init__(
        self,
        engine: ServingEngine,
        out: ResultsFile,
        defaults: SamplingParams,
        *,
        ordered: bool = False,
        token_ids: bool = False,
        max_waiting: int | None = None,
        progress: Progress | None = None,
        on_step=None,
        max_held: int = MAX_HELD,
        embed: EmbedParams | None = None,
    ):
        """`max_held` (ordered): finished records kept behind a running earlier one, at most.
        `embed`: every record is an embedding input, with these defaults (`flover run --embed`)."""
        self.engine, self.embed = engine, embed
        self.writer = OrderedWriter(out, max_held) if ordered else UnorderedWriter(out)
        self.defaults = defaults
        self.token_ids = token_ids
        # A few requests queue in the engine so a freed slot is refilled at the very next iteration.
        self.max_waiting = max_waiting if max_waiting is not None else engine.config.max_slots
        self.progress = progress or Progress(0, enabled=False)
        self.on_step = on_step  # called after every iteration with (runner, outputs); for live views
        self.summary = BatchSummary()
        self.arrived = 0
        self._records: dict[str, PromptRecord] = {}  # request id -> its record, while in flight

    def run(self, records: Iterable[PromptRecord], offsets: Iterator[float] | None = None) -> BatchSummary:
        """Latencies count from each prompt's scheduled arrival when `offsets` is given, else from
        the moment the engine had room for it."""
        engine, start = self.engine, time.perf_counter()
        pipeline = engine.stats().pipeline
        busy_before = pipeline["busy_s"] if pipeline else None
        todo = iter(records)
        scheduled = offsets is not None
        offsets = offsets if scheduled else itertools.repeat(0.0)
        nxt, due = next(todo, None), next(offsets)
        while nxt is not None or engine.has_unfinished():
            now = time.perf_counter() - start
            while nxt is not None and due <= now and engine.can_accept(self.max_waiting) and not self.writer.full:
                self._submit(nxt, arrival_time=start + due if scheduled else None)
                nxt, due = next(todo, None), next(offsets)
            if not engine.has_unfinished():
                if nxt is not None and due > now:
                    time.sleep(due - now)  # idle until the next arrival
                continue
            iterations = engine.iterations
            outputs = engine.step()
            self.summary.iterations += engine.iterations - iterations  # (with groups: every group's)
            finished = 0
            for out in outputs:
                if out.finished:
                    self._finish(out)
                    finished += 1
            self.progress.update(finished, self.summary.completion_tokens, engine.num_in_flight)
            if self.on_step is not None:
                self.on_step(self, outputs)
        self.summary.wall_s = time.perf_counter() - start
        if busy_before is not None:
            busy = engine.stats().pipeline["busy_s"]
            self.summary.stage_busy = [(b - a) / self.summary.wall_s for a, b in zip(busy_before, busy)]
        self.progress.close()
        return self.summary

    def _submit(self, record: PromptRecord, arrival_time: float | None) -> None:
        self.arrived += 1
        self.writer.expect(record.index)
        if record.error is not None:
            return self._fail(record, record.code or "malformed_line", record.error)
        try:
            request = self._request(record, arrival_time)
        except PromptTooLong as e:
            return self._fail(record, "prompt_too_long", f"line {record.line}: {e}")
        except (ValueError, TypeError) as e:
            return self._fail(record, "invalid_request", f"line {record.line}: {e}")
        self._records[record.id] = record
        self.engine.enqueue(request)
        self.summary.prompt_tokens += len(request.prompt_token_ids)

    def _request(self, record: PromptRecord, arrival_time: float | None) -> Request:
        """The record's request, made (not queued); ValueError naming what is wrong with it."""
        check_kind(record, self.embed is not None)
        if self.embed is not None:
            embed = dataclasses.replace(self.embed, **record.embed_options)
            return self.engine.make_request(
                RequestInput(record.prompt, request_id=record.id, arrival_time=arrival_time, embed=embed)
            )
        params = self.defaults.with_updates(**record.sampling) if record.sampling else self.defaults
        tokenized = (
            self.engine.tokenize(None, record.messages, template_kwargs=record.template_kwargs)
            if record.template_kwargs
            else None
        )
        return self.engine.make_request(
            RequestInput(
                record.prompt,
                params,
                request_id=record.id,
                arrival_time=arrival_time,
                messages=record.messages,
                tokenized=tokenized,
            )
        )

    def _fail(self, record: PromptRecord, code: str, message: str) -> None:
        log.warning("%s", message)
        self.summary.errors += 1
        self.writer.write(record.index, error_record(record, code, message))
        self.progress.update(1, self.summary.completion_tokens, self.engine.num_in_flight)

    def _finish(self, out: RequestOutput) -> None:
        s = self.summary
        record = self._records.pop(out.request_id)
        if out.finish_reason == "error":  # a failure inside the engine: retried on resume, not recorded
            log.warning("line %d (id %s): %s; no record written", record.line, record.id, out.error)
            s.count_incomplete("internal_error")
            self.writer.write(record.index, None)
            return
        s.completed += 1
        s.completion_tokens += len(out.token_ids)
        s.finish_reasons[out.finish_reason] = s.finish_reasons.get(out.finish_reason, 0) + 1
        self.writer.write(record.index, result_record(out, self.token_ids))


def remote_result_record(event: dict, with_token_ids: bool) -> dict:
    if "embedding" in event:
        t, tokens = event["timings"], event["usage"]["prompt_tokens"]
        return embedding_record(event["id"], event["embedding"], tokens, t["queue_s"], t["e2e_s"])
    record = {
        "id": event["id"],
        "text": event.get("text"),
        "finish_reason": event["finish_reason"],
        "usage": event["usage"],
        "latency": event["timings"],
    }
    if with_token_ids:
        record["token_ids"] = event.get("token_ids")
    record.update({key: event[key] for key in LOGPROB_FIELDS if key in event})
    return record


class RemoteBatchRunner:
    """`flover run --connect`: the same file handling, with a running `flover serve` as the engine.
    Up to `max_in_flight` requests are outstanding; `overloaded` replies are retried. Every prompt
    ends with a record, or the run stops (the server shuts down, the connection is lost, nothing
    is heard for `timeout` seconds) and the prompts without a record are left for a resume."""

    def __init__(
        self,
        client,
        out: ResultsFile,
        defaults: SamplingParams,
        *,
        ordered: bool = False,
        token_ids: bool = False,
        max_in_flight: int = 64,
        progress: Progress | None = None,
        timeout: float | None = None,
        embed: EmbedParams | None = None,
    ):
        self.client, self.token_ids, self.embed = client, token_ids, embed
        self.writer = OrderedWriter(out) if ordered else UnorderedWriter(out)
        self.max_in_flight = max_in_flight
        self.progress = progress or Progress(0, enabled=False)
        self.timeout = timeout
        self.summary = BatchSummary()
        self._base = asdict(defaults)

    def run(self, records: Iterable[PromptRecord], offsets: Iterator[float] | None = None) -> BatchSummary:
        start = time.perf_counter()
        todo = iter(records)
        offsets = offsets if offsets is not None else itertools.repeat(0.0)
        nxt, due = next(todo, None), next(offsets)
        in_flight: dict[str, PromptRecord] = {}
        retry: list[tuple[float, PromptRecord]] = []
        s = self.summary
        while (nxt is not None or retry) and s.stopped is None or in_flight:
            now = time.perf_counter() - start
            while s.stopped is None and retry and retry[0][0] <= now and len(in_flight) < self.max_in_flight:
                self._send(retry.pop(0)[1], in_flight)
            while (
                s.stopped is None
                and nxt is not None
                and due <= now
                and len(in_flight) < self.max_in_flight
                and not self.writer.full
            ):
                self.writer.expect(nxt.index)
                if nxt.error is not None:
                    self._fail(nxt, nxt.code or "malformed_line", nxt.error)
                else:
                    self._send(nxt, in_flight)
                nxt, due = next(todo, None), next(offsets)
            if not in_flight:
                waits = [t for t, _ in retry[:1]] + ([due] if nxt is not None else [])
                if waits and s.stopped is None:
                    time.sleep(max(0.0, min(waits) - (time.perf_counter() - start)))
                continue
            event = self.client.next_any(timeout=0.05)
            if event is None:
                self._check_alive(in_flight)
                continue
            record = in_flight.pop(event.get("id"), None)
            if record is not None:
                self._handle(event, record, in_flight, retry, time.perf_counter() - start)
        for _, record in retry:  # stopped while they waited to be sent again: no record, released in order
            s.count_incomplete("overloaded")
            self.writer.write(record.index, None)
        s.wall_s = time.perf_counter() - start
        self.progress.close()
        return s

    def _handle(self, event: dict, record: PromptRecord, in_flight: dict, retry: list, now: float) -> None:
        s = self.summary
        if event["event"] == "final" and event["finish_reason"] in ("stop", "length"):
            s.completed += 1
            s.prompt_tokens += event["usage"]["prompt_tokens"]
            s.completion_tokens += event["usage"].get("completion_tokens", 0)
            self.writer.write(record.index, remote_result_record(event, self.token_ids))
            self.progress.update(1, s.completion_tokens, len(in_flight))
        elif event["event"] == "error" and event["code"] == "overloaded":
            retry.append((now + 0.2, record))
        elif event["event"] == "error" and event["code"] in PERMANENT:
            self._fail(record, event["code"], f"line {record.line}: {event['message']}")
        else:  # cancelled, shutting_down, internal_error, slow_client, connection_lost, ...: no record
            why = event.get("code") or event.get("finish_reason")
            log.warning("line %d (id %s): %s; no record written", record.line, record.id, event.get("message") or why)
            s.count_incomplete(why)
            self.writer.write(record.index, None)
            if why in ("shutting_down", "connection_lost", "handshake_failed") and s.stopped is None:
                s.stopped = event.get("message") or why

    def _check_alive(self, in_flight: dict) -> None:
        """Nothing heard (not even a keepalive) for `timeout` seconds: give up on what is in flight."""
        if self.timeout is None or time.monotonic() - self.client.last_heard < self.timeout:
            return
        for record in list(in_flight.values()):
            self.summary.count_incomplete("timeout")
            self.writer.write(record.index, None)
        in_flight.clear()
        self.summary.stopped = f"no reply from the server for {self.timeout:g} s"

    def _send(self, record: PromptRecord, in_flight: dict) -> None:
        try:
            check_kind(record, self.embed is not None)
        except ValueError as e:
            return self._fail(record, "invalid_request", f"line {record.line}: {e}")
        try:
            self.client.send(self._message(record))
        except FloverError as e:  # too large to send: a property of the prompt
            return self._fail(record, e.code, f"line {record.line}: {e.message}")
        in_flight[record.id] = record

    def _message(self, record: PromptRecord) -> dict:
        """The record as the daemon's embed op (`--embed`) or generate op."""
        if self.embed is not None:
            options = {**asdict(self.embed), **record.embed_options}  # (the op's own fields: EMBED_KEYS)
            return embed_message(
                record.id, record.prompt, **{k: options[k] for k in EMBED_KEYS if options[k] is not None}
            )
        message = {"op": "generate", "id": record.id, "stream": False, "params": {**self._base, **record.sampling}}
        if record.messages is not None:
            message["messages"] = record.messages
            if record.template_kwargs:
                message["chat_template_kwargs"] = record.template_kwargs
        elif isinstance(record.prompt, str):
            message["prompt"] = record.prompt
        else:
            message["input_ids"] = record.prompt
        return message

    def _fail(self, record: PromptRecord, code: str, message: str) -> None:
        log.warning("%s", message)
        self.summary.errors += 1
        self.writer.write(record.index, error_record(record, code, message))
        self.progress.update(1, self.summary.completion_tokens, 0)
