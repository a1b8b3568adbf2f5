#!/usr/bin/env python3
"""What temporal fusion does for a mixture of experts: decode iterations of 1 to 32 fused rows,
the expert weights each iteration reads, and tokens/s, against a dense model of the same active
size (the same attention, one MLP as wide as the k experts a token takes).

    python scripts/bench/make_1b_model.py --shape qwen3-moe-1.8b --types Q4_K_M
    python scripts/bench/make_1b_model.py --shape qwen3-moe-dense-active --types Q4_K_M
    python scripts/bench/bench_moe_rows.py --moe ~/.cache/flover/llama.cpp/qwen3-moe-1.8b-Q4_K_M.gguf \
        --dense ~/.cache/flover/llama.cpp/qwen3-moe-dense-active-Q4_K_M.gguf

Each model runs in a fresh process per run (alternating, medians of --runs): for each row count n,
n requests of --prompt-len random token ids decode --gen-len tokens together (greedy, no
speculation); only the iterations of exactly n decode rows count. For the mixture: the experts an
iteration chose (from the engine's expert load, per iteration and layer) times each expert's
bytes in the file give the expert weight bytes it read; the dense MLP reads its whole MLP every
iteration. Prints a markdown table (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

CHILD = r"""
import json, random, sys, time
import torch
from flover import Engine, EngineConfig, SamplingParams
from flover.models.gguf_file import GGUFFile

args = json.loads(sys.argv[1])
positions = args["prompt_len"] + args["gen_len"] + 8
engine = Engine(EngineConfig(args["model"], max_slots=32, max_seq_len=positions, speculate=0))
model, results = engine.runner.model, []
experts = [layer.experts for layer in model.layers if getattr(layer, "experts", None) is not None]
mlp_names = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps") if experts else ("ffn_gate.", "ffn_up.", "ffn_down.")
mlp_bytes = sum(t.data.size for n, t in GGUFFile(args["model"]).tensors.items() if any(m in n for m in mlp_names))
per_expert = mlp_bytes / (len(experts) * experts[0].cfg.experts) if experts else 0
rng = random.Random(args["seed"])
for n in args["rows"]:
    for i in range(n):
        prompt = [rng.randrange(1000, 40000) for _ in range(args["prompt_len"])]
        params = SamplingParams(max_new_tokens=args["gen_len"], ignore_eos=True)
        engine.add_request(prompt, params, request_id=f"{n}-{i}")
    seconds, tokens, read = 0.0, 0, []
    while engine.has_unfinished():
        before = [e.load.clone() for e in experts]
        decoding = [r for r in engine.scheduler.running if r.num_computed >= len(r.prompt_token_ids)]
        start = time.perf_counter()
        engine.step()
        took = time.perf_counter() - start
        (_, rows), = engine.timed_iterations() or [(0, 0)]
        if rows == n and len(decoding) == n:
            seconds, tokens = seconds + took, tokens + n
            chosen = sum(int(torch.count_nonzero(e.load - b)) for e, b in zip(experts, before))
            read.append(chosen * per_expert if experts else mlp_bytes)
    results.append({"rows": n, "tok_s": tokens / seconds if seconds else 0.0,
                    "mlp_mib": sum(read) / len(read) / 2**20 if read else 0.0, "iterations": len(read)})
print(json.dumps(results))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--moe", required=True)
    ap.add_argument("--dense", required=True)
    ap.add_argument("--rows", default="1,2,4,8,16,32")
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--gen-len", type=int, default=48)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    runs: dict[str, list[list[dict]]] = {"moe": [], "dense": []}
    for run in range(args.runs):
        for kind in ("moe", "dense"):
            spec = dict(
                model=getattr(args, kind), rows=rows, prompt_len=args.prompt_len, gen_len=args.gen_len, seed=run
            )
            out = subprocess.run([sys.executable, "-c", CHILD, json.dumps(spec)], capture_output=True, text=True)
            if out.returncode:
                sys.exit(out.stderr[-3000:])
            runs[kind].append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(f"run {run + 1} {kind}: {runs[kind][-1]}", file=sys.stderr)
    median = lambda kind, i, key: statistics.median(r[i][key] for r in runs[kind])  # noqa: E731
    head = ("fused rows", "MoE expert MiB read / iteration", "MoE tok/s", "dense MLP MiB / iteration", "dense tok/s")
    print("| " + " | ".join(head) + " | MoE / dense |")
    print("|---|---|---|---|---|---|")
    table = []
    for i, n in enumerate(rows):
        moe, dense = median("moe", i, "tok_s"), median("dense", i, "tok_s")
        line = (n, median("moe", i, "mlp_mib"), moe, median("dense", i, "mlp_mib"), dense)
        table.append(line)
        print(f"| {n} | {line[1]:.0f} | {moe:.1f} | {line[3]:.0f} | {dense:.1f} | {moe / dense:.2f}x |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"runs": runs, "table": table}, f, indent=1)


if __name__ == "__main__":
    main()
