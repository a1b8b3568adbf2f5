#!/usr/bin/env python3
"""Where the time of one fused decode iteration goes, at N live requests.

    python scripts/experiments/profile_iteration.py --model models/bench-124m --live 32 --iterations 30

Wraps the engine's phases with wall-clock timers (CPU ops are synchronous, so wall time is the
cost): scheduling, memory shuffle, token-matrix build, the forward pass split into projection
GEMMs / attention / everything else in the model (norms, RoPE, KV writes, residuals), sampling,
per-request bookkeeping, and the rest of step() (Python glue). It profiles the PyTorch forward
(`native_forward="off"`): the native step runs an iteration as one call, with nothing to wrap
here (its profile is in docs/journal.md).
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict

from flover import Engine, EngineConfig, SamplingParams
from flover.models import gptj, layers, llama


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--live", type=int, default=32)
    ap.add_argument("--iterations", type=int, default=30)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--quantization", default="none", help="none, int8, int4 (with --dtype bfloat16)")
    args = ap.parse_args()
    engine = Engine(
        EngineConfig(
            args.model,
            dtype=args.dtype,
            max_slots=args.live,
            num_threads=args.threads,
            max_seq_len=512,
            quantization=args.quantization,
            native_forward="off",
        )
    )
    spent = defaultdict(float)
    active = {"on": False}

    def timed(name, fn):
        def wrapper(*a, **kw):
            if not active["on"]:
                return fn(*a, **kw)
            start = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                spent[name] += time.perf_counter() - start

        return wrapper

    engine.scheduler.schedule = timed("scheduling", engine.scheduler.schedule)
    engine.buffer.apply_moves = timed("memory shuffle", engine.buffer.apply_moves)
    engine.runner.build_batch = timed("token-matrix build", engine.runner.build_batch)
    engine.model.forward = timed("forward", engine.model.forward)
    engine.runner.sample = timed("sampling", engine.runner.sample)
    engine.scheduler.update = timed("bookkeeping (tokens, finish checks)", engine.scheduler.update)
    engine.outputs.emit = timed("outputs (text, stop strings)", engine.outputs.emit)
    llama.attention = gptj.attention = timed("forward: attention", llama.attention)
    layers.Linear.forward = timed("forward: projection GEMMs", layers.Linear.forward)

    params = SamplingParams(max_new_tokens=10_000 // 50, ignore_eos=True)
    for r in range(args.live):
        engine.add_request([(7 * r + i) % 1000 + 1 for i in range(64)], params)
    while any(r.prefilling for r in engine.scheduler.requests.values()) or engine.scheduler.waiting:
        engine.step()
    for _ in range(3):
        engine.step()
    active["on"] = True
    start = time.perf_counter()
    for _ in range(args.iterations):
        engine.step()
    total = time.perf_counter() - start
    active["on"] = False

    forward = spent.pop("forward")
    gemm, attention = spent.pop("forward: projection GEMMs"), spent.pop("forward: attention")
    rows = [
        ("forward: projection GEMMs (incl. LM head)", gemm),
        ("forward: attention", attention),
        ("forward: norms, RoPE, KV writes, residuals, embedding", forward - gemm - attention),
    ]
    rows += sorted(spent.items(), key=lambda kv: -kv[1])
    rows.append(("step() glue (Python)", total - forward - sum(spent.values())))
    n = args.iterations
    print(f"{args.live} live requests, {n} decode iterations, {1000 * total / n:.1f} ms per iteration\n")
    print("| part | ms / iteration | share |\n|---|---:|---:|")
    for name, seconds in rows:
        print(f"| {name} | {1000 * seconds / n:.2f} | {seconds / total:.1%} |")


if __name__ == "__main__":
    main()
