#!/usr/bin/env python3
"""What quantizing a file's projection inputs to int8 costs, per 32 inputs (llama.cpp's Q8_0
rows) against per 256 (its Q8_K rows, which flover's Q4_K and Q6_K tiles take: tiles_int8.c's x8_block).

    python scripts/experiments/int8_input_blocks.py --model smollm2-Q4_K_M.gguf

One bfloat16 engine on the file's codes, its PyTorch forward (the native step's reference,
models/quant.py's int8_inputs), scored three ways by switching the blocks its projections
quantize their inputs in: none (the float path), 32 everywhere (before), and as this tree
quantizes them (32, or 256 where every run is Q4_K's or Q6_K's: after); then the native step itself. The
float path writes a greedy continuation of each chat prompt; every other way scores the same
prompt + continuation (teacher forcing) and generates greedily. Reported: top-1 agreement with
the float path's next token, mean KL(float ‖ way), the logits' relative error (|Δ| / |logits|,
median and max over positions), and the greedy runs equal to the float path's.
"""

from __future__ import annotations

import argparse

from quant_accuracy import PROMPTS, against_reference, greedy  # (this directory's: the same prompts, runs, scores)

from flover import Engine, EngineConfig
from flover.models.layers import Linear


def set_blocks(engine: Engine, way: str, kept: dict[str, int]) -> None:
    """The projections' int8 input blocks: none, 32 everywhere, or this tree's."""
    for name, module in engine.model.named_modules():
        if isinstance(module, Linear) and kept.get(name):
            module.int8_inputs = {"none": 0, "32": 32}.get(way, kept[name])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--new-tokens", type=int, default=64)
    args = ap.parse_args()
    config = EngineConfig(args.model, dtype="bfloat16", quantization="file", max_slots=len(PROMPTS), max_seq_len=512)
    torch_engine = Engine(EngineConfig(**{**config.__dict__, "native_forward": "off"}))
    kept = {n: m.int8_inputs for n, m in torch_engine.model.named_modules() if isinstance(m, Linear)}
    blocks = [b for b in kept.values() if b]
    print(f"{len(blocks)} projections on int8 inputs, {blocks.count(256)} of them in blocks of 256 (Q4_K, Q6_K)\n")
    prompts = [torch_engine.tokenizer.encode_chat([{"role": "user", "content": p}]) for p in PROMPTS]
    set_blocks(torch_engine, "none", kept)
    reference = greedy(torch_engine, prompts, args.new_tokens)
    ref_logits = [torch_engine.score(p + r)[len(p) - 1 : -1].double() for p, r in zip(prompts, reference)]
    print("| inputs | top-1 agreement | mean KL(float ‖ way) | logit error median / max | greedy runs equal |")
    print("|---|---:|---:|---:|---:|")
    ways = [("32", "int8 per 32 (before)", torch_engine), ("this tree", "this tree's (after)", torch_engine)]
    ways.append(("native", "the native step (after)", Engine(config)))
    for way, label, engine in ways:
        if engine is torch_engine:
            set_blocks(engine, way, kept)
        print(f"| {label} | {against_reference(engine, prompts, reference, ref_logits, args.new_tokens)} |", flush=True)


if __name__ == "__main__":
    main()
