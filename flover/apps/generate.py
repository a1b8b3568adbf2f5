"""`flover generate`: prompts from the command line, through an engine in this process or a
running daemon (--connect)."""

from __future__ import annotations

import argparse
import json
import sys
import time

from flover.apps.flags import (
    add_connect_args,
    add_engine_args,
    add_sampling_args,
    connect,
    require_model,
    sampling_params,
    start_engine,
)


def add_generate_command(sub) -> None:
    gen = sub.add_parser("generate", help="generate from prompts given on the command line")
    add_engine_args(gen, model_required=False)
    add_sampling_args(gen)
    add_connect_args(gen)
    gen.add_argument("--stream", action="store_true", help="print tokens as they come (with --connect)")
    gen.add_argument("--json", action="store_true", help="one JSON object per prompt")
    gen.add_argument("prompts", nargs="+")
    gen.set_defaults(func=cmd_generate)


def cmd_generate_remote(args: argparse.Namespace) -> int:
    from dataclasses import asdict

    params = asdict(sampling_params(args))
    with connect(args) as client:
        for prompt in args.prompts:
            if args.stream:
                for event in client.stream(prompt, **params):
                    if event["event"] == "token":
                        print(event["text"] or "", end="", flush=True)
                    else:
                        print(
                            f"\n[{event['finish_reason']}, {event['usage']['completion_tokens']} tokens, "
                            f"ttft {1000 * event['timings']['ttft_s']:.0f} ms]",
                            file=sys.stderr,
                        )
            else:
                event = client.generate(prompt, **params)
                if args.json:
                    print(json.dumps({"prompt": prompt, **event}))
                else:
                    print(
                        f"{prompt!r} -> {event['text']!r} [{event['finish_reason']}, {len(event['token_ids'])} tokens]"
                    )
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    from flover.engine.engine import LLM

    require_model(args)
    if args.connect:
        return cmd_generate_remote(args)
    params = sampling_params(args)
    engine = start_engine(args)
    if engine is None:
        return 0
    llm = LLM.from_engine(engine)
    start = time.perf_counter()
    try:
        outputs = llm.generate(args.prompts, params)
    finally:
        engine.shutdown()
    wall = time.perf_counter() - start
    for prompt, out in zip(args.prompts, outputs):
        if args.json:
            print(
                json.dumps(
                    {
                        "prompt": prompt,
                        "text": out.text,
                        "token_ids": out.token_ids,
                        "finish_reason": out.finish_reason,
                        "usage": out.usage,
                        "logprobs": out.logprobs,
                        "timings": out.timings,
                    }
                )
            )
        else:
            print(f"{prompt!r} -> {out.text!r} [{out.finish_reason}, {len(out.token_ids)} tokens]")
    tokens = sum(len(o.token_ids) for o in outputs)
    print(
        f"{len(outputs)} prompts, {tokens} tokens in {wall:.2f} s ({tokens / wall:.1f} tok/s, "
        f"{engine.iterations} iterations)",
        file=sys.stderr,
    )
    return 0
