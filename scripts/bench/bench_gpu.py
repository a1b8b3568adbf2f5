#!/usr/bin/env python3
"""flover against transformers on the same GPU, the same model and the same workload.

    python scripts/bench/bench_gpu.py --out results/gpu.json            # a SmolLM2-135M-shaped random model
    python scripts/bench/bench_gpu.py --model DIR --dtype bfloat16 --runs 3

Without --model it makes a random checkpoint of SmolLM2-135M's shape (30 layers, hidden 576,
9/3 heads, vocabulary 49152, tied embeddings): the GPU machines cannot fetch the real weights, and
the work per token depends on the shape alone.

Workloads (prompts of random ids, greedy, EOS ignored), run alternately engine by engine:
  one        one request, PROMPT tokens in, GEN out: output tok/s and ms per output token;
  batch      REQUESTS at once: output tok/s (transformers: one batched `generate`);
  poisson    REQUESTS arriving Poisson (mean gap 50 ms), flover only (transformers has no
             continuous batching in `generate`): output tok/s, TTFT p50.
flover runs with and without CUDA graphs (`--cuda-graphs`). Also reported: how many requests'
greedy tokens equal transformers' (in the benchmark dtype), and the graphs' capture time.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time

import torch

from flover import Engine, EngineConfig, SamplingParams

SMOLLM2_SHAPE = dict(
    hidden_size=576,
    num_layers=30,
    num_heads=9,
    num_kv_heads=3,
    intermediate_size=1536,
    vocab_size=49152,
    max_position_embeddings=2048,
    tie_word_embeddings=True,
)


def make_model(out: str) -> str:
    from flover.testing.tiny_model import make_tiny_model

    return str(make_tiny_model("llama", SMOLLM2_SHAPE, out, rope_theta=100000.0))


def sync() -> None:
    torch.cuda.synchronize()


def flover_one(engine: Engine, prompt: list[int], gen: int) -> float:
    """Seconds per output token after the first (the decode rate a user sees)."""
    engine.add_request(prompt, SamplingParams(max_new_tokens=gen, ignore_eos=True))
    times = []
    while engine.has_unfinished():
        for out in engine.step():
            times += [time.perf_counter()] * len(out.new_token_ids)
    return (times[-1] - times[0]) / (len(times) - 1)


def flover_batch(engine: Engine, prompts: list[list[int]], gen: int) -> float:
    """Output tok/s with every request queued at once."""
    params = SamplingParams(max_new_tokens=gen, ignore_eos=True)
    t0 = time.perf_counter()
    for p in prompts:
        engine.add_request(p, params)
    tokens = 0
    while engine.has_unfinished():
        tokens += sum(len(out.new_token_ids) for out in engine.step())
    return tokens / (time.perf_counter() - t0)


def flover_poisson(engine: Engine, prompts: list[list[int]], gen: int, gap_s: float, seed: int):
    """(output tok/s, TTFT p50 ms) with Poisson arrivals, the engine stepping in this thread."""
    rng = random.Random(seed)
    arrivals, t = [], 0.0
    for _ in prompts:
        arrivals.append(t)
        t += rng.expovariate(1 / gap_s)
    params = SamplingParams(max_new_tokens=gen, ignore_eos=True)
    t0 = time.perf_counter()
    pending = list(zip(arrivals, prompts))
    first: dict[str, float] = {}
    arrived: dict[str, float] = {}
    tokens = 0
    while pending or engine.has_unfinished():
        now = time.perf_counter() - t0
        while pending and pending[0][0] <= now:
            at, prompt = pending.pop(0)
            rid = engine.add_request(prompt, params)
            arrived[rid] = at
        if not engine.has_unfinished():
            time.sleep(max(0.0, pending[0][0] - now))
            continue
        for out in engine.step():
            if out.new_token_ids and out.request_id not in first:
                first[out.request_id] = time.perf_counter() - t0
            tokens += len(out.new_token_ids)
    wall = time.perf_counter() - t0
    ttft = statistics.median(first[r] - arrived[r] for r in arrived) * 1000
    return tokens / wall, ttft


def hf_one(model, prompt: list[int], gen: int) -> float:
    ids = torch.tensor([prompt], device="cuda")
    # Time a 1-token and a GEN-token generate: the difference is GEN - 1 decode steps.
    sync()
    t0 = time.perf_counter()
    model.generate(ids, max_new_tokens=1, min_new_tokens=1, do_sample=False)
    sync()
    t1 = time.perf_counter()
    out = model.generate(ids, max_new_tokens=gen, min_new_tokens=gen, do_sample=False)
    sync()
    t2 = time.perf_counter()
    assert out.shape[1] == len(prompt) + gen
    return ((t2 - t1) - (t1 - t0)) / (gen - 1)


def hf_batch(model, prompts: list[list[int]], gen: int) -> float:
    ids = torch.tensor(prompts, device="cuda")  # equal lengths: no padding
    sync()
    t0 = time.perf_counter()
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=gen, min_new_tokens=gen, do_sample=False
    )
    sync()
    return (out.shape[1] - ids.shape[1]) * len(prompts) / (time.perf_counter() - t0)


def hf_greedy(model, prompt: list[int], gen: int) -> list[int]:
    out = model.generate(torch.tensor([prompt], device="cuda"), max_new_tokens=gen, min_new_tokens=gen, do_sample=False)
    return out[0, len(prompt) :].tolist()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="checkpoint directory or GGUF (default: a random SmolLM2 shape)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--gen-len", type=int, default=128)
    ap.add_argument("--graphs", default="off,on", help="flover variants: off, on or both (CUDA graphs)")
    ap.add_argument("--no-hf", action="store_true", help="flover only")
    ap.add_argument("--out", default=None, help="JSON file of every figure")
    args = ap.parse_args()
    import transformers

    model_dir = args.model or make_model(tempfile.mkdtemp(prefix="smollm2-shape-"))
    rng = random.Random(0)
    prompt = lambda: [rng.randrange(100, 40000) for _ in range(args.prompt_len)]  # noqa: E731
    one, batch = prompt(), [prompt() for _ in range(args.requests)]
    max_len = args.prompt_len + args.gen_len + 16
    dtype = getattr(torch, args.dtype)

    engines = {}
    for graphs in args.graphs.split(","):
        t0 = time.perf_counter()
        engine = Engine(
            EngineConfig(
                model_dir,
                dtype=args.dtype,
                device="cuda",
                max_slots=args.requests,
                max_seq_len=max_len,
                prefix_cache_mib=0,
                cuda_graphs="auto" if graphs == "on" else "off",
            )
        )
        start = time.perf_counter() - t0
        flover_one(engine, prompt(), 8)  # warm-up
        flover_batch(engine, [prompt() for _ in range(args.requests)], 8)
        engines[f"flover graphs {graphs}"] = (engine, start)
        captured = engine.runner.graphs
        print(
            f"flover graphs {graphs}: ready in {start:.1f} s"
            + (f" ({captured.count} graphs captured in {captured.capture_s:.2f} s)" if captured else ""),
            flush=True,
        )
    hf = None
    if not args.no_hf:
        hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to("cuda").eval()
        hf.generation_config.pad_token_id = hf.generation_config.eos_token_id
        hf_one(hf, prompt(), 4)

    figures: dict[str, dict[str, list[float]]] = {}
    put = lambda name, key, value: figures.setdefault(name, {}).setdefault(key, []).append(value)  # noqa: E731
    with torch.inference_mode():
        for run in range(args.runs):
            for name, (engine, _) in engines.items():
                s = flover_one(engine, one, args.gen_len)
                put(name, "one: ms/token", s * 1000)
                put(name, "one: tok/s", 1 / s)
                put(name, "batch: tok/s", flover_batch(engine, batch, args.gen_len))
                tps, ttft = flover_poisson(engine, batch, args.gen_len, 0.05, seed=run)
                put(name, "poisson: tok/s", tps)
                put(name, "poisson: TTFT p50 ms", ttft)
            if hf is not None:
                s = hf_one(hf, one, args.gen_len)
                put("transformers", "one: ms/token", s * 1000)
                put("transformers", "one: tok/s", 1 / s)
                put("transformers", "batch: tok/s", hf_batch(hf, batch, args.gen_len))
            print(f"run {run + 1}/{args.runs} done", flush=True)

        agree = {}
        if hf is not None:
            refs = [hf_greedy(hf, p, 32) for p in batch[:8]]
            for name, (engine, _) in engines.items():
                params = SamplingParams(max_new_tokens=32, ignore_eos=True)
                rids = [engine.add_request(p, params) for p in batch[:8]]
                finals = {}
                while engine.has_unfinished():
                    finals.update({o.request_id: o.token_ids for o in engine.step() if o.finished})
                agree[name] = sum(finals[r] == ref for r, ref in zip(rids, refs))

    device = torch.cuda.get_device_name()
    print(
        f"\n{device}, {args.dtype}, median of {args.runs} alternating runs; prompt {args.prompt_len}, "
        f"{args.gen_len} out, {args.requests} requests"
    )
    keys = sorted({k for f in figures.values() for k in f})
    print("| engine | " + " | ".join(keys) + " |")
    print("|---|" + "---:|" * len(keys))
    summary = {}
    for name, f in figures.items():
        summary[name] = {k: statistics.median(v) for k, v in f.items()}
        print(
            f"| {name} | " + " | ".join(f"{summary[name][k]:.1f}" if k in summary[name] else "-" for k in keys) + " |"
        )
    for name, (engine, start) in engines.items():
        print(
            f"{name}: engine start {start:.1f} s; greedy 32 tokens equal to transformers for "
            f"{agree.get(name, '-')} of 8 requests"
        )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(
                dict(
                    device=device,
                    dtype=args.dtype,
                    args=vars(args),
                    runs=figures,
                    medians=summary,
                    starts={n: s for n, (_, s) in engines.items()},
                    greedy_equal_of_8=agree,
                ),
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
