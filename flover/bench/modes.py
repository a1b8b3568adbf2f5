"""The serving modes a workload runs through, all with the same model, threads and workload.

fused      flover's temporal fusion: a request joins the running batch at the next iteration.
serial     request-level scheduling: one request at a time in arrival order (FasterTransformer-style).
window     dynamic batching: wait up to W ms or until B requests, run that batch to completion.
instances  K model instances (processes), each serving one request at a time.
hf         transformers' own serving path: its continuous-batching manager, requests added as they
           arrive; where that cannot start, batched `generate` per dynamic-batching window (the
           run's note says which).

Every mode returns a RunTrace: per request its arrival, start and the time of every token, all in
seconds since the start of the run.
"""

from __future__ import annotations

import multiprocessing as mp
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from flover.bench.workload import BenchRequest
from flover.config import EngineConfig, SamplingParams, default_num_threads
from flover.engine.engine import Engine
from flover.request import RequestInput

MODES = ("fused", "serial", "window", "instances", "hf")


@dataclass
class RequestTrace:
    id: str
    arrival: float
    prompt_len: int
    new_tokens: int
    start: float | None = None  # processing began (first iteration that computed it)
    token_times: list[float] = field(default_factory=list)


@dataclass
class RunTrace:
    mode: str
    requests: list[RequestTrace]
    iterations: int = 0
    # (end time, requests in flight, duration, tokens in the token matrix) per engine iteration
    iteration_log: list[tuple[float, int, float, int]] = field(default_factory=list)
    shuffle_moves: int = 0
    shuffle_s: float = 0.0
    note: str = ""
    kernels: str = ""  # the native step's kernel family ("": PyTorch, or not flover's engine)


@dataclass(frozen=True)
class ModeSettings:
    model: str
    dtype: str = "float32"
    threads: int | None = None
    max_slots: int = 32
    max_seq_len: int | None = None  # None: the engine default (model limit, <= 2048)
    window_ms: float = 500.0
    window_batch: int = 32
    instances: int = 2


def _traces(reqs: list[BenchRequest]) -> dict[str, RequestTrace]:
    return {r.id: RequestTrace(r.id, r.arrival_s, len(r.prompt_ids), r.new_tokens) for r in reqs}


def _step_and_record(engine, trace: RunTrace, by_id: dict, t0: float) -> list[str]:
    """One iteration, its time and rows logged, each request's tokens timed; the finished ids."""
    started = time.perf_counter()
    outputs = engine.step()
    end = time.perf_counter() - t0
    rows = engine.num_running + sum(o.finished for o in outputs)
    trace.iteration_log.append((end, rows, time.perf_counter() - started, engine.last_step_tokens))
    for out in outputs:
        t = by_id[out.request_id]
        if t.start is None and out.timings["queue_time"] is not None:
            t.start = t.arrival + out.timings["queue_time"]
        t.token_times += [end] * len(out.new_token_ids)
    return [out.request_id for out in outputs if out.finished]


def run_engine_mode(mode: str, reqs: list[BenchRequest], s: ModeSettings) -> RunTrace:
    """fused, serial (the same engine with one slot) and window, on flover's engine."""
    slots = 1 if mode == "serial" else s.max_slots
    engine = Engine(
        EngineConfig(
            s.model,
            dtype=s.dtype,
            max_slots=slots,
            max_seq_len=s.max_seq_len,
            num_threads=s.threads,
            max_batch_tokens=max(512, slots),
        )
    )
    _warm_up(engine)
    trace = RunTrace(mode, list(_traces(reqs).values()))
    by_id = {t.id: t for t in trace.requests}
    before = engine.stats()  # after the warm-up
    pending = deque(sorted(reqs, key=lambda r: r.arrival_s))
    held: list[BenchRequest] = []  # window mode: arrived, waiting for the window to close
    running_batch: set[str] = set()
    t0 = time.perf_counter()

    def submit(r: BenchRequest) -> None:  # latencies count from the scheduled arrival
        params = SamplingParams(max_new_tokens=r.new_tokens, ignore_eos=True)
        engine.enqueue(engine.make_request(RequestInput(r.prompt_ids, params, r.id, arrival_time=t0 + r.arrival_s)))

    while pending or held or engine.has_unfinished():
        now = time.perf_counter() - t0
        while pending and pending[0].arrival_s <= now:
            r = pending.popleft()
            if mode == "window":
                held.append(r)
            else:
                submit(r)
        if mode == "window" and held and not running_batch:
            if len(held) >= s.window_batch or now - held[0].arrival_s >= s.window_ms / 1000:
                batch, held[:] = held[: s.window_batch], held[s.window_batch :]
                for r in batch:
                    submit(r)
                    running_batch.add(r.id)
        if not engine.has_unfinished():
            wake = [pending[0].arrival_s] if pending else []
            if held and not running_batch:
                wake.append(held[0].arrival_s + s.window_ms / 1000)
            if wake:
                time.sleep(max(0.0, min(wake) - (time.perf_counter() - t0)))
            continue
        for finished in _step_and_record(engine, trace, by_id, t0):
            running_batch.discard(finished)
    after = engine.stats()
    trace.iterations = after.iterations - before.iterations
    trace.kernels = after.native_kernels or ""
    trace.shuffle_moves = after.shuffle_moves - before.shuffle_moves  # slot moves of the two-step shuffle ...
    trace.shuffle_s = after.shuffle_seconds - before.shuffle_seconds  # ... and the time their copies took
    return trace


def _warm_up(engine: Engine) -> None:
    engine.add_request([1, 2, 3], SamplingParams(max_new_tokens=2, ignore_eos=True), "warm-up")
    while engine.has_unfinished():
        engine.step()


# -- instances: K processes, one request at a time each ---------------------------------------
def _instance_worker(settings: ModeSettings, threads: int, inbox, outbox) -> None:
    engine = Engine(
        EngineConfig(
            settings.model, dtype=settings.dtype, max_slots=1, num_threads=threads, max_seq_len=settings.max_seq_len
        )
    )
    _warm_up(engine)
    outbox.put(("ready", None))
    while (item := inbox.get()) is not None:
        rid, prompt, new_tokens, t0 = item
        start, iterations = time.perf_counter() - t0, engine.iterations
        engine.add_request(prompt, SamplingParams(max_new_tokens=new_tokens, ignore_eos=True), rid)
        times = []
        while engine.has_unfinished():
            for out in engine.step():
                times += [time.perf_counter() - t0] * len(out.new_token_ids)
        outbox.put(("done", (rid, start, times, engine.iterations - iterations)))


def run_instances(reqs: list[BenchRequest], s: ModeSettings) -> RunTrace:
    ctx = mp.get_context("spawn")
    inbox, outbox = ctx.Queue(), ctx.Queue()
    threads = max(1, (s.threads or default_num_threads()) // s.instances)
    workers = [
        ctx.Process(target=_instance_worker, args=(s, threads, inbox, outbox), daemon=True) for _ in range(s.instances)
    ]
    for w in workers:
        w.start()
    try:
        for _ in workers:
            kind, _ = outbox.get(timeout=300)
            assert kind == "ready"
        trace = RunTrace(
            "instances", list(_traces(reqs).values()), note=f"{s.instances} processes x {threads} thread(s)"
        )
        by_id = {t.id: t for t in trace.requests}
        t0 = time.perf_counter()  # CLOCK_MONOTONIC: the workers' perf_counter shares it
        for r in sorted(reqs, key=lambda r: r.arrival_s):
            time.sleep(max(0.0, r.arrival_s - (time.perf_counter() - t0)))
            inbox.put((r.id, r.prompt_ids, r.new_tokens, t0))
        for _ in reqs:
            _, (rid, start, times, iterations) = outbox.get(timeout=3600)
            by_id[rid].start, by_id[rid].token_times = start, times
            trace.iterations += iterations
    finally:
        for _ in workers:
            inbox.put(None)
        for w in workers:
            w.join(timeout=30)
    return trace


# -- transformers -------------------------------------------------------------------------------
def _hf_model(s: ModeSettings):
    import torch
    import transformers

    if s.threads:
        torch.set_num_threads(s.threads)
    dtype = getattr(torch, s.dtype)
    if str(s.model).endswith(".gguf"):  # transformers dequantizes a GGUF file the way flover does
        path = Path(s.model)
        return transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype).eval()
    return transformers.AutoModelForCausalLM.from_pretrained(s.model, dtype=dtype).eval()


def run_hf(reqs: list[BenchRequest], s: ModeSettings) -> RunTrace:
    """transformers' continuous batching if it starts here, else batched generate per window."""
    model = _hf_model(s)
    try:
        from transformers import GenerationConfig
        from transformers.generation.configuration_utils import ContinuousBatchingConfig
    except ImportError as e:
        return run_hf_window(reqs, s, model, reason=f"no continuous batching in this transformers ({e})")
    try:
        return run_hf_continuous(reqs, s, model, GenerationConfig, ContinuousBatchingConfig)
    except Exception as e:  # its manager needs psutil, a cache that fits, ...: fall back, and say so
        return run_hf_window(reqs, s, model, reason=f"continuous batching failed: {e!r}")


def run_hf_continuous(
    reqs: list[BenchRequest], s: ModeSettings, model, GenerationConfig, ContinuousBatchingConfig
) -> RunTrace:
    page = 64
    longest = max(len(r.prompt_ids) + r.new_tokens for r in reqs)
    blocks = (s.max_slots + 1) * -(-longest // page)  # room for every slot at the longest length
    config = ContinuousBatchingConfig(
        num_blocks=blocks,
        page_size=page,
        max_batch_tokens=512,
        max_requests_per_batch=s.max_slots,
        auto_switch_to_flash=False,
    )
    manager = model.init_continuous_batching(
        generation_config=GenerationConfig(do_sample=False, eos_token_id=-1, pad_token_id=0, max_new_tokens=8),
        continuous_batching_config=config,
    )
    manager.start()
    trace = RunTrace(
        "hf",
        list(_traces(reqs).values()),
        note="transformers continuous-batching manager (requests added as they arrive)",
    )
    by_id = {t.id: t for t in trace.requests}
    try:
        manager.add_request([1, 2, 3], request_id="warm-up", max_new_tokens=2, eos_token_id=-1)
        while (r := manager.get_result(timeout=300)) is not None and not r.is_finished():
            pass
        if r is None:
            raise RuntimeError("the manager produced no result")
        pending = deque(sorted(reqs, key=lambda r: r.arrival_s))
        finished = 0
        t0 = time.perf_counter()
        while finished < len(reqs):
            now = time.perf_counter() - t0
            while pending and pending[0].arrival_s <= now:
                q = pending.popleft()
                manager.add_request(
                    q.prompt_ids, request_id=q.id, max_new_tokens=q.new_tokens, record_timestamps=True, eos_token_id=-1
                )
            wait = pending[0].arrival_s - now if pending else 60.0
            result = manager.get_result(timeout=max(0.001, wait))
            if result is not None and result.is_finished() and result.request_id in by_id:
                by_id[result.request_id].token_times = [t - t0 for t in result.timestamps]
                finished += 1
            elif result is None and not pending:
                raise RuntimeError("the continuous-batching manager stopped producing results")
    finally:
        manager.stop(block=True)
    return trace


def run_hf_window(reqs: list[BenchRequest], s: ModeSettings, model, reason: str = "") -> RunTrace:
    import torch
    import transformers

    trace = RunTrace(
        "hf",
        list(_traces(reqs).values()),
        note="transformers batched generate per dynamic-batching window "
        f"({s.window_ms:g} ms / {s.window_batch} requests){'; ' + reason if reason else ''}",
    )
    by_id = {t.id: t for t in trace.requests}
    step_times: list[float] = []

    class StepClock(transformers.LogitsProcessor):  # called once per generated position
        def __call__(self, input_ids, scores):
            step_times.append(time.perf_counter() - t0)
            return scores

    with torch.inference_mode():
        ids = torch.tensor([[1, 2, 3]])
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=2, do_sample=False, pad_token_id=0)
    pending = deque(sorted(reqs, key=lambda r: r.arrival_s))
    t0 = time.perf_counter()
    while pending:
        first = pending[0].arrival_s
        close = first + s.window_ms / 1000
        batch = []
        while pending and len(batch) < s.window_batch:
            now = time.perf_counter() - t0
            if pending[0].arrival_s <= now:
                batch.append(pending.popleft())
            elif pending[0].arrival_s <= close:
                time.sleep(min(pending[0].arrival_s, close) - now if pending[0].arrival_s > now else 0)
            else:
                time.sleep(max(0.0, close - now))
                break
        if len(batch) < s.window_batch:
            time.sleep(max(0.0, close - (time.perf_counter() - t0)))
        width = max(len(r.prompt_ids) for r in batch)
        input_ids = torch.tensor([[0] * (width - len(r.prompt_ids)) + r.prompt_ids for r in batch])  # left pad
        mask = torch.tensor([[0] * (width - len(r.prompt_ids)) + [1] * len(r.prompt_ids) for r in batch])
        new = max(r.new_tokens for r in batch)
        step_times.clear()
        start = time.perf_counter() - t0
        with torch.inference_mode():
            model.generate(
                input_ids,
                attention_mask=mask,
                max_new_tokens=new,
                min_new_tokens=new,
                do_sample=False,
                pad_token_id=0,
                logits_processor=[StepClock()],
            )
        trace.iterations += len(step_times)
        for r in batch:
            by_id[r.id].start = start
            by_id[r.id].token_times = step_times[: r.new_tokens]
    return trace


def run_mode(mode: str, reqs: list[BenchRequest], s: ModeSettings) -> RunTrace:
    if mode in ("fused", "serial", "window"):
        return run_engine_mode(mode, reqs, s)
    if mode == "instances":
        return run_instances(reqs, s)
    if mode == "hf":
        return run_hf(reqs, s)
    raise ValueError(f"unknown mode {mode!r}; choose from {', '.join(MODES)}")
