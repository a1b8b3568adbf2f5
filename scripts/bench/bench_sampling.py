#!/usr/bin/env python3
"""Sampled requests against greedy ones, in-process, and the sampler alone at two vocabularies.

1. Engine: --rows chat questions (the checkpoint's chat template) decode --new-tokens each, EOS
   ignored, speculation off, once per sampling setting (greedy; temperature 0.8; + top_p 0.95;
   + top_k 40; + repetition_penalty 1.1). The settings alternate within a run; the median of
   --runs is reported as tok/s and as a share of greedy's.
2. Sampler: `sample()` on [rows, vocab] logits that look like a model's (a few likely tokens, a
   long tail: Gumbel-distributed logits x --peak), for SmolLM2's vocabulary and Llama 3's
   (128256), with the sort-based top-p beside it (`nucleus_by_sort`); ms per call, medians.

    python scripts/bench/bench_sampling.py --model ~/.cache/flover-tests/SmolLM2-135M-Instruct.Q4_1.gguf
    ... --pad-vocab 128256     # the same model with Llama 3's vocabulary size (below)

`--pad-vocab N`: the GGUF's weights (dequantized to float32 with transformers; or a Hugging Face
directory's, in its dtype) with the vocabulary
padded to N: the new embedding rows (the tied head's too) small random values, so the logits are
still a trained model's (a few likely tokens, a long tail) over a vocabulary of N. Cached under
--cache; the tokenizer never produces those ids.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from flover import LLM, SamplingParams
from flover.native.abi import load_library
from flover.native.sampling import NativeSampler
from flover.runner import sampler

QUESTIONS = [
    "What is the capital of France?",
    "Explain photosynthesis in two sentences.",
    "Write a haiku about the sea.",
    "How do I reverse a list in Python?",
    "What causes the seasons on Earth?",
    "Give me three tips for a job interview.",
    "What is the difference between a virus and a bacterium?",
    "Tell me a short story about a robot who learns to paint.",
]

SETTINGS = {
    "greedy": dict(),
    "temperature 0.8": dict(temperature=0.8),
    "+ top_p 0.95": dict(temperature=0.8, top_p=0.95),
    "+ top_k 40": dict(temperature=0.8, top_p=0.95, top_k=40),
    "+ repetition_penalty 1.1": dict(temperature=0.8, top_p=0.95, top_k=40, repetition_penalty=1.1),
}


def padded_model(gguf: Path, vocab: int, cache: Path) -> Path:
    """The GGUF's weights in float32 with the vocabulary padded to `vocab` (see the module's doc)."""
    import transformers

    out = cache / f"{gguf.stem if gguf.is_file() else gguf.name}-vocab{vocab}"
    if (out / "config.json").is_file():
        return out
    if gguf.is_dir():  # a Hugging Face directory (e.g. make_1b_model.py's llama-1b-hf), in its own dtype
        plain = transformers.AutoModelForCausalLM.from_pretrained(gguf, dtype="auto")
        tokenizer = transformers.AutoTokenizer.from_pretrained(gguf)
    else:
        model = transformers.AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        config = model.config
        del config.quantization_config  # save_pretrained refuses a "quantized" model
        plain = type(model)(config)
        plain.load_state_dict(model.state_dict(), strict=False)
        tokenizer = transformers.AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    old = plain.get_input_embeddings().weight.shape[0]
    plain.resize_token_embeddings(vocab, mean_resizing=False)
    with torch.no_grad():  # tiny rows: logits near 0, far below a trained row's likely tokens
        new = plain.get_input_embeddings().weight[old:]
        new.copy_(torch.randn(new.shape, generator=torch.Generator().manual_seed(0)) * 1e-3)
    plain.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def engine_rates(llm: LLM, rows: int, new_tokens: int, runs: int) -> dict[str, list[float]]:
    prompts = [
        llm.tokenizer.encode_chat([{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}]) for i in range(rows)
    ]
    rates: dict[str, list[float]] = {name: [] for name in SETTINGS}
    llm.generate(prompts[:2], SamplingParams(max_new_tokens=4, ignore_eos=True))  # warm-up
    for run in range(runs):
        for name, kw in SETTINGS.items():
            params = [
                SamplingParams(max_new_tokens=new_tokens, ignore_eos=True, seed=run * 1000 + i, **kw)
                for i in range(rows)
            ]
            start = time.perf_counter()
            outs = llm.generate(prompts, params)
            wall = time.perf_counter() - start
            assert all(len(o.token_ids) == new_tokens for o in outs)
            rates[name].append(rows * new_tokens / wall)
            print(f"run {run + 1}/{runs} {name:26s} {rates[name][-1]:7.1f} tok/s", flush=True)
    return rates


def model_like_logits(rows: int, vocab: int, peak: float, seed: int) -> torch.Tensor:
    """Gumbel logits x peak: a handful of likely tokens and a long tail, as a trained LM's rows."""
    u = torch.rand(rows, vocab, generator=torch.Generator().manual_seed(seed)).clamp_(min=1e-12)
    return -torch.log(-torch.log(u)) * peak


def sampler_ms(rows: int, vocab: int, peak: float, repeats: int) -> dict[str, float]:
    logits = model_like_logits(rows, vocab, peak, seed=vocab)
    full = lambda v, dt: torch.full((rows,), v, dtype=dt)  # noqa: E731
    st = sampler.SamplingTensors(
        temperature=full(0.8, torch.float32),
        top_k=full(0, torch.int64),
        top_p=full(0.95, torch.float32),
        min_p=full(0.0, torch.float32),
        repetition_penalty=full(1.0, torch.float32),
        seed=full(1, torch.int64),
        counter=torch.arange(rows),
        all_greedy=False,
    )
    probs = torch.softmax(logits / 0.8, dim=-1)
    kept = (sampler.nucleus(probs, st.top_p) > 0).sum(-1).float()
    native = NativeSampler(load_library(), torch.get_num_threads())
    calls = {
        "greedy argmax": lambda: sampler.greedy(logits),
        "sample(), top_p 0.95": lambda: sampler.sample(logits, st),
        "sample(), native": lambda: sampler.sample(logits, st, native),
        "top-p alone (nucleus)": lambda: sampler.nucleus(probs, st.top_p),
        "top-p alone by sorting": lambda: sampler.nucleus_by_sort(probs, st.top_p),
    }
    out = {"nucleus tokens (median)": float(kept.median())}
    for name, call in calls.items():
        call()
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            call()
            times.append((time.perf_counter() - start) * 1000)
        out[name] = statistics.median(times)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--peak", type=float, default=3.0, help="the synthetic logits' scale (Gumbel x peak)")
    ap.add_argument("--skip-engine", action="store_true")
    ap.add_argument("--pad-vocab", type=int, default=0, help="pad the model's vocabulary to this size first")
    ap.add_argument("--cache", default=str(Path.home() / ".cache" / "flover" / "bench-sampling"))
    ap.add_argument("--json", help="also write the raw figures here")
    args = ap.parse_args()
    cpu = next(
        (line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
        platform.processor(),
    )
    print(f"machine: {cpu}, {torch.get_num_threads()} threads")
    result = {"machine": cpu}
    if not args.skip_engine:
        model = args.model
        if args.pad_vocab:
            model = str(padded_model(Path(args.model).expanduser(), args.pad_vocab, Path(args.cache)))
        llm = LLM(model, dtype=args.dtype, max_slots=args.rows, max_seq_len=256, speculate=0)
        rates = engine_rates(llm, args.rows, args.new_tokens, args.runs)
        greedy = statistics.median(rates["greedy"])
        print(
            f"\n{args.rows} rows x {args.new_tokens} tokens, medians of {args.runs}:\n"
            "| sampling | tok/s | of greedy |\n|---|---:|---:|"
        )
        for name, values in rates.items():
            print(f"| {name} | {statistics.median(values):.1f} | {statistics.median(values) / greedy:.0%} |")
        result["engine"] = rates
    print(
        f"\nsampler alone, {args.rows} rows, ms per call (median of 15), temperature 0.8:\n"
        "| vocabulary | nucleus tokens | greedy argmax | sample(), top_p 0.95 | the same, native | top-p alone "
        "| top-p by sorting |\n|---:|---:|---:|---:|---:|---:|---:|"
    )
    for vocab in (49152, 128256):
        ms = sampler_ms(args.rows, vocab, args.peak, 15)
        result[f"sampler {vocab}"] = ms
        print(
            f"| {vocab} | {ms['nucleus tokens (median)']:.0f} | {ms['greedy argmax']:.2f} | "
            f"{ms['sample(), top_p 0.95']:.2f} | {ms['sample(), native']:.2f} | "
            f"{ms['top-p alone (nucleus)']:.2f} | {ms['top-p alone by sorting']:.2f} |"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
