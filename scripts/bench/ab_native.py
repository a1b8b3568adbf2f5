#!/usr/bin/env python3
"""Two builds of the native step side by side in one process: the same engine, the same weights,
the native library swapped between rounds (this tree's and another checkout's), so that both
see the same machine state. On a shared machine whose speed drifts by ±30% from minute to
minute, fresh processes alternating A and B cannot show a 10% change; this can.

    git worktree add /tmp/base HEAD~1
    python scripts/bench/ab_native.py --base /tmp/base --model ~/.cache/flover/llama.cpp/qwen3-moe-1.8b-Q4_K_M.gguf \
        --rows 32 --rounds 10

Each round runs --rows requests of --prompt-len random ids, --gen-len tokens each (greedy, no
speculation), once on each library (which goes first alternates); the round's figure is the
median time of the iterations where exactly --rows rows decode (--prefill: the time of all its
iterations, the prompts to their first token). The two libraries must give the
same tokens (a round where they do not is reported and fails the run), unless
--tokens-may-differ (a change of the numbers: e.g. the inputs' int8 blocks). Only builds whose
structs and work layout Python sees alike can be swapped (the ABI check at load refuses others).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

from flover import Engine, EngineConfig, SamplingParams
from flover.native.abi import load_library


def run_round(
    engine: Engine, prompts: list[list[int]], gen_len: int, tag: str, prefill: bool = False
) -> tuple[float, list[list[int]]]:
    """(median seconds of the full decode iterations, or with `prefill` the seconds of every
    iteration: the prompts' chunks, each request's tokens)"""
    rows = len(prompts)
    for i, prompt in enumerate(prompts):
        engine.add_request(prompt, SamplingParams(max_new_tokens=gen_len, ignore_eos=True), request_id=f"{tag}-{i}")
    seconds, tokens = [], {}
    while engine.has_unfinished():
        decoding = [r for r in engine.scheduler.running if r.num_computed >= len(r.prompt_token_ids)]
        start = time.perf_counter()
        outputs = engine.step()
        took = time.perf_counter() - start
        if len(decoding) == rows or prefill:
            seconds.append(took)
        tokens.update({o.request_id: list(o.token_ids) for o in outputs if o.finished})
    return sum(seconds) if prefill else statistics.median(seconds), [tokens[f"{tag}-{i}"] for i in range(rows)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", required=True, help="another checkout: its flover/native sources are built as B")
    ap.add_argument("--model", required=True)
    ap.add_argument("--rows", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--gen-len", type=int, default=64)
    ap.add_argument("--kernels", default="auto", help="the kernel family both are built for")
    ap.add_argument("--prefill", action="store_true", help="time the prompts to their first token (--gen-len 1)")
    ap.add_argument("--tokens-may-differ", action="store_true", help="the two compute other numbers on purpose")
    args = ap.parse_args()
    if args.prefill:
        args.gen_len = 1

    engine = Engine(
        EngineConfig(
            args.model,
            max_slots=max(args.rows, 4),
            max_seq_len=args.prompt_len + args.gen_len + 8,
            speculate=0,
            prefix_cache_mib=0,  # (the second library would find the first's prompt cached)
        )
    )
    native = engine.runner.native
    if native is None:
        sys.exit("this model does not run on the native step")
    libraries = {"this tree": native.lib, "base": load_library(args.kernels, Path(args.base) / "flover" / "native")}
    rng = random.Random(0)
    times: dict[str, list[float]] = {name: [] for name in libraries}
    differ = 0
    for n in range(args.rounds):
        prompts = [[rng.randrange(1000, 40000) for _ in range(args.prompt_len)] for _ in range(args.rows)]
        order = list(libraries) if n % 2 == 0 else list(reversed(libraries))
        tokens = {}
        for name in order:
            native.lib = libraries[name]
            seconds, tokens[name] = run_round(engine, prompts, args.gen_len, f"{n}-{name}", args.prefill)
            times[name].append(seconds)
        same = tokens["this tree"] == tokens["base"]
        differ += not same
        print(
            f"round {n + 1}: this tree {1e3 * times['this tree'][-1]:.2f} ms, base {1e3 * times['base'][-1]:.2f} ms"
            + ("" if same else "  TOKENS DIFFER"),
            flush=True,
        )
    native.lib = libraries["this tree"]
    mine, base = statistics.median(times["this tree"]), statistics.median(times["base"])
    wins = sum(a < b for a, b in zip(times["this tree"], times["base"]))
    print(
        f"{args.rows} rows: this tree {1e3 * mine:.2f} ms, base {1e3 * base:.2f} ms "
        f"{'a prefill' if args.prefill else 'an iteration'} (medians of "
        f"{args.rounds} rounds): {mine / base:.3f}x the time, faster in {wins} of {args.rounds} rounds"
    )
    return 1 if differ and not args.tokens_may_differ else 0


if __name__ == "__main__":
    sys.exit(main())
