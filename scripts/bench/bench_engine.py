#!/usr/bin/env python3
"""Decode throughput of the fused engine against transformers' batched `generate`, side by side.

For each batch size B: B requests (the same prompt length, the same output length, EOS ignored)
all present at the start; output tokens / wall time (prefill included). Both run in this process
with the same weights, dtype and thread count; the runs alternate (ours, theirs, ours, ...) and
the median of --repeats is reported.

    python scripts/bench/bench_engine.py --model models/bench-124m --batches 1,8,32 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch

from flover import LLM, SamplingParams
from flover.config import default_num_threads


def run_flover(llm: LLM, prompts: list[list[int]], new_tokens: int) -> float:
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    wall = time.perf_counter() - start
    assert all(len(o.token_ids) == new_tokens for o in outs)
    return len(prompts) * new_tokens / wall


def run_transformers(model, prompts: list[list[int]], new_tokens: int) -> float:
    ids = torch.tensor(prompts)
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=0,
        )
    wall = time.perf_counter() - start
    assert out.shape[1] == ids.shape[1] + new_tokens
    return len(prompts) * new_tokens / wall


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=default_num_threads())
    ap.add_argument("--json", help="also write the raw figures here")
    args = ap.parse_args()

    import transformers

    batches = [int(b) for b in args.batches.split(",")]
    torch.set_num_threads(args.threads)
    llm = LLM(
        args.model,
        dtype=args.dtype,
        max_slots=max(batches),
        num_threads=args.threads,
        max_seq_len=args.prompt_len + args.new_tokens,
    )
    ref = transformers.AutoModelForCausalLM.from_pretrained(args.model, dtype=getattr(torch, args.dtype)).eval()
    vocab = llm.engine.model_config.vocab_size
    results = {}
    for b in batches:
        prompts = [[(17 * r + 31 * i) % (vocab - 1) + 1 for i in range(args.prompt_len)] for r in range(b)]
        run_flover(llm, prompts[:1], 4)  # warm-up
        ours, theirs = [], []
        for _ in range(args.repeats):
            ours.append(run_flover(llm, prompts, args.new_tokens))
            theirs.append(run_transformers(ref, prompts, args.new_tokens))
        results[b] = {"flover": ours, "transformers": theirs}
        print(
            f"B={b}: flover {statistics.median(ours):.0f} tok/s, transformers {statistics.median(theirs):.0f} "
            f"tok/s, ratio {statistics.median(ours) / statistics.median(theirs):.2f}x",
            flush=True,
        )

    print(
        f"\nmachine: {platform.processor() or platform.machine()}, {args.threads} threads, torch "
        f"{torch.__version__}, transformers {transformers.__version__}; model {args.model} ({args.dtype}); "
        f"prompt {args.prompt_len} tokens, {args.new_tokens} new tokens; median of {args.repeats}\n"
    )
    print("| concurrent requests | flover tok/s | transformers generate tok/s | flover / transformers |")
    print("|---:|---:|---:|---:|")
    for b, r in results.items():
        o, t = statistics.median(r["flover"]), statistics.median(r["transformers"])
        print(f"| {b} | {o:.0f} | {t:.0f} | {o / t:.2f}x |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
