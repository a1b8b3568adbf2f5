#!/usr/bin/env python3
"""What --kv-dtype's codes cost against the model dtype's KV (issue 64's table).

    python scripts/experiments/kv_dtype_quality.py --model ~/.cache/flover-tests/SmolLM2-135M-Instruct.Q4_1.gguf

One engine per KV kind (the native step, --dtype; the same file and weights): the model dtype's
KV writes a greedy continuation of each chat prompt (quant_accuracy.py's 16; a model without a
chat template gets their bytes' ids); each other kind scores the same prompt + continuation
(teacher forcing: every position reads the codes of the positions before it) and generates
greedily. Reported: top-1 agreement with the reference's next token, mean KL(reference ‖ kind),
the logits' relative error (|Δ| / |logits|, median and max over positions), and the greedy runs
equal to the reference's.
"""

from __future__ import annotations

import argparse

from quant_accuracy import PROMPTS, against_reference, greedy  # (this directory's: the same prompts, runs, scores)

from flover import Engine, EngineConfig

KINDS = ["auto", "q8_0", "q4_0", "q8_0,q4_0"]


def prompt_ids(engine: Engine) -> list[list[int]]:
    tokenizer = engine.tokenizer
    if tokenizer is not None and tokenizer.chat_template_source is not None:
        return [tokenizer.encode_chat([{"role": "user", "content": p}]) for p in PROMPTS]
    vocab = engine.model_config.vocab_size
    return [[(3 + b) % vocab for b in p.encode()] for p in PROMPTS]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--new-tokens", type=int, default=64)
    args = ap.parse_args()
    engines = {
        kind: Engine(EngineConfig(args.model, dtype=args.dtype, kv_dtype=kind, max_slots=len(PROMPTS), max_seq_len=512))
        for kind in KINDS
    }
    reference_engine = engines["auto"]
    prompts = prompt_ids(reference_engine)
    reference = greedy(reference_engine, prompts, args.new_tokens)
    ref_logits = [reference_engine.score(p + r)[len(p) - 1 : -1].double() for p, r in zip(prompts, reference)]
    kv = {k: e.stats().kv_bytes_per_token for k, e in engines.items()}
    print(f"{args.model}, {args.dtype}, {len(prompts)} prompts, {args.new_tokens} greedy tokens each\n")
    print("| KV (K, V) | bytes a token | top-1 agreement | mean KL(dtype's KV ‖ codes) ", end="")
    print("| logit error median / max | greedy runs equal |")
    print("|---|---:|---:|---:|---:|---:|")
    for kind, engine in engines.items():
        cells = against_reference(engine, prompts, reference, ref_logits, args.new_tokens)
        print(f"| {args.dtype if kind == 'auto' else kind} | {kv[kind]} | {cells} |", flush=True)


if __name__ == "__main__":
    main()
