#!/usr/bin/env python3
"""Where a native decode iteration's time goes at 1, 8 and 32 rows (and in a prompt chunk): the
int8 / group tiles, the head, attention, OpenMP's waits and the rest.

    python scripts/bench/iteration_split.py --model ~/.cache/flover/llama.cpp/llama-1b-Q4_K_M.gguf

For each row count n: n requests of --prompt-len random ids decode together (greedy, no
speculation); once all n decode, the iterations with exactly n decode rows are timed (median)
and sampled by `perf record` (this process, user space; not the prompts' chunks). The perf
samples are sorted by symbol into tiles (tiles.c's and tiles_int8.c's kernels), attention
(attention.c), OpenMP (libgomp: barrier waits), the rest of the native step, and Python /
PyTorch outside it. The head is timed apart: the same native head over n rows of hidden states
(its share is inside the tiles' too). A prompt chunk of --prefill tokens is split the same way.
Without perf only the times are printed.
"""

from __future__ import annotations

import argparse
import os
import random
import re
import shutil
import statistics
import subprocess
import tempfile
import time

import torch

from flover import Engine, EngineConfig, SamplingParams

TILE = re.compile(r"(_x8_\d+|_k256_\d+|^tile_|^blocks?_|_tile|tile_x8|^signed_x8|^bytes_)")
ATTENTION = re.compile(r"(attend|score_keys|weigh_values|keys_|pv_block|softmax)")


def classify(symbol: str, dso: str) -> str:
    if "libgomp" in dso:
        return "openmp"
    if not dso.startswith("llama_forward"):  # (the native library's file name)
        return "outside"
    if TILE.search(symbol):
        return "tiles"
    if ATTENTION.search(symbol):
        return "attention"
    return "native rest"


def perf_shares(data: str) -> dict[str, float]:
    report = subprocess.run(
        ["perf", "report", "-i", data, "--no-children", "--sort", "dso,sym", "--stdio", "-q"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    shares: dict[str, float] = {}
    for line in report.splitlines():
        m = re.match(r"\s*([\d.]+)%\s+(\S+)\s+\[\.\]\s+(.*)", line)
        if m:
            kind = classify(m.group(3).strip(), m.group(2))
            shares[kind] = shares.get(kind, 0.0) + float(m.group(1))
    return shares


class Sampler:
    """perf record of this process while the block runs (nothing when perf is missing)."""

    def __init__(self, data: str) -> None:
        self.data, self.proc = data, None

    def __enter__(self) -> Sampler:
        if shutil.which("perf"):
            self.proc = subprocess.Popen(
                ["perf", "record", "-q", "-F", "1999", "-o", self.data, "-p", str(os.getpid())],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            time.sleep(0.5)
        return self

    def __exit__(self, *exc) -> None:
        if self.proc is not None:
            self.proc.send_signal(2)
            self.proc.wait()


def decoding_rows(engine: Engine) -> int:
    return sum(r.num_computed >= len(r.prompt_token_ids) for r in engine.scheduler.running)


def start_decoding(engine: Engine, rows: int, prompt_len: int, iterations: int, rng: random.Random) -> None:
    """rows requests of prompt_len random ids, stepped until all of them decode (their prompts
    done, outside the timings and the samples)."""
    params = SamplingParams(max_new_tokens=iterations + 2, ignore_eos=True)
    for i in range(rows):
        prompt = [rng.randrange(1000, 30000) for _ in range(prompt_len)]
        engine.add_request(prompt, params, request_id=f"{rows}-{i}-{time.monotonic_ns()}")
    while engine.has_unfinished() and decoding_rows(engine) < rows:
        engine.step()


def decode_times(engine: Engine, rows: int) -> list[float]:
    """The time of each remaining iteration where exactly `rows` rows decode."""
    seconds = []
    while engine.has_unfinished():
        decoding = decoding_rows(engine)
        start = time.perf_counter()
        engine.step()
        if decoding == rows:
            seconds.append(time.perf_counter() - start)
    return seconds


def head_seconds(native, rows: int, hidden: int, repeats: int) -> float:
    x = torch.randn(rows, hidden) * 0.5
    took = []
    for _ in range(repeats):
        start = time.perf_counter()
        native.head(x, greedy=True)
        took.append(time.perf_counter() - start)
    return statistics.median(took)


def row(label: str, ms: float, head_ms: float | None, shares: dict[str, float]) -> str:
    cells = [f"{shares.get(k, 0.0):.0f}%" for k in ("tiles", "attention", "openmp", "native rest", "outside")]
    head = f"{head_ms:.1f} ({100 * head_ms / ms:.0f}%)" if head_ms is not None else "-"
    return f"| {label} | {ms:.1f} | {head} | " + " | ".join(cells) + " |"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--rows", default="1,8,32")
    ap.add_argument("--iterations", type=int, default=24)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--prefill", type=int, default=512, help="tokens of the prompt chunk measured (0: none)")
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    counts = [int(n) for n in args.rows.split(",")]
    engine = Engine(
        EngineConfig(
            args.model,
            max_slots=max(counts),
            max_seq_len=max(args.prompt_len + args.iterations + 8, args.prefill + 8),
            speculate=0,
            num_threads=args.threads,
            prefix_cache_mib=0,
            max_batch_tokens=max(512, args.prefill),
        )
    )
    native = engine.runner.native
    if native is None:
        raise SystemExit("this model does not run on the native step")
    rng = random.Random(0)
    start_decoding(engine, 2, 8, 2, rng)  # (warm up)
    decode_times(engine, 2)
    print("| rows | ms an iteration | head ms (share) | tiles | attention | OpenMP waits | native rest | outside |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    with tempfile.TemporaryDirectory() as tmp:
        for n in counts:
            data = f"{tmp}/{n}.data"
            start_decoding(engine, n, args.prompt_len, args.iterations, rng)
            with Sampler(data) as sampler:  # (the decode iterations only: prompt chunks are measured apart)
                seconds = decode_times(engine, n)
            shares = perf_shares(data) if sampler.proc is not None else {}
            head = head_seconds(native, n, engine.model.cfg.hidden_size, 9)
            print(row(f"{n} decoding", 1e3 * statistics.median(seconds), 1e3 * head, shares), flush=True)
        if args.prefill:
            data = f"{tmp}/prefill.data"
            params = SamplingParams(max_new_tokens=1, ignore_eos=True)
            took = []
            with Sampler(data) as sampler:
                for r in range(3):
                    engine.add_request([rng.randrange(1000, 30000) for _ in range(args.prefill)], params, f"p{r}")
                    start = time.perf_counter()
                    while engine.has_unfinished():
                        engine.step()
                    took.append(time.perf_counter() - start)
            shares = perf_shares(data) if sampler.proc is not None else {}
            print(row(f"{args.prefill}-token prompt", 1e3 * statistics.median(took), None, shares), flush=True)


if __name__ == "__main__":
    main()
