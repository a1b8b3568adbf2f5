#!/usr/bin/env python3
"""What sliding-window layers keeping only their window saves: the same long requests with the
bound (the default) and with --full-window-kv, each in a fresh process, alternating.

    python scripts/bench/bench_window_kv.py --model ~/.cache/flover/llama.cpp/gemma3-1b-Q4_K_M.gguf

Each run loads the model (4 slots of --max-seq-len positions), sends --requests prompts of
--prompt-len random token ids at once (greedy, --gen-len tokens each) and reports the KV cache
allocated, the process's resident memory after loading and after the requests (the KV is taken
page by page as positions are written), and the tokens/s of the whole batch. Medians of --runs.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys

CHILD = r"""
import json, random, sys, time
from flover import LLM, SamplingParams

def rss_mib():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) for l in f if l.startswith("VmRSS:")) / 1024

args = json.loads(sys.argv[1])
llm = LLM(args["model"], max_slots=4, max_seq_len=args["seq_len"], full_window_kv=args["full"], speculate=0)
loaded = rss_mib()
rng = random.Random(args["seed"])
prompts = [[rng.randrange(1000, 40000) for _ in range(args["prompt_len"])] for _ in range(args["requests"])]
start = time.perf_counter()
outs = llm.generate(prompts, SamplingParams(max_new_tokens=args["gen_len"], ignore_eos=True))
seconds = time.perf_counter() - start
print(json.dumps({
    "kv_mib": llm.engine.buffer.nbytes / 2**20,
    "rss_loaded_mib": loaded,
    "rss_after_mib": rss_mib(),
    "tok_s": sum(len(o.token_ids) for o in outs) / seconds,
    "tokens": [o.token_ids for o in outs],
}))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--seq-len", type=int, default=8192)
    ap.add_argument("--prompt-len", type=int, default=6000)
    ap.add_argument("--gen-len", type=int, default=32)
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    results: dict[str, list[dict]] = {"bounded": [], "full": []}
    for run in range(args.runs):
        order = ["bounded", "full"] if run % 2 == 0 else ["full", "bounded"]
        for mode in order:
            spec = dict(vars(args), full=mode == "full", seed=run)
            done = subprocess.run([sys.executable, "-c", CHILD, json.dumps(spec)], capture_output=True, text=True)
            if done.returncode:
                sys.exit(done.stderr[-3000:])
            result = json.loads(done.stdout.strip().splitlines()[-1])
            results[mode].append(result)
            print(
                f"run {run + 1}/{args.runs} {mode:7s}: KV {result['kv_mib']:.0f} MiB allocated, resident "
                f"{result['rss_loaded_mib']:.0f} -> {result['rss_after_mib']:.0f} MiB, {result['tok_s']:.1f} tok/s",
                file=sys.stderr,
            )
        same = results["bounded"][-1]["tokens"] == results["full"][-1]["tokens"]
        print(f"run {run + 1}: the same tokens in both: {same}", file=sys.stderr)
    print(
        f"\n{args.requests} requests x {args.prompt_len}-token prompts + {args.gen_len} out, 4 slots x "
        f"{args.seq_len} positions, medians of {args.runs} alternating runs\n"
    )
    print("| sliding-window layers | KV allocated | resident after load | resident after the requests | tok/s |")
    print("|---|---:|---:|---:|---:|")
    for mode, label in (("bounded", "keep their window (default)"), ("full", "keep every position")):
        med = {k: statistics.median(r[k] for r in results[mode]) for k in ("kv_mib", "rss_loaded_mib", "rss_after_mib")}
        tok_s = statistics.median(r["tok_s"] for r in results[mode])
        print(
            f"| {label} | {med['kv_mib']:.0f} MiB | {med['rss_loaded_mib']:.0f} MiB | "
            f"{med['rss_after_mib']:.0f} MiB | {tok_s:.1f} |"
        )


if __name__ == "__main__":
    random.seed(0)
    main()
