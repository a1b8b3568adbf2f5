"""`flover` command line: `flover generate` (offline, in-process engine)."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time

from flover.config import DTYPES, EngineConfig, SamplingParams


def add_engine_args(ap: argparse.ArgumentParser) -> None:
    g = ap.add_argument_group("engine")
    g.add_argument("--model", required=True, help="Hugging Face checkpoint directory")
    g.add_argument("--dtype", choices=DTYPES, default="float32")
    g.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N")
    g.add_argument("--max-slots", type=int, default=32, help="requests in flight at once")
    g.add_argument("--max-seq-len", type=int, default=None, help="prompt + output tokens (default: model limit, <= 2048)")
    g.add_argument("--max-batch-tokens", type=int, default=512, help="token budget of one iteration")
    g.add_argument("--threads", type=int, default=None, help="torch threads (default: cores available)")
    g.add_argument("--seed", type=int, default=0, help="seeds requests that bring no seed")


def engine_config(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(model=args.model, dtype=args.dtype, device=args.device, max_slots=args.max_slots,
                        max_seq_len=args.max_seq_len, max_batch_tokens=args.max_batch_tokens,
                        num_threads=args.threads, seed=args.seed)


def add_sampling_args(ap: argparse.ArgumentParser) -> None:
    g = ap.add_argument_group("sampling (defaults: greedy, 16 tokens)")
    g.add_argument("--max-new-tokens", type=int, default=16)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--repetition-penalty", type=float, default=1.0)
    g.add_argument("--sampling-seed", type=int, default=None, help="per-request seed")
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--stop-token-id", type=int, action="append", default=[], help="repeatable")
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--logprobs", action="store_true")


def sampling_params(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(
        max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
        top_p=args.top_p, min_p=args.min_p, repetition_penalty=args.repetition_penalty,
        seed=args.sampling_seed, stop=tuple(args.stop), stop_token_ids=tuple(args.stop_token_id),
        ignore_eos=args.ignore_eos, logprobs=args.logprobs)


def cmd_generate(args: argparse.Namespace) -> int:
    from flover.engine import LLM

    params = sampling_params(args)
    llm = LLM(**vars(engine_config(args)))
    start = time.perf_counter()
    outputs = llm.generate(args.prompts, params)
    wall = time.perf_counter() - start
    for prompt, out in zip(args.prompts, outputs):
        if args.json:
            print(json.dumps({"prompt": prompt, "text": out.text, "token_ids": out.token_ids,
                              "finish_reason": out.finish_reason, "usage": out.usage,
                              "logprobs": out.logprobs, "timings": out.timings}))
        else:
            print(f"{prompt!r} -> {out.text!r} [{out.finish_reason}, {len(out.token_ids)} tokens]")
    tokens = sum(len(o.token_ids) for o in outputs)
    print(f"{len(outputs)} prompts, {tokens} tokens in {wall:.2f} s ({tokens / wall:.1f} tok/s, "
          f"{llm.engine.iterations} iterations)", file=sys.stderr)
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="flover", description="temporal-fusion LLM inference")
    ap.add_argument("-v", "--verbose", action="store_true")
    sub = ap.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate from prompts given on the command line")
    add_engine_args(gen)
    add_sampling_args(gen)
    gen.add_argument("--json", action="store_true", help="one JSON object per prompt")
    gen.add_argument("prompts", nargs="+")
    gen.set_defaults(func=cmd_generate)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="flover: %(message)s", stream=sys.stderr)
    try:
        return args.func(args)
    except (ValueError, MemoryError, OSError) as e:  # CheckpointError is a ValueError
        print(f"flover: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
