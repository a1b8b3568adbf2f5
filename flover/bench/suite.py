"""`flover bench --suite paper`: the Flover talk's experiments 1, 2, 3, 4 and 6, scaled for a small
CPU machine, written into docs/benchmarks.md (between the suite markers) with plots beside it.

1  overall latency, N requests arriving every 500 ms, fused vs serial (talk: up to 16.7x vs FT)
2  concurrency sweep 1..32 requests all at once: throughput and per-token latency, every mode
3  lambda sweep: 32 Poisson requests, mean interval 20..400 ms: speedup and overlap, every mode
4  memory shuffle: generation lengths U(a, b), requests leaving from the middle of the buffer
6  comprehensive comparison: one Poisson workload, every mode, tokens over time
"""

from __future__ import annotations

import shutil
import statistics
import time
from pathlib import Path

from flover.bench import roofline
from flover.bench.modes import ModeSettings
from flover.bench.report import fmt, plot_concurrency, roofline_line, summary_table
from flover.bench.runner import machine_text, run_benchmark
from flover.bench.workload import Workload
from flover.config import default_num_threads

ALL_MODES = ["fused", "serial", "window", "instances", "hf"]
START, END = "<!-- bench-suite:start -->", "<!-- bench-suite:end -->"


def scale(quick: bool) -> dict:
    if quick:  # seconds, for a smoke test of the harness
        return dict(
            exp1=(1, 3), exp2=(1, 2, 4), exp3=(20, 200), n=4, gen=8, gen3=8, exp4=((4, 8), (4, 16)), n6=4, repeats=2
        )
    return dict(
        exp1=(1, 8, 32),
        exp2=(1, 2, 4, 8, 16, 32),
        exp3=(20, 50, 100, 200, 400, 1000),
        n=32,
        gen=64,
        gen3=96,
        exp4=((32, 64), (32, 128), (32, 256)),
        n6=32,
        repeats=3,
    )


def run_suite(
    model: str,
    out_dir: str | Path,
    docs: str | Path | None,
    settings: ModeSettings,
    quick: bool = False,
    modes: list[str] | None = None,
    log=print,
) -> str:
    modes = modes or ALL_MODES
    out_dir = Path(out_dir)
    sc = scale(quick)
    started = time.time()
    threads = settings.threads or default_num_threads()
    roof = roofline.measure(*roofline.model_size(model), threads=threads)
    md = [
        START,
        "",
        "## The Flover experiments on this machine (`flover bench --suite paper`)",
        "",
        f"Machine: {machine_text(threads)}. Model: `{model}`, {settings.dtype}. Date: "
        f"{time.strftime('%Y-%m-%d')}. Command: `flover bench --suite paper --model {model} "
        f"--out {out_dir}`{' --quick' if quick else ''}. Per-request JSON, tables and plots for every run go "
        f"to `{out_dir}/` (git-ignored); the figures below are copied into `docs/bench/`.",
        "",
        roofline_line(roof.as_dict(), None),
        "",
    ]
    run = lambda name, workload, ms: run_benchmark(model, workload, ms, settings, out_dir, name, roof, log)  # noqa: E731

    md += _overall_latency(run, sc)
    md += _concurrency(run, sc, modes, out_dir, docs)
    md += _lambda_sweep(run, sc, modes)
    md += _shuffle(run, sc)
    md += _comprehensive(run, sc, modes, roof, docs)
    md += ["", f"Suite wall time: {(time.time() - started) / 60:.1f} min.", "", END]
    text = "\n".join(md) + "\n"
    if docs is not None:
        _splice(Path(docs), text)
    return text


def _overall_latency(run, sc: dict) -> list[str]:
    """1: overall latency at 500 ms intervals (fused vs serial)."""
    md = [
        "### 1. Overall latency, requests arriving every 500 ms (fused vs serial)",
        "",
        f"{sc['gen']} new tokens per request, 64-token prompts. Overall latency = time until the last request "
        "finished; mean latency = mean end-to-end latency per request.",
        "",
        "| requests | serial overall (s) | fused overall (s) | speedup | serial mean latency (s) | "
        "fused mean latency (s) | speedup |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for n in sc["exp1"]:
        r = run(f"exp1-n{n}", Workload(n, (64, 64), (sc["gen"],) * 2, "interval", 500), ["fused", "serial"])["results"]
        f, s = r["fused"]["summary"], r["serial"]["summary"]
        md.append(
            f"| {n} | {s['makespan_s']:.2f} | {f['makespan_s']:.2f} | {f['speedup_makespan']:.2f}x | "
            f"{s['mean_e2e_s']:.2f} | {f['mean_e2e_s']:.2f} | {f['speedup_mean_latency']:.2f}x |"
        )
    return md


def _concurrency(run, sc: dict, modes: list[str], out_dir: Path, docs) -> list[str]:
    """2: the concurrency sweep, everything arriving at once."""
    md = [
        "",
        "### 2. Throughput and per-token latency against concurrency (all requests at once)",
        "",
        f"{sc['gen']} new tokens, 64-token prompts. Per-token slowdown = fused TPOT p50 / fused TPOT p50 at 1. "
        f"The fused figures are the median of {sc['repeats']} runs (the others: one run each).",
        "",
        "| requests | " + " | ".join(f"{m} tok/s" for m in modes) + " | fused TPOT p50 (ms) | per-token slowdown |",
        "|---:|" + "---:|" * (len(modes) + 2),
    ]
    sweep, base_tpot = [], None
    for n in sc["exp2"]:
        workload = Workload(n, (64, 64), (sc["gen"],) * 2, "all")
        r = run(f"exp2-n{n}", workload, modes)["results"]
        reruns = [r["fused"]["summary"]] + [
            run(f"exp2-n{n}-fused{k}", workload, ["fused"])["results"]["fused"]["summary"]
            for k in range(1, sc["repeats"])
        ]
        f = {key: statistics.median(x[key] for x in reruns) for key in ("output_tok_s", "tpot_p50_s")}
        r["fused"]["summary"] = {**r["fused"]["summary"], **f}
        base_tpot = base_tpot or f["tpot_p50_s"]
        sweep.append({"concurrency": n, "output_tok_s": f["output_tok_s"], "tpot_p50_s": f["tpot_p50_s"]})
        md.append(
            f"| {n} | "
            + " | ".join(f"{r[m]['summary']['output_tok_s']:.0f}" for m in modes)
            + f" | {1000 * f['tpot_p50_s']:.1f} | {100 * (f['tpot_p50_s'] / base_tpot - 1):+.0f}% |"
        )
    plot = plot_concurrency(out_dir, "exp2-concurrency", sweep)
    md += ["", f"![concurrency]({_rel(plot, docs)})"]
    return md


def _lambda_sweep(run, sc: dict, modes: list[str]) -> list[str]:
    """3: the Poisson lambda sweep."""
    md = [
        "",
        f"### 3. Poisson arrivals: the lambda sweep ({sc['n']} requests, {sc['gen3']} new tokens)",
        "",
        "Speedup = serial overall latency / the mode's. Overlap = share of requests whose processing overlapped "
        "another's (fused). Iterations = fused engine iterations.",
        "",
        "| mean interval λ (ms) | fused iterations | overlap | "
        + " | ".join(f"{m} speedup" for m in modes if m != "serial")
        + " |",
        "|---:|---:|---:|" + "---:|" * (len(modes) - 1),
    ]
    for lam in sc["exp3"]:
        r = run(f"exp3-lambda{lam}", Workload(sc["n"], (64, 64), (sc["gen3"],) * 2, "poisson", lam), modes)["results"]
        f = r["fused"]["summary"]
        md.append(
            f"| {lam} | {f['iterations']} | {f['overlap_share']:.0%} | "
            + " | ".join(fmt(r[m]["summary"]["speedup_makespan"], "{:.2f}x") for m in modes if m != "serial")
            + " |"
        )
    return md


def _shuffle(run, sc: dict) -> list[str]:
    """4: the memory shuffle under generation lengths U(a, b)."""
    md = [
        "",
        "### 4. Memory shuffle with generation lengths U(a, b), all requests at once (fused)",
        "",
        "Requests finish at different iterations and leave holes mid-buffer; the two-step shuffle moves the "
        "live ones back to [0, n).",
        "",
        "| generation lengths | slot moves | shuffle time (ms) | share of run | makespan (s) | tok/s |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for a, b in sc["exp4"]:
        r = run(f"exp4-U{a}-{b}", Workload(sc["n"], (64, 64), (a, b), "all"), ["fused"])["results"]
        f = r["fused"]["summary"]
        md.append(
            f"| U({a}, {b}) | {f['shuffle_moves']} | {1000 * f['shuffle_s']:.2f} | "
            f"{f['shuffle_s'] / f['makespan_s']:.2%} | {f['makespan_s']:.2f} | {f['output_tok_s']:.0f} |"
        )
    return md


def _comprehensive(run, sc: dict, modes: list[str], roof, docs) -> list[str]:
    """6: the comprehensive comparison, every mode."""
    w6 = Workload(sc["n6"], (16, 96), (max(2, sc["gen"] // 2), sc["gen"] * 2), "poisson", 100)
    res6 = run("exp6-comprehensive", w6, modes)
    md = [
        "",
        f"### 6. Comprehensive comparison: {w6.describe()}",
        "",
        summary_table(res6["results"]),
        "",
        roofline_line(roof.as_dict(), res6["results"]["fused"]["summary"]),
        "",
    ]
    md += [f"![{Path(p).stem}]({_rel(Path(p), docs)})" for p in res6["files"]["plots"]]
    return md


def _rel(path: Path, docs: str | Path | None) -> str:
    """The figure as the page links it: copied into bench/ beside the page (the raw results, JSON
    with every measurement, stay in the git-ignored output directory)."""
    if docs is None:
        return str(path)
    target = Path(docs).parent / "bench" / Path(path).name
    target.parent.mkdir(parents=True, exist_ok=True)
    if Path(path).resolve() != target.resolve():
        shutil.copyfile(path, target)
    return f"bench/{target.name}"


def _splice(doc: Path, section: str) -> None:
    """Replace the suite section of docs/benchmarks.md (or append it)."""
    old = doc.read_text() if doc.exists() else "# Benchmarks\n"
    if START in old and END in old:
        new = old[: old.index(START)] + section.rstrip("\n") + old[old.index(END) + len(END) :]
    else:
        new = old.rstrip("\n") + "\n\n" + section
    doc.write_text(new)
