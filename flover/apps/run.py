"""`flover run`: every prompt of a file through the engine (or a daemon), into a resumable JSONL
results file (apps/prompt_file.py reads, apps/batch.py runs, apps/results_file.py writes)."""

from __future__ import annotations

import argparse
import hashlib
import io
import sys
from pathlib import Path

from flover.apps.flags import (
    add_connect_args,
    add_engine_args,
    add_sampling_args,
    connect,
    require_model,
    sampling_params,
    start_engine,
)
from flover.engine.launch import is_follower_rank


def add_run_command(sub) -> None:
    run = sub.add_parser(
        "run",
        help="run every prompt of a file; resumable JSONL output",
        description="Run a prompt file through the engine. Re-running the same command "
        "resumes: ids already in --out are skipped.",
    )
    add_engine_args(run, model_required=False)
    add_sampling_args(run)
    add_connect_args(run)
    run.add_argument("--max-in-flight", type=int, default=64, help="with --connect: outstanding requests")
    run.add_argument("--prompts", required=True, help=".txt (one prompt a line), .jsonl, or - for stdin")
    run.add_argument("--format", choices=("auto", "txt", "jsonl"), default="auto")
    run.add_argument("--out", required=True, help="JSONL results file (appended; - for stdout)")
    run.add_argument("--ordered", action="store_true", help="write results in input order")
    run.add_argument("--token-ids", action="store_true", help="include token ids in each record")
    embed = run.add_argument_group("embeddings (a line is an input; its record carries its vector)")
    embed.add_argument("--embed", action="store_true", help="embed every input instead of generating")
    embed.add_argument("--dimensions", type=int, help="with --embed: the first N components (normalized after)")
    embed.add_argument(
        "--truncate-prompt-tokens", type=int, help="with --embed: a longer input keeps its first N tokens"
    )
    run.add_argument(
        "--arrival",
        choices=("none", "poisson", "interval"),
        default="none",
        help="make prompts arrive over time (experiments)",
    )
    run.add_argument("--rate", type=float, help="poisson arrivals per second")
    run.add_argument("--interval", type=float, help="ms between arrivals")
    run.add_argument("--quiet", action="store_true", help="no progress output")
    run.add_argument("--log-interval", type=float, default=10.0, help="seconds between progress lines (no TTY)")
    run.set_defaults(func=cmd_run)


def cmd_run(args: argparse.Namespace) -> int:
    from dataclasses import asdict

    from flover.apps.batch import arrival_offsets
    from flover.apps.prompt_file import check_unique_ids
    from flover.request import EmbedParams

    require_model(args)
    if is_follower_rank():  # only the leader touches the files; the others serve its iterations
        start_engine(args)
        return 0
    if args.arrival == "poisson" and not args.rate:
        raise ValueError("--arrival poisson needs --rate (requests per second)")
    if args.arrival == "interval" and args.interval is None:
        raise ValueError("--arrival interval needs --interval MS")
    read, digest = _prompts(args)
    ids = check_unique_ids(read())  # before any work: duplicate ids are an error
    params = sampling_params(args)
    embed = EmbedParams(args.dimensions, args.truncate_prompt_tokens) if args.embed else None
    if embed is None and (args.dimensions is not None or args.truncate_prompt_tokens is not None):
        raise ValueError("--dimensions and --truncate-prompt-tokens go with --embed")
    # what the results file is of (a file of another kind or other settings is not resumed by this run)
    parts = {"prompts_sha256": digest} | (
        {"embed": asdict(embed)} if embed else {"params": asdict(params), "token_ids": args.token_ids}
    )
    offsets = arrival_offsets(args.arrival, args.rate, args.interval, args.seed)
    run = _run_remote if args.connect else _run_local
    summary = run(args, read, ids, parts, offsets, params, embed)
    print(f"flover run: {summary.line()}", file=sys.stderr)
    incomplete = summary.incomplete_line()
    if incomplete:
        print(f"flover run: {incomplete}", file=sys.stderr)
        return 3
    return 0


def _prompts(args: argparse.Namespace):
    """(a function that reads the prompt file's records anew, the file's sha256)."""
    from flover.apps.prompt_file import detect_format, iter_records
    from flover.apps.results_file import file_sha256

    if args.prompts == "-":
        data = sys.stdin.buffer.read()
        first = next((x for x in data.split(b"\n") if x.strip()), b"").decode("utf-8", "replace")
        fmt = args.format if args.format != "auto" else detect_format("-", first)
        return (lambda: iter_records(io.BytesIO(data), fmt)), hashlib.sha256(data).hexdigest()
    fmt = args.format if args.format != "auto" else detect_format(args.prompts)

    def read():
        with open(args.prompts, "rb") as f:  # split on b"\n" only, decoded line by line
            yield from iter_records(f, fmt)

    return read, file_sha256(args.prompts)


def _run_remote(args, read, ids: set[str], parts: dict, offsets, params, embed):
    """Through a running daemon (--connect)."""
    from flover.apps.batch import RemoteBatchRunner
    from flover.apps.results_file import open_results
    from flover.client import FloverError

    with connect(args) as client:
        try:
            health = client.health(timeout=args.timeout or 10.0)
        except (TimeoutError, FloverError) as e:
            raise OSError(f"no flover server answers at {args.connect} ({e})") from None
        client.max_message_bytes = health.get("max_message_bytes", client.max_message_bytes)
        out, done = open_results(args.out, {**parts, "model": health.get("model")})
        try:
            runner = lambda progress: RemoteBatchRunner(  # noqa: E731
                client,
                out,
                params,
                ordered=args.ordered,
                token_ids=args.token_ids,
                max_in_flight=args.max_in_flight,
                progress=progress,
                timeout=args.timeout,
                embed=embed,
            )
            return _run_records(args, read, ids, done, offsets, runner)
        finally:
            out.close()


def _run_local(args, read, ids: set[str], parts: dict, offsets, params, embed):
    """Through an engine in this process (and its ranks under mpirun)."""
    from flover.apps.batch import BatchRunner
    from flover.apps.results_file import open_results

    out, done = open_results(args.out, {**parts, "model": str(Path(args.model).resolve()), "dtype": args.dtype})
    engine = None
    try:
        engine = start_engine(args)
        runner = lambda progress: BatchRunner(  # noqa: E731
            engine, out, params, ordered=args.ordered, token_ids=args.token_ids, progress=progress, embed=embed
        )
        return _run_records(args, read, ids, done, offsets, runner)
    finally:
        out.close()
        if engine is not None:
            engine.shutdown()


def _run_records(args, read, ids: set[str], done: set[str], offsets, make_runner):
    from flover.apps.batch import Progress

    done = done & ids
    todo = (record for record in read() if record.id not in done)
    progress = Progress(len(ids) - len(done), enabled=not args.quiet, interval=args.log_interval)
    summary = make_runner(progress).run(todo, offsets)
    summary.prompts, summary.skipped = len(ids), len(done)
    return summary
