"""The benchmark harness: its arithmetic on hand-made traces, and a real --quick run of every mode
(the structure of the results, never their speed)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from flover.bench.metrics import overlap_share, percentile, request_metrics, run_summary
from flover.bench.modes import RequestTrace, RunTrace
from flover.bench.workload import Workload, parse_range


def test_metric_definitions_on_a_hand_made_trace():
    t = RequestTrace("a", arrival=1.0, prompt_len=5, new_tokens=4, start=1.5, token_times=[2.0, 2.5, 3.0, 4.0])
    m = request_metrics(t)
    assert m["queue_s"] == 0.5 and m["ttft_s"] == 1.0 and m["e2e_s"] == 3.0
    assert m["tpot_s"] == pytest.approx(2.0 / 3) and m["itl_s"] == [0.5, 0.5, 1.0]
    assert percentile([1, 2, 3, 4], 50) == 2.5 and percentile([5], 99) == 5 and percentile([], 50) is None


def test_overlap_share_and_run_summary():
    a = RequestTrace("a", 0.0, 1, 2, start=0.0, token_times=[1.0, 2.0])
    b = RequestTrace("b", 1.5, 1, 2, start=1.5, token_times=[2.5, 3.0])  # overlaps a
    c = RequestTrace("c", 5.0, 1, 2, start=5.0, token_times=[6.0, 7.0])  # alone
    trace = RunTrace("fused", [a, b, c], iterations=6)
    assert overlap_share(trace) == pytest.approx(2 / 3)
    s = run_summary(trace)["summary"]
    assert s["makespan_s"] == 7.0 and s["output_tokens"] == 6 and s["output_tok_s"] == pytest.approx(6 / 7)
    assert s["e2e_p50_s"] == 2.0 and s["iterations"] == 6


def test_workloads_are_seeded_and_shaped_as_asked():
    w = Workload(200, (4, 9), (3, 5), "poisson", 50, seed=3)
    a, b = w.build(100), w.build(100)
    assert a == b and a != Workload(200, (4, 9), (3, 5), "poisson", 50, seed=4).build(100)
    assert all(4 <= len(r.prompt_ids) <= 9 and 3 <= r.new_tokens <= 5 for r in a)
    gaps = [y.arrival_s - x.arrival_s for x, y in zip(a, a[1:])]
    assert min(gaps) > 0 and 0.035 < sum(gaps) / len(gaps) < 0.065
    every = Workload(3, (2, 2), (2, 2), "interval", 250).build(100)
    assert [r.arrival_s for r in every] == [0.0, 0.25, 0.5]
    assert parse_range("7") == (7, 7) and parse_range("2,9") == (2, 9)
    with pytest.raises(ValueError):
        parse_range("9,2")


def test_quick_bench_runs_every_mode(llama_dir, tmp_path):
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "flover.apps.cli",
            "bench",
            "--model",
            llama_dir,
            "--quick",
            "--out",
            str(tmp_path),
            "--window-ms",
            "100",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    data = json.loads((tmp_path / "bench.json").read_text())
    results = data["results"]
    assert list(results) == ["fused", "serial", "window", "instances", "hf"]
    for mode, r in results.items():
        s = r["summary"]
        for key in (
            "makespan_s",
            "output_tok_s",
            "requests_s",
            "ttft_p50_s",
            "tpot_p99_s",
            "itl_p90_s",
            "e2e_p99_s",
            "queue_p50_s",
            "iterations",
            "overlap_share",
            "speedup_makespan",
        ):
            assert key in s, (mode, key)
        assert s["requests"] == 4 and len(r["requests"]) == 4
        for req in r["requests"]:
            assert req["output_tokens"] >= 4 and req["ttft_s"] > 0 and len(req["itl_s"]) == req["output_tokens"] - 1
    assert results["serial"]["summary"]["speedup_makespan"] == 1.0
    assert "iteration_ms_by_batch" in results["fused"]["summary"]
    assert data["meta"]["roofline"]["bandwidth_gb_s"] > 0 and data["meta"]["roofline"]["matmul_gflop_s"] > 0
    md = (tmp_path / "bench.md").read_text()
    assert "| fused |" in md and "Roofline: memory read bandwidth" in md
    for plot in ("bench-tokens.png", "bench-latency-cdf.png", "bench-inflight.png"):
        assert (tmp_path / plot).stat().st_size > 1000


def test_quick_paper_suite_writes_its_section(llama_dir, tmp_path):
    from flover.bench.modes import ModeSettings
    from flover.bench.suite import END, START, _splice, run_suite

    doc = tmp_path / "benchmarks.md"
    doc.write_text("# Benchmarks\n\nearlier sections stay\n")
    settings = ModeSettings(model=llama_dir, window_ms=50, window_batch=8)
    section = run_suite(
        llama_dir,
        tmp_path / "raw",
        doc,
        settings,
        quick=True,
        modes=["fused", "serial", "window"],
        log=lambda _: None,
    )
    _splice(doc, section.replace("Suite wall time", "Suite wall time (again)"))  # a later run replaces it
    text = doc.read_text()
    assert "Suite wall time (again)" in text
    assert text.count(START) == 1 and text.count(END) == 1 and "earlier sections stay" in text
    for heading in ("### 1.", "### 2.", "### 3.", "### 4.", "### 6."):
        assert heading in text
    assert "| 20 |" in text and "| 200 |" in text  # the lambda sweep rows
    assert (tmp_path / "bench" / "exp2-concurrency.png").exists()  # figures copied beside the page
    assert "](bench/exp2-concurrency.png)" in text and (tmp_path / "raw" / "exp3-lambda20.json").exists()
