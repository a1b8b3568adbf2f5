#!/usr/bin/env python3
"""Q4_K's int8 tiles on inputs per 32 against per 256, paired on one thread (tile_blocks.c), for a
1B Llama's projection shapes at 1, 8 and 32 rows, with this CPU's kernel family (or --family).

    python scripts/bench/bench_tile_blocks.py --rounds 40

Prints one line per shape and row count: the median time ratio of the pairs (below 1: per 256 is
faster) and its quartiles. The codes fit the L3 cache here, so one row reads them from cache, not
from memory as a decode iteration does.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import tempfile
from pathlib import Path

from flover.native.build import CFLAGS, SOURCES, c_files, kernel_flags

HERE = Path(__file__).resolve().parent
SHAPES = [(16384, 2048), (2048, 2048), (2048, 8192)]  # gate_up, o, down of Llama 3.2 1B


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--family", default=os.environ.get("FLOVER_NATIVE_KERNELS", "auto"))
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--rows", default="32,8,1")
    args = ap.parse_args()
    flags = [f for f in (*CFLAGS, *kernel_flags(args.family)) if f not in ("-shared", "-fPIC", "-fvisibility=hidden")]
    with tempfile.TemporaryDirectory() as tmp:
        binary = Path(tmp) / "tile_blocks"
        sources = [str(HERE / "tile_blocks.c"), *map(str, c_files())]
        subprocess.run(
            [os.environ.get("CC", "cc"), *flags, f"-I{SOURCES}", "-o", str(binary), *sources, "-lm"], check=True
        )
        for n, k in SHAPES:
            for rows in args.rows.split(","):
                env = {**os.environ, "OMP_NUM_THREADS": "1"}
                out = subprocess.run(
                    [str(binary), rows, str(n), str(k), str(args.rounds)], capture_output=True, text=True, env=env
                )
                print(out.stdout.strip() or out.stderr.strip(), flush=True)


if __name__ == "__main__":
    main()
