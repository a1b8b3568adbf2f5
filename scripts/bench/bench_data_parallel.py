"""Data-parallel groups, tensor parallelism and pipeline stages against one engine on the same
cores (docs/data_parallel.md, docs/pipeline.md), and the front door's routing cost.

    python scripts/bench/bench_data_parallel.py --model ~/.cache/flover-tests/SmolLM2-135M-Instruct.Q4_1.gguf

Runs one prompt file of chat questions (EOS honoured, at most --gen-len tokens, arriving Poisson
every --interval-ms on average) through `flover run` in three layouts of the same cores,
alternating, --runs times each: one engine with all the threads; --groups engines of one rank
each (`mpirun -np G --tp 1`, threads split); one engine of G tensor-parallel ranks; one engine of
G pipeline stages (`--pp G`). Prints each run's tok/s (flover run's summary) and the medians.
`--layouts` picks some of them (engine, groups, TP, PP). Then the router's cost per request: the
choice (prefix hashes, least loaded) and the message a request becomes on its way to a group.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_vs_llamacpp import QUESTIONS

MPI_ENV = {
    **os.environ,
    "OMPI_ALLOW_RUN_AS_ROOT": "1",
    "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
    "OMPI_MCA_btl": "self,sm",
    "OMPI_MCA_rmaps_base_oversubscribe": "1",
}


def layouts(groups: int, cores: int) -> dict[str, list[str]]:
    mpirun = [
        shutil.which("mpirun", path=str(Path(sys.executable).parent)) or "mpirun",
        "-np",
        str(groups),
        "--oversubscribe",
        "--bind-to",
        "none",
    ]
    run = [sys.executable, "-m", "flover.apps.cli", "run"]
    return {
        f"1 engine x {cores} threads": [*run, "--threads", str(cores)],
        f"{groups} groups x {cores // groups} thread(s)": [
            *mpirun,
            *run,
            "--tp",
            "1",
            "--threads",
            str(cores // groups),
        ],
        f"TP={groups} x {cores // groups} thread(s)": [*mpirun, *run, "--threads", str(cores // groups)],
        f"PP={groups} x {cores // groups} thread(s)": [
            *mpirun,
            *run,
            "--pp",
            str(groups),
            "--threads",
            str(cores // groups),
        ],
    }


def run_once(cmd: list[str], model: str, prompts: Path, args) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out.jsonl"
        done = subprocess.run(
            [
                *cmd,
                "--model",
                model,
                "--prompts",
                str(prompts),
                "--out",
                str(out),
                "--quiet",
                "--max-new-tokens",
                str(args.gen_len),
                "--arrival",
                "poisson",
                "--rate",
                str(1000 / args.interval_ms),
                "--max-seq-len",
                "1024",
            ],
            capture_output=True,
            text=True,
            env=MPI_ENV,
            timeout=1200,
        )
        if done.returncode != 0:
            raise RuntimeError(done.stderr[-3000:])
        busy = re.search(r"pipeline stages busy ([\d% /]+)", done.stderr)  # (PP: each stage's share at work)
        if busy:
            print(f"  pipeline stages busy {busy.group(1)}", flush=True)
        return float(re.search(r"\(([\d.]+) tok/s", done.stderr).group(1))


def routing_cost(requests: int = 20000) -> None:
    import msgpack

    from flover.config import SamplingParams
    from flover.engine.groups import Router

    router = Router(groups=8, slots=32)
    prompts = [[(7 * i + j) % 49152 for j in range(512)] for i in range(256)]
    params = dataclasses.asdict(SamplingParams(max_new_tokens=128))
    started = time.perf_counter()
    for i in range(requests):
        prompt = prompts[i % len(prompts)]
        group = router.choose(prompt, None)
        router.started(group, 640)
        msgpack.packb({"add": [str(i), prompt, params, None, True, 0.0]})
        router.progressed(group, 128, finished_with=512)
    per = (time.perf_counter() - started) / requests
    print(
        f"routing, per request of 512 prompt tokens over 8 groups (choice + its message): {per * 1e6:.1f} us "
        f"= {1 / per:,.0f} requests/s on one core"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--interval-ms", type=float, default=100)
    ap.add_argument("--gen-len", type=int, default=128)
    ap.add_argument("--groups", type=int, default=2)
    ap.add_argument("--cores", type=int, default=os.cpu_count())
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--layouts", default="engine,groups,TP,PP", help="which layouts (a comma list of those four)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        prompts = Path(tmp) / "chat.jsonl"
        prompts.write_text(
            "".join(
                json.dumps({"id": str(i), "messages": [{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}]})
                + "\n"
                for i in range(args.requests)
            )
        )
        results: dict[str, list[float]] = {}
        wanted = {w.lower() for w in args.layouts.split(",")}
        todo = {
            name: cmd
            for name, cmd in layouts(args.groups, args.cores).items()
            if wanted & set(name.lower().replace("=", " ").split())
        }
        for run in range(args.runs):
            for name, cmd in list(todo.items()):
                try:
                    tps = run_once(cmd, args.model, prompts, args)
                except RuntimeError as e:  # e.g. TP over a head count it does not divide
                    print(f"{name}: cannot run ({next(line for line in str(e).splitlines() if 'error' in line)})")
                    del todo[name]
                    continue
                results.setdefault(name, []).append(tps)
                print(f"run {run + 1}/{args.runs} {name}: {tps:.1f} tok/s", flush=True)
    print(
        f"\n{args.requests} chat requests, Poisson {args.interval_ms:g} ms, at most {args.gen_len} tokens, "
        f"medians of {args.runs} alternating runs:"
    )
    for name, values in results.items():
        print(f"| {name} | {statistics.median(values):.1f} tok/s | {' / '.join(f'{v:.1f}' for v in values)} |")
    routing_cost()


if __name__ == "__main__":
    main()
