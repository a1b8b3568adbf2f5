"""Latency and throughput figures, defined as in the common serving benchmarks (docs/benchmarks.md):

queue   start of processing - arrival
TTFT    first token - arrival
TPOT    (e2e - TTFT) / (tokens - 1)
ITL     time between successive tokens of a request
e2e     last token - arrival
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # types only: the metrics load no engine (client-side benchmarks use them)
    from flover.bench.modes import RequestTrace, RunTrace


def percentile(values: list[float], q: float) -> float | None:
    """Linear-interpolated percentile, q in [0, 100]."""
    if not values:
        return None
    xs = sorted(values)
    k = (len(xs) - 1) * q / 100
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def medians(runs: list[dict], keys) -> dict:
    """Per key, the median over runs: the figure every benchmark reports."""
    return {k: statistics.median(r[k] for r in runs) for k in keys}


def request_metrics(t: RequestTrace) -> dict:
    first, last = t.token_times[0], t.token_times[-1]
    n = len(t.token_times)
    return {
        "id": t.id,
        "arrival_s": t.arrival,
        "prompt_tokens": t.prompt_len,
        "output_tokens": n,
        "queue_s": None if t.start is None else max(0.0, t.start - t.arrival),
        "ttft_s": first - t.arrival,
        "tpot_s": (last - first) / (n - 1) if n > 1 else None,
        "e2e_s": last - t.arrival,
        "itl_s": [b - a for a, b in zip(t.token_times, t.token_times[1:])],
    }


def overlap_share(trace: RunTrace) -> float:
    """Share of requests whose processing [start, last token] overlapped another request's."""
    spans = sorted((t.start if t.start is not None else t.arrival, t.token_times[-1]) for t in trace.requests)
    overlapped = [False] * len(spans)
    furthest, owner = float("-inf"), -1
    for i, (start, end) in enumerate(spans):
        if start < furthest:  # an earlier span is still open
            overlapped[i] = overlapped[owner] = True
        if end > furthest:
            furthest, owner = end, i
    return sum(overlapped) / len(spans) if spans else 0.0


def run_summary(trace: RunTrace) -> dict:
    per = [request_metrics(t) for t in trace.requests]
    makespan = max(t.token_times[-1] for t in trace.requests) - min(t.arrival for t in trace.requests)
    tokens = sum(p["output_tokens"] for p in per)
    summary = {
        "mode": trace.mode,
        "note": trace.note,
        "kernels": trace.kernels,
        "requests": len(per),
        "output_tokens": tokens,
        "makespan_s": makespan,
        "output_tok_s": tokens / makespan,
        "requests_s": len(per) / makespan,
        "iterations": trace.iterations,
        "overlap_share": overlap_share(trace),
        "shuffle_moves": trace.shuffle_moves,
        "shuffle_s": trace.shuffle_s,
        "mean_e2e_s": statistics.fmean(p["e2e_s"] for p in per),
    }
    for key in ("queue_s", "ttft_s", "tpot_s", "e2e_s", "itl_s"):
        values = [v for p in per for v in (p[key] if key == "itl_s" else [p[key]]) if v is not None]
        for q in (50, 90, 99):
            summary[f"{key[:-2]}_p{q}_s"] = percentile(values, q)
    return {"summary": summary, "requests": per}


def add_speedups(results: dict[str, dict]) -> None:
    """Speedup against `serial`: its makespan / this mode's makespan, and the same for mean e2e."""
    base = results.get("serial")
    for result in results.values():
        s = result["summary"]
        s["speedup_makespan"] = base["summary"]["makespan_s"] / s["makespan_s"] if base else None
        s["speedup_mean_latency"] = base["summary"]["mean_e2e_s"] / s["mean_e2e_s"] if base else None


def resident_mib(pid: int) -> float:
    """Resident memory of a process and all its descendants (MiB), from /proc."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        todo += children.get(p, [])
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
        except OSError:
            pass
    return total / 1024
