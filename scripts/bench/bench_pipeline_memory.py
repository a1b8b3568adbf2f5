#!/usr/bin/env python3
"""Resident memory of each rank once the model is loaded: one engine against pipeline stages
(docs/pipeline.md). Starts `flover serve` (under mpirun for --pp), waits for "ready", reads every
rank's VmRSS from /proc, stops it.

    python scripts/bench/bench_pipeline_memory.py --model ~/.cache/flover/llama.cpp/llama-1b-Q4_K_M.gguf --pp 1,2,3
"""

from __future__ import annotations

import argparse
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_data_parallel import MPI_ENV


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_rss(proc: subprocess.Popen, ranks: int) -> list[int]:
    """VmRSS (bytes) of each rank: the serving process itself, or mpirun's children by rank."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
            env = (entry / "environ").read_bytes().split(b"\0")
            status = (entry / "status").read_text()
        except OSError:
            continue
        if b"flover.apps.cli" not in cmdline or b"mpirun" in cmdline.split(b"\0")[0]:
            continue
        rank = next((int(v.split(b"=")[1]) for v in env if v.startswith(b"OMPI_COMM_WORLD_RANK=")), 0)
        if ranks == 1 and int(entry.name) != proc.pid:
            continue
        rss = next(int(line.split()[1]) * 1024 for line in status.splitlines() if line.startswith("VmRSS"))
        found[rank] = rss
    return [found[r] for r in sorted(found)]


def measure(model: str, pp: int, extra: list[str]) -> list[int]:
    args = ["-m", "flover.apps.cli", "serve", "--model", model, "--bind", f"tcp://127.0.0.1:{free_port()}", *extra]
    if pp > 1:
        mpirun = shutil.which("mpirun", path=str(Path(sys.executable).parent)) or "mpirun"
        cmd = [mpirun, "-np", str(pp), "--oversubscribe", "--bind-to", "none", sys.executable, *args, "--pp", str(pp)]
        cmd += ["--threads", "1"]
    else:
        cmd = [sys.executable, *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=MPI_ENV)
    try:
        line = proc.stdout.readline()
        if "ready on" not in line:
            raise RuntimeError(proc.stderr.read()[-3000:])
        return rank_rss(proc, pp)
    finally:
        proc.send_signal(signal.SIGUSR1 if pp > 1 else signal.SIGTERM)
        proc.communicate(timeout=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--pp", default="1,2")
    ap.add_argument("--max-slots", default="8")
    ap.add_argument("--max-seq-len", default="1024")
    args = ap.parse_args()
    extra = ["--max-slots", args.max_slots, "--max-seq-len", args.max_seq_len, "--prefix-cache", "0"]
    whole = None
    for pp in (int(p) for p in args.pp.split(",")):
        rss = measure(args.model, pp, extra)
        whole = whole or max(rss)
        shares = " / ".join(f"{r / 2**20:.0f} MiB ({r / whole:.2f}x)" for r in rss)
        print(f"| PP={pp} | {shares} |", flush=True)


if __name__ == "__main__":
    main()
