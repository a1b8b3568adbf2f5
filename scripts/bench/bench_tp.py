#!/usr/bin/env python3
"""Tensor parallelism on this machine: TP=1 (all cores in one process) against TP=N under mpirun
(cores/N threads per rank), side by side, alternating, median of --repeats. Also reports the
time inside all-reduce per decode iteration and every rank's resident memory after loading.

    python scripts/bench/bench_tp.py --model models/bench-124m --ranks 2 --repeats 3
    python scripts/bench/bench_tp.py --model models/bench-124m --memory-only --ranks 1,2,4
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ENV = {
    **os.environ,
    "OMPI_ALLOW_RUN_AS_ROOT": "1",
    "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
    "OMPI_MCA_btl": "self,sm",
    "PYTHONUNBUFFERED": "1",
}


def run(ranks: int, args, threads: int | None, extra: list[str]) -> list[dict]:
    cmd = [sys.executable, str(HERE / "tp_profile.py"), "--model", args.model, *extra]
    if threads:
        cmd += ["--threads", str(threads)]
    if ranks > 1:
        mpirun = shutil.which("mpirun", path=str(Path(sys.executable).parent)) or "mpirun"
        cmd = [mpirun, "-np", str(ranks), "--oversubscribe", "--bind-to", "none", *cmd]
    out = subprocess.run(cmd, capture_output=True, text=True, env=ENV, check=True).stdout
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--ranks", default="2")
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--memory-only", action="store_true")
    args = ap.parse_args()
    cores = len(os.sched_getaffinity(0))

    if args.memory_only:
        print("| ranks | resident memory per rank after loading (MiB) |\n|---:|---|")
        for ranks in (int(r) for r in args.ranks.split(",")):
            lines = run(ranks, args, None, ["--batches", "1", "--new-tokens", "1", "--prompt-len", "1"])
            rss = sorted((line["rank"], line["rss_mib"]) for line in lines if "rss_mib" in line)
            print(f"| {ranks} | {', '.join(f'{m:.0f}' for _, m in rss)} |", flush=True)
        return

    ranks = int(args.ranks)
    extra = ["--batches", args.batches, "--new-tokens", str(args.new_tokens)]
    results: dict[tuple[int, int], list[dict]] = {}
    for _ in range(args.repeats):
        for n, threads in ((1, cores), (ranks, max(1, cores // ranks))):
            for line in run(n, args, threads, extra):
                if "batch" in line:
                    results.setdefault((n, line["batch"]), []).append(line)
                    print(n, line, flush=True)
    med = lambda rows, key: statistics.median(r[key] for r in rows)  # noqa: E731
    print(
        f"\n{cores} cores; TP=1 with {cores} threads vs TP={ranks} with {max(1, cores // ranks)} thread(s) per "
        f"rank; {args.new_tokens} new tokens; median of {args.repeats}\n"
    )
    print(
        "| batch | TP=1 tok/s | TP=%d tok/s | TP=%d/TP=1 | TP=%d iteration ms | all-reduce ms/iteration "
        "(calls) | all-reduce share |" % (ranks, ranks, ranks)
    )
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for b in sorted({b for _, b in results}):
        one, many = results[(1, b)], results[(ranks, b)]
        it, ar = med(many, "iter_ms"), med(many, "allreduce_ms_per_iter")
        print(
            f"| {b} | {med(one, 'tok_s'):.0f} | {med(many, 'tok_s'):.0f} | "
            f"{med(many, 'tok_s') / med(one, 'tok_s'):.2f}x | {it:.1f} | {ar:.2f} "
            f"({med(many, 'allreduce_calls_per_iter'):.0f}) | {100 * ar / it:.0f}% |"
        )


if __name__ == "__main__":
    main()
