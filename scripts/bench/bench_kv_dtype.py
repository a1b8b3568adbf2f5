#!/usr/bin/env python3
"""One stream's time per output token at a long context, by --kv-dtype (issue 64: codes at most
1.1x the model dtype's KV at 4k), in one process: an engine per kind, the same prompt of random
ids, rounds alternating between them.

    python scripts/bench/bench_kv_dtype.py --model F.gguf --context 4096 --rounds 3

Each round: a --context-token prompt prefilled, then --tokens greedy tokens (no speculation);
the round's figure is the median decode step (ab_native.run_round's), and the wall time of the
same prompt's prefill alone (one token out). Reported per kind: the medians of the rounds, their
ratios to the model dtype's, and the KV bytes a token.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

from flover import Engine, EngineConfig, SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ab_native import run_round  # (the median of the iterations where every row decodes)


def prefill_seconds(engine: Engine, prompt: list[int], tag: str) -> float:
    """Wall time of the prompt's prefill and its one token."""
    start = time.perf_counter()
    engine.add_request(prompt, SamplingParams(max_new_tokens=1, ignore_eos=True), request_id=tag)
    while engine.has_unfinished():
        engine.step()
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--kinds", default="auto,q8_0,q4_0")
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    kinds = args.kinds.split(";") if ";" in args.kinds else args.kinds.split(",")
    seq = args.context + args.tokens + 16
    engines = {
        k: Engine(EngineConfig(args.model, kv_dtype=k, max_slots=1, max_seq_len=seq, speculate=0, prefix_cache_mib=0))
        for k in kinds
    }
    rng = random.Random(0)
    prompt = [rng.randrange(100, 30000) for _ in range(args.context)]
    ms, prefill = {k: [] for k in kinds}, {k: [] for k in kinds}
    for r in range(args.rounds):
        for k in kinds if r % 2 == 0 else kinds[::-1]:
            ms[k].append(1000 * run_round(engines[k], [prompt], args.tokens, f"{k}-{r}")[0])
            prefill[k].append(prefill_seconds(engines[k], prompt, f"{k}-{r}-prefill"))
            print(f"round {r + 1} {k}: {ms[k][-1]:.2f} ms a token, prefill {prefill[k][-1]:.2f} s", flush=True)
    base, base_prefill = statistics.median(ms[kinds[0]]), statistics.median(prefill[kinds[0]])
    print(f"\none stream at {args.context} tokens of context, {args.model}")
    print(f"| KV | bytes a token | TPOT (median of rounds) | against {kinds[0]} | prefill | against {kinds[0]} |")
    print("|---|---:|---:|---:|---:|---:|")
    for k in kinds:
        m, f = statistics.median(ms[k]), statistics.median(prefill[k])
        print(
            f"| {k} | {engines[k].stats().kv_bytes_per_token} | {m:.2f} ms | {m / base:.3f}x "
            f"| {f:.2f} s | {f / base_prefill:.3f}x |"
        )


if __name__ == "__main__":
    main()
