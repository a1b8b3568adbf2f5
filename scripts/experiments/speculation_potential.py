#!/usr/bin/env python3
"""How many iterations prompt-lookup (n-gram) speculation would save, measured on greedy outputs.

    python scripts/experiments/speculation_potential.py --model ~/.cache/flover-tests/SmolLM2-135M-Instruct.Q4_1.gguf

This sized flover's speculation (flover/engine/speculation.py) before it was built; it replays fixed
drafts of k tokens, not the engine's rule (docs/journal.md (h)). Each request is generated
greedily without speculation, then replayed: at every iteration the draft is the k tokens that
followed the latest earlier occurrence of the last n tokens (prompt and output so far), the
verification accepts the draft's longest prefix that equals the real output, and the iteration
yields that many tokens plus one (the verifier's own). Greedy verification gives the same tokens
as decoding one by one, so only the counts change: iterations per request (128 without it) and rows
per request (1 + the draft per iteration: what the forward pays for).

Two prompt sets: the side-by-side benchmark's (64 random token ids, EOS ignored: a small model
soon repeats itself there), and plain chat questions through the chat template (EOS ends them).
"""

from __future__ import annotations

import argparse
import random
import statistics

from flover import LLM, SamplingParams

QUESTIONS = [
    "Explain how a refrigerator keeps food cold.",
    "Write a short poem about the sea.",
    "What is the capital of France, and what is it known for?",
    "Give three tips for learning a new language.",
    "Summarize this: The city council met on Tuesday to discuss the new park. Residents asked for "
    "more trees, a playground and longer opening hours. The council agreed to plant trees this year "
    "and to study the playground.",
    "Rewrite this sentence politely: Send me the report now.",
    "What is the difference between weather and climate?",
    "List the planets of the solar system in order.",
    "How do I make a cup of tea?",
    "Translate to French: The cat sleeps on the warm chair.",
    "Why is the sky blue?",
    "Write a Python function that returns the sum of a list.",
    "Describe a good morning routine.",
    "What does a librarian do?",
    "Correct the grammar: She don't like apples and he have two dogs.",
    "Explain what a verb is, with examples.",
]


def replay(prompt: list[int], output: list[int], n: int, k: int) -> tuple[int, int]:
    """(iterations, rows) to produce `output` with n-gram drafts of up to k tokens."""
    history, done, iterations, rows = list(prompt), 0, 0, 0
    while done < len(output):
        draft: list[int] = []
        if len(history) > n:
            key = history[-n:]
            for start in range(len(history) - n - 1, -1, -1):  # the latest earlier occurrence
                if history[start : start + n] == key:
                    draft = history[start + n : start + n + k]
                    break
        accepted = 0
        while accepted < len(draft) and done + accepted < len(output) and draft[accepted] == output[done + accepted]:
            accepted += 1
        step = min(accepted + 1, len(output) - done)
        history += output[done : done + step]
        done += step
        iterations += 1
        rows += 1 + len(draft)
    return iterations, rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--gen-len", type=int, default=128)
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    llm = LLM(args.model, dtype=args.dtype, max_slots=args.requests, max_seq_len=384, speculate=0)
    rng = random.Random(args.seed)
    sets = {
        "random ids, EOS ignored": (
            [[rng.randrange(1000, 40000) for _ in range(64)] for _ in range(args.requests)],
            SamplingParams(max_new_tokens=args.gen_len, ignore_eos=True),
        ),
        "chat questions": (
            [llm.tokenizer.encode_chat([{"role": "user", "content": q}]) for q in QUESTIONS],
            SamplingParams(max_new_tokens=args.gen_len),
        ),
    }
    print("| prompts | n | k | tokens / request | iterations / request | tokens / iteration | rows / token |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, (prompts, params) in sets.items():
        outputs = [o.token_ids for o in llm.generate(prompts, params)]
        tokens = sum(len(o) for o in outputs)
        for n, k in ((2, 4), (3, 4), (3, 8)):
            counts = [replay(p, o, n, k) for p, o in zip(prompts, outputs)]
            iterations = sum(c[0] for c in counts)
            rows = sum(c[1] for c in counts)
            print(
                f"| {name} | {n} | {k} | {tokens / len(outputs):.0f} | "
                f"{statistics.mean(c[0] for c in counts):.1f} | {tokens / iterations:.2f} | {rows / tokens:.2f} |"
            )


if __name__ == "__main__":
    main()
