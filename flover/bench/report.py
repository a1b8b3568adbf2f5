"""Results on disk: one JSON file with every measurement, a Markdown summary, PNG plots."""

from __future__ import annotations

import json
from pathlib import Path

COLUMNS = [
    ("mode", "{}"),
    ("makespan_s", "{:.2f}"),
    ("output_tok_s", "{:.0f}"),
    ("requests_s", "{:.2f}"),
    ("ttft_p50_s", "{:.3f}"),
    ("ttft_p99_s", "{:.3f}"),
    ("tpot_p50_s", "{:.4f}"),
    ("itl_p99_s", "{:.4f}"),
    ("e2e_p50_s", "{:.2f}"),
    ("e2e_p99_s", "{:.2f}"),
    ("iterations", "{}"),
    ("overlap_share", "{:.0%}"),
    ("speedup_makespan", "{:.2f}x"),
    ("speedup_mean_latency", "{:.2f}x"),
]


def fmt(value, pattern: str) -> str:
    return "-" if value is None else pattern.format(value)


def summary_table(results: dict[str, dict]) -> str:
    head = "| " + " | ".join(c for c, _ in COLUMNS) + " |"
    rule = "|" + "|".join("---" if c == "mode" else "---:" for c, _ in COLUMNS) + "|"
    rows = ["| " + " | ".join(fmt(r["summary"].get(c), p) for c, p in COLUMNS) + " |" for r in results.values()]
    return "\n".join([head, rule, *rows])


def roofline_line(roof: dict, fused: dict | None) -> str:
    """Machine limits and how close fused decode iterations came to them."""
    from flover.bench.roofline import Roofline

    r = Roofline(**roof)
    text = (
        f"Roofline: memory read bandwidth {r.bandwidth_gb_s:.1f} GB/s (copy {r.copy_gb_s:.1f} GB/s read+write), "
        f"float32 matmul {r.matmul_gflop_s:.0f} GFLOP/s (measured in this run); "
        f"{r.params / 1e6:.0f}M parameters ({r.weight_bytes / 1e6:.0f} MB) read per decode iteration"
    )
    if fused and fused.get("iteration_ms_by_batch"):
        parts = []
        for batch, ms in sorted(fused["iteration_ms_by_batch"].items(), key=lambda kv: int(kv[0])):
            floor = r.floor_ms(int(batch))
            parts.append(f"batch {batch}: {ms:.1f} ms vs floor {floor:.1f} ms ({floor / ms:.0%} of the roofline)")
        text += "; fused decode iterations: " + "; ".join(parts)
    return text + "."


def write_results(out_dir: Path, name: str, meta: dict, results: dict[str, dict], traces: dict) -> dict:
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}.json"
    path.write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    plots = plot_run(out_dir, name, results, traces)
    md = [f"### {name}", "", meta["workload_text"], "", summary_table(results), ""]
    if meta.get("roofline"):  # measured for local runs; an --endpoint run has no model here
        md += [roofline_line(meta["roofline"], results.get("fused", {}).get("summary")), ""]
    md += [f"![{p.stem}]({p.name})" for p in plots]
    (out_dir / f"{name}.md").write_text("\n".join(md) + "\n")
    return {"json": str(path), "plots": [str(p) for p in plots]}


def plot_run(out_dir: Path, name: str, results: dict[str, dict], traces: dict) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    made = []
    fig, ax = plt.subplots(figsize=(7, 4))
    for mode, trace in traces.items():
        times = sorted(t for r in trace.requests for t in r.token_times)
        ax.plot(times, range(1, len(times) + 1), label=mode)
    ax.set_xlabel("time since the first arrival (s)")
    ax.set_ylabel("generated tokens (cumulative)")
    ax.set_title(f"{name}: tokens over time")
    ax.legend()
    made.append(_save(fig, out_dir / f"{name}-tokens.png"))

    fig, ax = plt.subplots(figsize=(7, 4))
    for mode, result in results.items():
        e2e = sorted(r["e2e_s"] for r in result["requests"])
        ax.plot(e2e, [(i + 1) / len(e2e) for i in range(len(e2e))], label=mode)
    ax.set_xlabel("end-to-end latency (s)")
    ax.set_ylabel("share of requests")
    ax.set_title(f"{name}: latency CDF")
    ax.legend()
    made.append(_save(fig, out_dir / f"{name}-latency-cdf.png"))

    if "fused" in traces and traces["fused"].iteration_log:
        fig, ax = plt.subplots(figsize=(7, 3))
        log = traces["fused"].iteration_log
        ax.step(range(len(log)), [entry[1] for entry in log], where="post")
        ax.set_xlabel("iteration")
        ax.set_ylabel("requests in flight")
        ax.set_title(f"{name}: temporal fusion, requests in flight per iteration")
        made.append(_save(fig, out_dir / f"{name}-inflight.png"))
    return made


def plot_concurrency(out_dir: Path, name: str, rows: list[dict]) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax1 = plt.subplots(figsize=(7, 4))
    n = [r["concurrency"] for r in rows]
    ax1.plot(n, [r["output_tok_s"] for r in rows], "o-", label="throughput (tok/s)")
    ax1.set_xscale("log", base=2)
    ax1.set_xlabel("concurrent requests")
    ax1.set_ylabel("output tokens/s")
    ax2 = ax1.twinx()
    ax2.plot(n, [1000 * r["tpot_p50_s"] for r in rows], "s--", color="tab:red", label="TPOT p50 (ms)")
    ax2.set_ylabel("time per output token, p50 (ms)")
    handles = ax1.get_legend_handles_labels()[0] + ax2.get_legend_handles_labels()[0]
    ax1.legend(handles, [h.get_label() for h in handles], loc="upper left")
    ax1.set_title(f"{name}: throughput and per-token latency against concurrency")
    return _save(fig, out_dir / f"{name}.png")


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path
