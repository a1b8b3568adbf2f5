#!/usr/bin/env python3
"""`flover run` on a prompt file: temporal fusion (--max-slots 32) against the same file processed
one prompt at a time (--max-slots 1), side by side, as real `flover run` processes.

    python scripts/bench/bench_prompt_file.py --model models/bench-124m --prompts 256 --new-tokens 32 --repeats 3

Reports the summary line's output tokens/s (wall time of the run, model loading excluded); the
runs alternate and the median is given.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

WORDS = "the a of river cat engine batch token memory light fast slow city train poem night rain code".split()


def make_prompt_file(path: Path, count: int, seed: int) -> None:
    rng = random.Random(seed)
    with open(path, "w") as f:
        for i in range(count):
            f.write(json.dumps({"id": i, "prompt": " ".join(rng.choices(WORDS, k=rng.randint(8, 64)))}) + "\n")


def flover_run(model: str, prompts: Path, slots: int, new_tokens: int, threads: int | None) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [
            sys.executable,
            "-m",
            "flover.apps.cli",
            "run",
            "--model",
            model,
            "--prompts",
            str(prompts),
            "--out",
            f"{tmp}/out.jsonl",
            "--max-slots",
            str(slots),
            "--max-new-tokens",
            str(new_tokens),
            "--ignore-eos",
            "--quiet",
        ]
        if threads:
            cmd += ["--threads", str(threads)]
        run = subprocess.run(cmd, capture_output=True, text=True, check=True)
        with open(f"{tmp}/out.jsonl") as f:
            assert sum(1 for _ in f) == sum(1 for _ in open(prompts))
    return float(re.search(r"\(([\d.]+) tok/s", run.stderr).group(1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--prompts", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        prompts = Path(tmp) / "prompts.jsonl"
        make_prompt_file(prompts, args.prompts, seed=0)
        fused, serial = [], []
        for _ in range(args.repeats):
            fused.append(flover_run(args.model, prompts, 32, args.new_tokens, args.threads))
            serial.append(flover_run(args.model, prompts, 1, args.new_tokens, args.threads))
            print(f"fused {fused[-1]:.0f} tok/s, one at a time {serial[-1]:.0f} tok/s", flush=True)
    f, s = statistics.median(fused), statistics.median(serial)
    print(f"\n{args.prompts} prompts (8-64 words), {args.new_tokens} new tokens each, median of {args.repeats}")
    print("| mode | output tok/s |\n|---|---:|")
    print(f"| flover run (temporal fusion, 32 slots) | {f:.0f} |\n| one prompt at a time | {s:.0f} |")
    print(f"| ratio | {f / s:.1f}x |")


if __name__ == "__main__":
    main()
