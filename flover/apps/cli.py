"""`flover` command line: each command lives beside its app (apps/generate.py, run.py, serve.py,
chat.py, bench.py, demo.py) and registers its flags; the engine's flags come from EngineConfig
(apps/flags.py), an engine starts through engine/launch.py. Here: the parser, logging, errors."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from flover.apps import bench, chat, demo, generate, run, serve
from flover.apps.flags import resolve_dtype

log = logging.getLogger("flover")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="flover", description="temporal-fusion LLM inference")
    ap.add_argument("-v", "--verbose", action="store_true")
    sub = ap.add_subparsers(dest="command", required=True)
    generate.add_generate_command(sub)
    run.add_run_command(sub)
    serve.add_serve_command(sub)
    chat.add_chat_command(sub)
    serve.add_keygen_command(sub)
    bench.add_bench_command(sub)
    demo.add_demo_command(sub)
    return ap


# How long an idle OpenMP worker spins before it sleeps (libgomp, which PyTorch and the native
# step share; read once, when torch loads it). The default, 300,000 rounds, is milliseconds: the
# worker spins through the Python between two iterations (replies, detokenizing), when the
# clients and ZeroMQ's I/O threads want a core, and they take one from the next forward instead.
# 10,000 is a fraction of a millisecond, far more than the gaps inside a forward (figures:
# docs/design_notes.md, "OpenMP spin count"). An OMP_WAIT_POLICY or GOMP_SPINCOUNT of the caller wins.
OPENMP_SPIN_COUNT = "10000"


def main(argv: list[str] | None = None) -> int:
    if "OMP_WAIT_POLICY" not in os.environ:
        os.environ.setdefault("GOMP_SPINCOUNT", OPENMP_SPIN_COUNT)
    from flover.parallel.launch import launched_rank, launched_ranks

    args = build_parser().parse_args(argv)
    args.comm = None
    ranks = launched_ranks()
    if ranks > 1 and args.command == "demo":
        print("flover: error: flover demo runs in one process; use flover run/generate under mpirun", file=sys.stderr)
        return 2
    prefix = f"flover[rank {launched_rank()}]" if ranks > 1 else "flover"
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO, format=f"{prefix}: %(message)s", stream=sys.stderr
    )
    try:
        _resolve_hub_id(args)
        if getattr(args, "dtype", None) == "auto":  # concrete from here on: logs, results files, bench tables
            args.dtype = resolve_dtype(args)
        return args.func(args)
    except (
        ValueError,
        MemoryError,
        OSError,
        RuntimeError,
    ) as e:  # CheckpointError: a ValueError; FetchError: a RuntimeError
        print(f"{prefix}: error: {e or type(e).__name__}", file=sys.stderr, flush=True)
        code = 2
    except BaseException as e:  # anything else: say which rank failed and why
        if ranks <= 1:
            raise
        import traceback

        print(f"{prefix}: failed: {e!r}\n{traceback.format_exc()}", file=sys.stderr, flush=True)
        code = 1
    if ranks > 1:
        _abort_job(args.comm, code)  # one failing rank ends the whole job, never a hang
    return code


def _resolve_hub_id(args: argparse.Namespace) -> None:
    from flover.apps.fetch import is_hub_id, resolve_hub_id

    model = getattr(args, "model", None)
    if model and is_hub_id(model):
        args.model = resolve_hub_id(model)


def _abort_job(comm, code: int) -> None:
    if comm is None:
        from mpi4py import MPI

        MPI.COMM_WORLD.Abort(code)
    comm.abort(code)


if __name__ == "__main__":
    sys.exit(main())
