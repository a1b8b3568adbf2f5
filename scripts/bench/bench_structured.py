#!/usr/bin/env python3
"""Structured output's fixed costs, in-process: llguidance's view of the tokenizer (once per
model), a schema's compilation (cold, then cached), and the mask of one constrained row per step.

    python scripts/bench/bench_structured.py --model ~/.cache/flover-tests/SmolLM2-135M-Instruct.Q4_1.gguf

The throughput of a mixed workload (half the requests in a JSON schema) against llama.cpp's
server is bench_vs_llamacpp.py --workload chat --structured-half.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

from flover import LLM, SamplingParams
from flover.structured.grammars import Grammars, allowed_bits
from flover.structured.spec import Structured

SCHEMAS = {
    "answer (2 fields)": {
        "type": "object",
        "additionalProperties": False,
        "required": ["answer", "confidence"],
        "properties": {
            "answer": {"type": "string", "maxLength": 400},
            "confidence": {"type": "integer", "minimum": 0, "maximum": 10},
        },
    },
    "order (nested, 8 fields)": {
        "type": "object",
        "required": ["id", "customer", "items", "total", "paid"],
        "properties": {
            "id": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{6}$"},
            "customer": {
                "type": "object",
                "required": ["name", "email"],
                "properties": {"name": {"type": "string"}, "email": {"type": "string"}, "vip": {"type": "boolean"}},
            },
            "items": {
                "type": "array",
                "items": {
                    "type": "object",
                    "required": ["sku", "qty"],
                    "properties": {"sku": {"type": "string"}, "qty": {"type": "integer", "minimum": 1}},
                },
            },
            "total": {"type": "number"},
            "paid": {"enum": ["yes", "no", "partly"]},
        },
    },
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    cpu = next(
        (line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
        platform.processor(),
    )
    llm = LLM(args.model, max_slots=4, max_seq_len=512)
    engine = llm.engine
    print(f"machine: {cpu}; vocabulary {engine.model_config.vocab_size}")
    times = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        grammars = Grammars(engine.tokenizer, engine.model_config.vocab_size, engine.model_config.eos_token_ids)
        times.append(time.perf_counter() - start)
    print(f"llguidance's tokenizer view (once per model): {statistics.median(times) * 1000:.1f} ms")
    print(
        "| schema | compile, cold | cached | mask of one row, per step (median over an answer) |\n|---|---:|---:|---:|"
    )
    result = {}
    for name, schema in SCHEMAS.items():
        cold, warm = [], []
        for _ in range(args.repeats):
            fresh = Grammars(engine.tokenizer, engine.model_config.vocab_size, engine.model_config.eos_token_ids)
            structured = Structured("json_schema", schema)
            start = time.perf_counter()
            fresh.compile(structured)
            cold.append(time.perf_counter() - start)
            start = time.perf_counter()
            fresh.start(structured)  # cached matcher, copied for the request
            warm.append(time.perf_counter() - start)
        state = grammars.start(Structured("json_schema", schema))
        out = llm.generate(
            llm.tokenizer.encode_chat([{"role": "user", "content": "An example, as JSON."}]),
            SamplingParams(max_new_tokens=200, structured=Structured("json_schema", schema)),
        )[0]
        masks = []
        for token in out.token_ids:
            start = time.perf_counter()
            allowed_bits([state], engine.model_config.vocab_size)
            masks.append(time.perf_counter() - start)
            state.advance(token)
        result[name] = dict(
            cold_ms=statistics.median(cold) * 1000,
            cached_ms=statistics.median(warm) * 1000,
            mask_ms=statistics.median(masks) * 1000,
            text=out.text,
        )
        print(
            f"| {name} | {result[name]['cold_ms']:.1f} ms | {result[name]['cached_ms']:.2f} ms | "
            f"{result[name]['mask_ms']:.3f} ms |"
        )
    print(json.dumps({k: v["text"][:120] for k, v in result.items()}, indent=1))


if __name__ == "__main__":
    main()
