"""`flover bench`: one seeded workload through several serving modes, side by side."""

from __future__ import annotations

import datetime
import platform
import statistics
from collections import defaultdict
from pathlib import Path

import torch

from flover.bench import roofline
from flover.bench.metrics import add_speedups, run_summary
from flover.bench.modes import ModeSettings, RunTrace, run_mode
from flover.bench.report import write_results
from flover.bench.workload import Workload
from flover.config import default_num_threads
from flover.models import load_model_config


def iteration_ms_by_batch(trace: RunTrace, keep: int = 3) -> dict[str, float]:
    """Median time of pure decode iterations (one token per request in flight, no prompt) per
    batch size, for the most frequent batch sizes: what the roofline floor is compared with."""
    by_live = defaultdict(list)
    for _, live, seconds, tokens in trace.iteration_log:
        if tokens == live:
            by_live[live].append(seconds)
    common = sorted(by_live, key=lambda n: len(by_live[n]), reverse=True)[:keep]
    return {str(n): 1000 * statistics.median(by_live[n]) for n in sorted(common)}


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def machine_text(threads: int) -> str:
    return (
        f"{cpu_name()} ({platform.machine()}), {default_num_threads()} cores available, {threads} threads, "
        f"torch {torch.__version__}, Python {platform.python_version()}"
    )


def run_benchmark(
    model: str,
    workload: Workload,
    modes: list[str],
    settings: ModeSettings,
    out_dir: str | Path,
    name: str = "bench",
    roof: roofline.Roofline | None = None,
    log=print,
) -> dict:
    vocab = load_model_config(model).vocab_size
    requests = workload.build(vocab)
    threads = settings.threads or default_num_threads()
    if roof is None:
        roof = roofline.measure(*roofline.model_size(model), threads=threads)
    results, traces = {}, {}
    for mode in modes:
        log(f"[{name}] {mode} ...")
        trace = run_mode(mode, requests, settings)
        traces[mode] = trace
        results[mode] = run_summary(trace)
        if mode == "fused":
            results[mode]["summary"]["iteration_ms_by_batch"] = iteration_ms_by_batch(trace)
        s = results[mode]["summary"]
        log(
            f"[{name}] {mode}: makespan {s['makespan_s']:.2f} s, {s['output_tok_s']:.0f} tok/s, "
            f"e2e p50 {s['e2e_p50_s']:.2f} s, {s['iterations']} iterations"
        )
    add_speedups(results)
    meta = {
        "model": model,
        "workload": workload.as_dict(),
        "workload_text": workload.describe(),
        "modes": modes,
        "settings": settings.__dict__,
        "roofline": roof.as_dict(),
        "machine": machine_text(threads),
        "date": datetime.date.today().isoformat(),
    }
    files = write_results(Path(out_dir), name, meta, results, traces)
    return {"meta": meta, "results": results, "files": files, "traces": traces}


def run_endpoint_benchmark(
    url: str,
    model: str | None,
    workload: Workload,
    vocab: int,
    out_dir: str | Path,
    name: str = "bench",
    api_key: str | None = None,
    log=print,
) -> dict:
    """The workload against an OpenAI-compatible server: the same summary, files and plots."""
    from flover.bench.endpoint import Endpoint, run_endpoint

    endpoint = Endpoint(url, api_key)
    model = model or endpoint.model()
    log(f"[{name}] endpoint {url} (model {model}) ...")
    trace = run_endpoint(workload.build(vocab), endpoint, model)
    results = {"endpoint": run_summary(trace)}
    s = results["endpoint"]["summary"]
    log(
        f"[{name}] endpoint: makespan {s['makespan_s']:.2f} s, {s['output_tok_s']:.0f} tok/s, "
        f"TTFT p50 {s['ttft_p50_s'] * 1000:.0f} ms, e2e p50 {s['e2e_p50_s']:.2f} s"
    )
    meta = {
        "model": model,
        "endpoint": url,
        "workload": workload.as_dict(),
        "workload_text": workload.describe(),
        "modes": ["endpoint"],
        "roofline": None,
        "machine": machine_text(default_num_threads()),
        "date": datetime.date.today().isoformat(),
    }
    files = write_results(Path(out_dir), name, meta, results, {"endpoint": trace})
    return {"meta": meta, "results": results, "files": files, "traces": {"endpoint": trace}}
