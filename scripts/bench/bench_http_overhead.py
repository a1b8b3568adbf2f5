#!/usr/bin/env python3
"""What the OpenAI HTTP front costs against the ZeroMQ socket, on one `flover serve --http`.

    python scripts/bench/bench_http_overhead.py --model ~/.cache/flover-tests/SmolLM2-135M-Instruct.Q4_1.gguf

The same requests (random token-id prompts, greedy, EOS ignored, streamed) go to the daemon's
socket through `AsyncClient` and to `/v1/completions` through httpx (raw SSE, so that the client's
own parsing stays as light as on the socket side); the two paths alternate, `--runs` times each,
at 1 and at `--concurrency` requests at once. Reports median output tok/s and TTFT p50 per path.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import subprocess
import sys
import time

import httpx

from flover.bench.metrics import medians
from flover.client import AsyncClient


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def via_socket(addr: str, prompts, gen_len: int):
    async with AsyncClient(addr) as client:

        async def one(ids):
            start, first, n = time.perf_counter(), None, 0
            async for event in client.stream(input_ids=ids, max_new_tokens=gen_len, ignore_eos=True):
                if event["event"] == "token" and first is None:
                    first = time.perf_counter() - start
                if event["event"] == "final":
                    n = event["usage"]["completion_tokens"]
            return first, n

        return await asyncio.gather(*(one(p) for p in prompts))


async def via_http(url: str, prompts, gen_len: int):
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=256)) as h:

        async def one(ids):
            start, first, n = time.perf_counter(), None, 0
            body = {
                "prompt": ids,
                "max_tokens": gen_len,
                "temperature": 0,
                "ignore_eos": True,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            async with h.stream("POST", f"{url}/v1/completions", json=body) as r:
                async for line in r.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if chunk["choices"] and first is None:
                        first = time.perf_counter() - start
                    if chunk.get("usage"):
                        n = chunk["usage"]["completion_tokens"]
            return first, n

        return await asyncio.gather(*(one(p) for p in prompts))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--gen-len", type=int, default=128)
    ap.add_argument("--serve-args", default="", help="more flover serve arguments, e.g. '--dtype float32'")
    args = ap.parse_args()
    addr, port = f"tcp://127.0.0.1:{free_port()}", free_port()
    cmd = [
        sys.executable,
        "-m",
        "flover.apps.cli",
        "serve",
        "--model",
        args.model,
        "--bind",
        addr,
        "--http",
        f"127.0.0.1:{port}",
        "--max-slots",
        str(args.concurrency),
        "--max-seq-len",
        str(args.prompt_len + args.gen_len + 8),
        *args.serve_args.split(),
    ]
    server = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        assert "ready on" in server.stdout.readline()
        url = f"http://127.0.0.1:{port}"
        rng = random.Random(0)
        results: dict = {}
        asyncio.run(via_socket(addr, [[7] * args.prompt_len], 8))  # warm-up
        for run in range(args.runs):
            for n in (1, args.concurrency):
                prompts = [[rng.randrange(1000, 40000) for _ in range(args.prompt_len)] for _ in range(n)]
                paths = [
                    ("ZeroMQ socket", lambda: via_socket(addr, prompts, args.gen_len)),
                    ("HTTP /v1/completions", lambda: via_http(url, prompts, args.gen_len)),
                ]
                for name, send in paths if run % 2 == 0 else paths[::-1]:
                    start = time.perf_counter()
                    got = asyncio.run(send())
                    wall = time.perf_counter() - start
                    r = {"tok_s": sum(t for _, t in got) / wall, "ttft_p50": statistics.median(f for f, _ in got)}
                    results.setdefault((n, name), []).append(r)
                    print(
                        f"[run {run + 1}] {n:3d} at once, {name:22s}: {r['tok_s']:7.1f} tok/s, "
                        f"TTFT p50 {r['ttft_p50'] * 1000:5.0f} ms",
                        file=sys.stderr,
                        flush=True,
                    )
        print(
            f"\nmedians of {args.runs} alternating runs, {args.prompt_len}-token prompts, {args.gen_len} tokens out, "
            f"greedy, streamed\n\n| requests at once | path | out tok/s | TTFT p50 | HTTP / socket tok/s |\n"
            f"|---:|---|---:|---:|---:|"
        )
        for n in (1, args.concurrency):
            med = {
                name: medians(results[(n, name)], ("tok_s", "ttft_p50"))
                for name in ("ZeroMQ socket", "HTTP /v1/completions")
            }
            ratio = med["HTTP /v1/completions"]["tok_s"] / med["ZeroMQ socket"]["tok_s"]
            for name, m in med.items():
                print(
                    f"| {n} | {name} | {m['tok_s']:.1f} | {m['ttft_p50'] * 1000:.0f} ms | "
                    f"{f'{ratio:.3f}' if name.startswith('HTTP') else ''} |"
                )
    finally:
        server.terminate()
        server.wait(60)
    return 0


if __name__ == "__main__":
    sys.exit(main())
