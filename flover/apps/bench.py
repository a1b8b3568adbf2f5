"""`flover bench`: the same seeded workload through fused / serial / window / instances / hf, or
against any OpenAI-compatible server (--endpoint); `--suite paper` the Flover talk's experiments."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from flover.apps.flags import add_engine_args


def add_bench_command(sub) -> None:
    bench = sub.add_parser(
        "bench",
        help="the same seeded workload through fused / serial / window / instances / hf, "
        "or against any OpenAI-compatible server (--endpoint)",
    )
    add_engine_args(bench, model_required=False)
    w = bench.add_argument_group("workload (seeded)")
    w.add_argument("--requests", type=int, default=32)
    w.add_argument("--prompt-len", default="64", help="N or A,B for U(A, B)")
    w.add_argument("--gen-len", default="128", help="N or A,B for U(A, B); EOS is ignored")
    w.add_argument("--arrival", choices=("all", "interval", "poisson"), default="poisson")
    w.add_argument("--interval-ms", type=float, default=100.0, help="interval, or the Poisson mean interval")
    w.add_argument("--bench-seed", type=int, default=0)
    m = bench.add_argument_group("modes")
    m.add_argument("--modes", default="fused,serial,window,instances,hf")
    m.add_argument("--window-ms", type=float, default=500.0, help="window / hf: longest wait for a batch")
    m.add_argument("--window-batch", type=int, default=32, help="window / hf: largest batch")
    m.add_argument("--instances", type=int, default=2, help="instances: model processes")
    e = bench.add_argument_group("any OpenAI-compatible server instead of local modes")
    e.add_argument(
        "--endpoint",
        metavar="URL",
        help="e.g. http://127.0.0.1:8000 (flover serve --http, llama-server, "
        "vLLM); --model then names the served model (default: the first "
        "it lists) or a local checkpoint for the vocabulary size",
    )
    e.add_argument("--api-key", default=None, help="Bearer token for --endpoint (default: $OPENAI_API_KEY)")
    e.add_argument("--vocab-size", type=int, default=None, help="--endpoint: random prompt ids below this (32000)")
    bench.add_argument("--out", default="results", help="directory for JSON, Markdown and PNG files")
    bench.add_argument("--name", default="bench", help="file name stem of this run's results")
    bench.add_argument("--quick", action="store_true", help="a tiny workload: a smoke test of the harness")
    bench.add_argument("--suite", choices=("paper",), help="the Flover talk's experiments 1, 2, 3, 4, 6")
    bench.add_argument("--docs", default="docs/benchmarks.md", help="--suite: the page to write the results into")
    bench.set_defaults(func=cmd_bench)


def cmd_bench(args: argparse.Namespace) -> int:
    from flover.bench.modes import MODES, ModeSettings
    from flover.bench.runner import run_benchmark
    from flover.bench.suite import run_suite

    if args.endpoint:
        return _bench_endpoint(args)
    if not args.model:
        raise ValueError("give --model (the local modes) or --endpoint URL (an OpenAI-compatible server)")
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        raise ValueError(f"unknown mode(s) {unknown}; choose from {', '.join(MODES)}")
    settings = ModeSettings(
        model=args.model,
        dtype=args.dtype,
        threads=args.threads,
        max_slots=args.max_slots,
        max_seq_len=args.max_seq_len,
        window_ms=args.window_ms,
        window_batch=args.window_batch,
        instances=args.instances,
    )
    say = lambda text: print(text, file=sys.stderr, flush=True)  # noqa: E731
    if args.suite == "paper":
        docs = None if args.quick else args.docs
        text = run_suite(args.model, args.out, docs, settings, quick=args.quick, modes=modes, log=say)
        print(text)
        return 0
    result = run_benchmark(args.model, _workload(args), modes, settings, args.out, args.name, log=say)
    print(Path(result["files"]["json"]).with_suffix(".md").read_text())
    return 0


def _bench_endpoint(args: argparse.Namespace) -> int:
    """The workload against any OpenAI-compatible server; --model names the served model (default:
    the first it lists), or is a local checkpoint whose vocabulary sizes the random prompts."""
    from flover.bench.runner import run_endpoint_benchmark

    vocab, served = args.vocab_size, args.model
    if args.model and Path(args.model).exists():
        from flover.models import load_model_config

        vocab, served = vocab or load_model_config(args.model).vocab_size, None
    result = run_endpoint_benchmark(
        args.endpoint,
        served,
        _workload(args),
        vocab or 32000,
        args.out,
        args.name,
        api_key=args.api_key or os.environ.get("OPENAI_API_KEY"),
        log=lambda text: print(text, file=sys.stderr, flush=True),
    )
    print(Path(result["files"]["json"]).with_suffix(".md").read_text())
    return 0


def _workload(args: argparse.Namespace):
    """The seeded workload of the flags (--quick: a tiny one, a smoke test of the harness)."""
    from flover.bench.workload import Workload, parse_range

    if args.quick:
        return Workload(4, (4, 12), (4, 8), "interval", 30, args.bench_seed)
    return Workload(
        args.requests,
        parse_range(args.prompt_len),
        parse_range(args.gen_len),
        args.arrival,
        args.interval_ms,
        args.bench_seed,
    )
