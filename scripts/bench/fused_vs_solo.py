#!/usr/bin/env python3
"""How often a request's greedy tokens differ between a fused run and running it alone.

    python scripts/bench/fused_vs_solo.py --model models/SmolLM2-135M-Instruct.Q4_1.gguf --dtype bfloat16

In float64 the answer is "never" (tests/test_engine.py asserts it). In float32 and bfloat16 the
batch changes the GEMM shapes, hence the rounding, and a near-tie between two tokens can flip
(with --quantization, alone means the quantized kernel and fused the 16-bit one: more flips);
after the first different token the rest of a greedy continuation differs too. This measures
the share of requests that differ at all and where they first diverge.
"""

from __future__ import annotations

import argparse
import random
import statistics

from flover import Engine, EngineConfig, SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--quantization", default="none", help="none, int8, int4 (with --dtype bfloat16)")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--gen-len", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(1000, 40000) for _ in range(args.prompt_len)] for _ in range(args.requests)]
    arrivals = sorted(rng.randrange(0, 3 * args.gen_len) for _ in prompts)  # iteration at which each joins
    params = SamplingParams(max_new_tokens=args.gen_len, ignore_eos=True)
    max_len = args.prompt_len + args.gen_len + 8

    options = dict(dtype=args.dtype, quantization=args.quantization, max_seq_len=max_len)
    fused = Engine(EngineConfig(args.model, max_slots=args.requests, **options))
    finals, it, pending = {}, 0, list(enumerate(zip(arrivals, prompts)))
    while pending or fused.has_unfinished():
        while pending and pending[0][1][0] <= it:
            i, (_, prompt) = pending.pop(0)
            fused.add_request(prompt, params, request_id=str(i))
        for out in fused.step():
            if out.finished:
                finals[int(out.request_id)] = out.token_ids
        it += 1
    solo_engine = Engine(EngineConfig(args.model, max_slots=1, **options))
    first_diff = []
    for i, prompt in enumerate(prompts):
        solo_engine.add_request(prompt, params)
        solo = []
        while solo_engine.has_unfinished():
            for out in solo_engine.step():
                if out.finished:
                    solo = out.token_ids
        diff = next((k for k, (a, b) in enumerate(zip(solo, finals[i])) if a != b), None)
        if diff is not None:
            first_diff.append(diff)
    n = len(prompts)
    where = f", first difference at token {statistics.median(first_diff):.0f} (median)" if first_diff else ""
    weights = f" ({args.quantization} weights)" if args.quantization != "none" else ""
    print(
        f"{args.dtype}{weights}: {len(first_diff)} of {n} requests ({100 * len(first_diff) / n:.0f}%) differ between "
        f"fused and solo{where}"
    )


if __name__ == "__main__":
    main()
