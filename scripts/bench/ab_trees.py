#!/usr/bin/env python3
"""Two checkouts of flover side by side on one model: the same workload run by each tree in turn
(fresh processes, the order alternating every round), for a change that must keep tokens and speed
(a refactor). Each run: --requests greedy requests of --prompt-len random ids, --gen-len tokens
each, all at once, no speculation; its figure is output tokens per second of the whole run. The
two trees must give the same tokens (a round where they do not fails the run).

    git worktree add /tmp/base <commit>
    python scripts/bench/ab_trees.py --base /tmp/base --model ~/.cache/flover-tests/SmolLM2-135M-Instruct.Q4_1.gguf

Prints each round and the medians; a ratio near 1 within the rounds' spread is "the same speed".
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

RUN = """
import json, random, sys, time
from flover import LLM, SamplingParams
model, requests, prompt_len, gen_len, dtype = sys.argv[1:6]
llm = LLM(model, dtype=dtype, speculate=0, max_slots=int(requests))
vocab = llm.engine.model_config.vocab_size
rng = random.Random(0)
prompts = [[rng.randrange(vocab) for _ in range(int(prompt_len))] for _ in range(int(requests))]
params = SamplingParams(max_new_tokens=int(gen_len), ignore_eos=True)
llm.generate(prompts[:2], SamplingParams(max_new_tokens=4, ignore_eos=True))  # warm-up (the native build)
start = time.perf_counter()
outs = llm.generate(prompts, params)
seconds = time.perf_counter() - start
print(json.dumps({"tok_s": sum(len(o.token_ids) for o in outs) / seconds, "tokens": [o.token_ids for o in outs]}))
"""


def run(tree: Path, args) -> dict:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    cmd = [
        sys.executable,
        "-c",
        RUN,
        args.model,
        str(args.requests),
        str(args.prompt_len),
        str(args.gen_len),
        args.dtype,
    ]
    done = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", type=Path, required=True, help="the other checkout (the tree before the change)")
    ap.add_argument("--model", required=True)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--gen-len", type=int, default=64)
    ap.add_argument("--dtype", default="auto")
    args = ap.parse_args()
    trees = {"base": args.base.resolve(), "this": Path(__file__).resolve().parents[2]}
    figures: dict[str, list[float]] = {"base": [], "this": []}
    for k in range(args.rounds):
        order = ("base", "this") if k % 2 == 0 else ("this", "base")
        results = {name: run(trees[name], args) for name in order}
        if results["base"]["tokens"] != results["this"]["tokens"]:
            sys.exit(f"round {k}: the two trees gave different tokens")
        for name in order:
            figures[name].append(results[name]["tok_s"])
        print(f"round {k}: base {results['base']['tok_s']:.1f} tok/s, this {results['this']['tok_s']:.1f} tok/s")
    base, this = statistics.median(figures["base"]), statistics.median(figures["this"])
    print(f"median of {args.rounds}: base {base:.1f} tok/s, this {this:.1f} tok/s, this / base {this / base:.3f}")


if __name__ == "__main__":
    main()
