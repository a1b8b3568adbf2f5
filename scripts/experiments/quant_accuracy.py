#!/usr/bin/env python3
"""How close bfloat16 and the weight-only quantized modes stay to float32 on a real model.

    python scripts/experiments/quant_accuracy.py --model ~/.cache/flover-tests/SmolLM2-135M-Instruct.Q4_1.gguf

float32 writes a greedy continuation of each chat prompt; every other mode then scores the same
prompt + continuation (teacher forcing) and generates greedily itself. Reported per mode: top-1
agreement with float32's next-token choice over the continuation positions, the mean KL divergence
KL(float32 || mode) of the next-token distributions, the perplexity of float32's continuation,
and how many greedy generations equal float32's token for token.
"""

from __future__ import annotations

import argparse
import math

import torch

from flover import Engine, EngineConfig, SamplingParams

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about autumn leaves.",
    "Explain photosynthesis simply.",
    "List three uses of a paperclip.",
    "How do I boil an egg?",
    "What is 17 times 23?",
    "Give me a tip for learning to code.",
    "Why is the sky blue?",
    "Describe a cat to someone who never saw one.",
    "What should I pack for a beach trip?",
    "Summarize the plot of Cinderella.",
    "Translate 'good morning' to Spanish.",
    "Name a famous painter and one of their works.",
    "What is a prime number?",
    "How does a bicycle stay upright?",
    "Suggest a name for a pet goldfish.",
]
MODES = [("float32", "none"), ("bfloat16", "none"), ("bfloat16", "int8"), ("bfloat16", "int4")]


def engine(model: str, dtype: str, quantization: str, threads: int | None) -> Engine:
    return Engine(
        EngineConfig(
            model, dtype=dtype, quantization=quantization, max_slots=len(PROMPTS), max_seq_len=512, num_threads=threads
        )
    )


def greedy(e: Engine, prompts: list[list[int]], new: int) -> list[list[int]]:
    params = SamplingParams(max_new_tokens=new, ignore_eos=True)
    ids = [e.add_request(p, params) for p in prompts]
    done = {}
    while len(done) < len(ids):
        for out in e.step():
            if out.finished:
                done[out.request_id] = list(out.token_ids)
    return [done[i] for i in ids]


def against_reference(
    e: Engine, prompts: list[list[int]], reference: list[list[int]], ref_logits: list[torch.Tensor], new: int
) -> str:
    """One way scored on the reference's sequences (teacher forcing) and run greedily: the table's
    cells "top-1 agreement | mean KL(reference ‖ way) | logit error median / max | greedy runs equal"."""
    agree = total = 0
    kl, errors = 0.0, []
    for p, r, ref in zip(prompts, reference, ref_logits):
        logits = e.score(p + r)[len(p) - 1 : -1].double()
        lp, ref_lp = torch.log_softmax(logits, -1), torch.log_softmax(ref, -1)
        agree += int((lp.argmax(-1) == ref_lp.argmax(-1)).sum())
        total += len(r)
        kl += float((ref_lp.exp() * (ref_lp - lp)).sum())
        errors += ((logits - ref).norm(dim=-1) / ref.norm(dim=-1)).tolist()
    same = sum(g == r for g, r in zip(greedy(e, prompts, new), reference))
    errors.sort()
    return (
        f"{agree / total:.1%} | {kl / total:.5f} | {errors[len(errors) // 2]:.2%} / {errors[-1]:.2%} | "
        f"{same}/{len(prompts)}"
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    base = engine(args.model, "float32", "none", args.threads)
    prompts = [base.tokenizer.encode_chat([{"role": "user", "content": p}]) for p in PROMPTS]
    reference = greedy(base, prompts, args.new_tokens)
    ref_logprobs = [
        torch.log_softmax(base.score(p + r)[len(p) - 1 : -1].double(), -1) for p, r in zip(prompts, reference)
    ]
    del base
    print(f"{len(PROMPTS)} chat prompts, {args.new_tokens} greedy tokens each (float32's continuation scored)\n")
    print("| dtype | weights | top-1 agreement | mean KL(f32 ‖ mode) | perplexity | greedy runs equal to float32 |")
    print("|---|---|---:|---:|---:|---:|")
    for dtype, quantization in MODES:
        e = engine(args.model, dtype, quantization, args.threads)
        agree = total = 0
        kl = nll = 0.0
        for p, r, ref in zip(prompts, reference, ref_logprobs):
            lp = torch.log_softmax(e.score(p + r)[len(p) - 1 : -1].double(), -1)  # [new, vocab]
            agree += int((lp.argmax(-1) == ref.argmax(-1)).sum())
            total += len(r)
            kl += float((ref.exp() * (ref - lp)).sum())
            nll -= float(lp.gather(1, torch.tensor(r)[:, None]).sum())
        same = sum(g == r for g, r in zip(greedy(e, prompts, args.new_tokens), reference))
        print(
            f"| {dtype} | {quantization} | {agree / total:.1%} | {kl / total:.5f} | {math.exp(nll / total):.3f} "
            f"| {same}/{len(prompts)} |",
            flush=True,
        )
        del e


if __name__ == "__main__":
    main()
