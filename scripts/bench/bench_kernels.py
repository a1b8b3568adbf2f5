#!/usr/bin/env python3
"""The native step's kernel families side by side on this CPU, in-process (no server).

    python scripts/bench/bench_kernels.py --model ~/.cache/flover-tests/SmolLM2-135M-Instruct.Q4_1.gguf

For every family this CPU executes (flover/native/simd.h; or --families) and every weight format
asked (--formats: float32, bfloat16, bfloat16+int8, bfloat16+int4), one engine each: a single
greedy stream (decode tok/s after its prompt) and 32 streams at once (tokens/s of the whole
batch). Rounds alternate over the engines; the medians are printed as a markdown table, with
the bandwidth one stream reaches (weight bytes per token x tokens/s).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from flover import Engine, EngineConfig, SamplingParams
from flover.native.build import runnable_families

FORMATS = {
    "float32": ("float32", "none"),
    "bfloat16": ("bfloat16", "none"),
    "int8": ("bfloat16", "int8"),
    "int4": ("bfloat16", "int4"),
}
BYTES_PER_WEIGHT = {
    "float32": 4,
    "bfloat16": 2,
    "int8": 1 + 4 / 576,
    "int4": 0.5 + 8 / 32,
}  # int4: float32 scale and zero per 32


def decode_rate(engine: Engine, prompts: list[list[int]], new_tokens: int) -> float:
    """Output tokens per second from the first decode iteration on (prompts prefilled first)."""
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(p, params, request_id=f"{time.monotonic_ns()}-{i}")
    engine.step()  # the prompts (one iteration: they fit the token budget)
    started, tokens = time.perf_counter(), 0
    while engine.has_unfinished():
        tokens += sum(len(o.new_token_ids) for o in engine.step())
    return tokens / (time.perf_counter() - started)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--families", default=",".join(runnable_families()))
    ap.add_argument("--formats", default="float32,bfloat16,int8,int4")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--batch", type=int, default=32)
    args = ap.parse_args()
    rng = random.Random(0)
    prompts = [[rng.randrange(1000, 40000) for _ in range(32)] for _ in range(args.batch)]
    engines = {}
    for family in args.families.split(","):
        for fmt in args.formats.split(","):
            dtype, quantization = FORMATS[fmt]
            engines[family, fmt] = Engine(
                EngineConfig(
                    args.model,
                    dtype=dtype,
                    quantization=quantization,
                    max_slots=args.batch,
                    max_seq_len=160,
                    speculate=0,
                    max_batch_tokens=max(512, 32 * args.batch),
                    native_kernels=family,
                )
            )
            assert engines[family, fmt].runner.native is not None, (family, fmt)
    one: dict = {key: [] for key in engines}
    many: dict = {key: [] for key in engines}
    for _ in range(args.rounds):
        for key, engine in engines.items():
            one[key].append(decode_rate(engine, prompts[:1], args.new_tokens))
            many[key].append(decode_rate(engine, prompts, args.new_tokens))
    cfg = next(iter(engines.values())).runner.model.cfg  # the weights one token reads: projections and head
    width = cfg.num_heads * cfg.head_dim + 2 * cfg.num_kv_heads * cfg.head_dim
    params = (
        cfg.num_layers
        * (
            cfg.hidden_size * width
            + cfg.num_heads * cfg.head_dim * cfg.hidden_size
            + 3 * cfg.hidden_size * cfg.intermediate_size
        )
        + cfg.vocab_size * cfg.hidden_size
    )
    print(f"| family | weights | 1 stream tok/s | GB/s read | {args.batch} streams tok/s |")
    print("|---|---|---:|---:|---:|")
    for (family, fmt), engine in engines.items():
        rate = statistics.median(one[family, fmt])
        gbs = rate * params * BYTES_PER_WEIGHT[fmt] / 1e9
        print(
            f"| {engine.runner.native.kernels} | {fmt} | {rate:.1f} | {gbs:.1f} | "
            f"{statistics.median(many[family, fmt]):.0f} |"
        )


if __name__ == "__main__":
    main()
