#!/usr/bin/env python3
"""The next turn of a long conversation on a model with recurrent layers (Qwen3.5): time to first
token with the prefix cache's state snapshots against without the cache, in one process.

    python scripts/bench/bench_recurrent_prefix.py --model DIR/qwen3.5-2b-Q4_K_M.gguf --history 2048

A conversation of random token ids: a history of --history tokens (earlier turns), answered by
the model (--gen-len tokens), then the next turn: the history, the answer and a new message of
--user-len tokens. Each round runs the first turn on the cached engine (its snapshots taken), then
times the next turn there (max_new_tokens 1: its time to first token) and on an engine without a
cache, alternating which goes first; a fresh conversation every round (no reuse across rounds).
Reports the medians, and checks that both engines answer the next turn with the same tokens.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from flover import LLM, SamplingParams


def timed(llm: LLM, prompt: list[int], tokens: int) -> tuple[float, list[int]]:
    started = time.perf_counter()
    out = llm.generate([prompt], SamplingParams(max_new_tokens=tokens, ignore_eos=True))[0]
    return time.perf_counter() - started, out.token_ids


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--history", type=int, default=2048)
    ap.add_argument("--gen-len", type=int, default=64)
    ap.add_argument("--user-len", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--prefix-cache-mib", type=float, default=256)
    args = ap.parse_args()
    seq = args.history + args.gen_len + args.user_len + 16
    cached = LLM(args.model, max_slots=2, max_seq_len=seq, prefix_cache_mib=args.prefix_cache_mib)
    cold = LLM(args.model, max_slots=2, max_seq_len=seq, prefix_cache_mib=0)
    vocab = cached.engine.model_config.vocab_size
    rng = random.Random(0)
    with_cache, without, same = [], [], 0
    for round_ in range(args.rounds):
        history = [rng.randrange(1000, vocab) for _ in range(args.history)]
        _, answer = timed(cached, history, args.gen_len)
        turn = history + answer + [rng.randrange(1000, vocab) for _ in range(args.user_len)]
        order = [(cached, with_cache), (cold, without)][:: 1 if round_ % 2 else -1]
        for llm, times in order:
            times.append(timed(llm, turn, 1)[0])
        same += timed(cached, turn, 16)[1] == timed(cold, turn, 16)[1]
        print(
            f"round {round_ + 1}: next turn of {len(turn)} tokens, TTFT {with_cache[-1] * 1000:.0f} ms with the "
            f"cache, {without[-1] * 1000:.0f} ms without",
            flush=True,
        )
    a, b = statistics.median(with_cache), statistics.median(without)
    print(
        f"median TTFT of the next turn: {a * 1000:.0f} ms with snapshots, {b * 1000:.0f} ms without "
        f"({b / a:.1f}x); the same 16 tokens in {same}/{args.rounds} rounds"
    )
    print(f"cache: {cached.engine.prefix_cache.stats}")


if __name__ == "__main__":
    main()
