"""Embeddings side by side: flover serve against llama.cpp's llama-server (--embeddings) and
sentence-transformers' own batched `encode`, on one model, one seeded workload, the same cores.

The workload (issue 63): PASSAGES passages of 50-300 tokens, posted one per request to
/v1/embeddings by CLIENTS concurrent clients; passages/s from the first request to the last
answer. sentence-transformers encodes the same passages in this process (`encode(batch_size=32)`,
torch threads = --threads). Rounds alternate the three; the medians and their ratios are printed
(and written as JSON with --out).

    python scripts/bench/bench_embeddings.py --model DIR --gguf FILE.gguf [--rounds 3]

DIR is a sentence-transformers directory (all-MiniLM-L6-v2: flover.apps.fetch's EMBEDDING_MODEL),
FILE the same weights as llama.cpp's converter writes them (convert_hf_to_gguf.py DIR --outtype f32).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import statistics
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_vs_llamacpp import free_port, launch_flover, launch_llama, llama_server, log

WORDS = (
    "the a of to in and or but if then when while time model layer memory request token kernel "
    "river mountain city road house light dark red blue green run walk read write think speak "
    "question answer search passage vector meaning retrieval document query server client batch "
    "network language system data result value number first last new old small large fast slow"
).split()


def tokenizer_of(model: Path):
    from flover.models.checkpoint import open_checkpoint
    from flover.models.tokenizer import load_tokenizer

    return load_tokenizer(open_checkpoint(model))


def passages(count: int, seed: int, tokenizer) -> list[str]:
    """`count` passages of 50-300 tokens (by `tokenizer`), made of plain words."""
    rng, out = random.Random(seed), []
    while len(out) < count:
        want = rng.randint(50, 300)
        words = rng.choices(WORDS, k=want)
        text = " ".join(words)
        ids = tokenizer.encode(text)
        while len(ids) > want:  # (a word may be several tokens: trim to the length drawn)
            words = words[: -max(1, (len(ids) - want) // 2)]
            text = " ".join(words)
            ids = tokenizer.encode(text)
        out.append(text)
    return out


async def post_all(url: str, texts: list[str], clients: int, model: str | None) -> float:
    """Seconds for `clients` concurrent clients to embed every text, one per request."""
    todo = iter(enumerate(texts))
    results: list = [None] * len(texts)

    async def client(http: httpx.AsyncClient) -> None:
        for n, text in todo:
            body = {"input": text, **({"model": model} if model else {})}
            response = await http.post(f"{url}/v1/embeddings", json=body, timeout=600)
            response.raise_for_status()
            results[n] = len(response.json()["data"][0]["embedding"])

    start = time.perf_counter()
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=clients)) as http:
        await asyncio.gather(*(client(http) for _ in range(clients)))
    seconds = time.perf_counter() - start
    assert all(results), "every passage got a vector"
    return seconds


async def stream_tpot(http: httpx.AsyncClient, url: str, model: str, n: int, tokens: int) -> float:
    """One streamed completion of `tokens` tokens (EOS ignored): its time per output token after the first."""
    body = {"model": model, "prompt": f"Story {n}: once upon a time", "max_tokens": tokens, "stream": True}
    body |= {"ignore_eos": True, "temperature": 0}
    stamps = []
    async with http.stream("POST", f"{url}/v1/completions", json=body, timeout=600) as response:
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                stamps.append(time.perf_counter())
    return (stamps[-1] - stamps[0]) / (len(stamps) - 1)


async def chats_beside_passages(url: str, model: str, texts: list[str], streams: int, clients: int) -> dict:
    """TPOT of `streams` chat streams alone, then while `clients` clients embed `texts` (looped
    until the streams end): the medians and their ratio."""
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=streams + clients)) as http:
        alone = await asyncio.gather(*(stream_tpot(http, url, model, n, 128) for n in range(streams)))
        done = asyncio.Event()
        embedded = 0

        async def embed_until_done(k: int) -> None:
            nonlocal embedded
            while not done.is_set():
                text = texts[(k + embedded * clients) % len(texts)]
                response = await http.post(f"{url}/v1/embeddings", json={"model": model, "input": text}, timeout=600)
                response.raise_for_status()
                embedded += 1

        embedders = [asyncio.ensure_future(embed_until_done(k)) for k in range(clients)]
        await asyncio.sleep(2.0)  # (the passages flowing before the streams start)
        start = time.perf_counter()
        beside = await asyncio.gather(*(stream_tpot(http, url, model, n, 128) for n in range(streams)))
        seconds = time.perf_counter() - start
        done.set()
        await asyncio.gather(*embedders)
    alone_ms, beside_ms = 1000 * statistics.median(alone), 1000 * statistics.median(beside)
    return {
        "tpot_alone_ms": alone_ms,
        "tpot_beside_passages_ms": beside_ms,
        "ratio": beside_ms / alone_ms,
        "passages_per_s_meanwhile": embedded / seconds,
    }


def served(url: str) -> str:
    return httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]


def run_flover(model: Path, texts: list[str], clients: int, threads: int, dtype: str, seq_len: int, extra="") -> float:
    port = free_port()
    serve_args = ["--dtype", dtype, *shlex.split(extra)]
    server, _ = launch_flover(model, serve_args, clients, threads, seq_len, http_port=port)
    try:
        url = f"http://127.0.0.1:{port}"
        return asyncio.run(post_all(url, texts, clients, served(url)))
    finally:
        server.stop()


def run_llama(
    binary: Path, gguf: Path, texts: list[str], clients: int, threads: int, seq_len: int, pooling: str = "mean"
) -> float:
    extra = ["--embeddings", "--pooling", pooling, "-ub", str(seq_len), "-b", str(max(2048, seq_len))]
    server, port = launch_llama(binary, gguf, clients, threads, seq_len, extra)
    try:
        return asyncio.run(post_all(f"http://127.0.0.1:{port}", texts, clients, None))
    finally:
        server.stop()


def run_sentence_transformers(model: Path, texts: list[str], threads: int, seq_len: int, dtype: str) -> float:
    import torch
    from sentence_transformers import SentenceTransformer

    torch.set_num_threads(threads)
    st = SentenceTransformer(str(model), device="cpu", model_kwargs={"dtype": getattr(torch, dtype)})
    st.max_seq_length = seq_len
    start = time.perf_counter()
    st.encode(texts, batch_size=32)
    return time.perf_counter() - start


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, required=True, help="a sentence-transformers directory")
    ap.add_argument("--gguf", type=Path, help="the same weights as a GGUF file (llama-server's; none: skipped)")
    ap.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "flover-bench", help="llama.cpp's source")
    ap.add_argument("--passages", type=int, default=2000)
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--dtype", default="float32", help="flover's (llama-server and sentence-transformers: the file's)")
    ap.add_argument("--seq-len", type=int, default=512, help="positions per input for all three")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, help="JSON results")
    ap.add_argument("--flover-args", default="", help="more `flover serve` flags (e.g. --pooling last)")
    ap.add_argument("--flover-gguf", action="store_true", help="flover serves the GGUF file (else the directory)")
    ap.add_argument("--llama-pooling", default="mean", help="llama-server's --pooling (Qwen3-Embedding: last)")
    ap.add_argument("--st-dtype", default="float32", help="sentence-transformers' dtype (bfloat16: as saved)")
    ap.add_argument(
        "--chat-streams",
        type=int,
        default=0,
        help="N > 0: instead, the TPOT of N chat streams alone and beside the passages (one flover server)",
    )
    args = ap.parse_args()
    if args.chat_streams:
        return chat_streams(args)

    tokenizer = tokenizer_of(args.model)
    texts = passages(args.passages, args.seed, tokenizer)
    tokens = sum(len(tokenizer.encode(t)) for t in texts)
    log(f"{len(texts)} passages, {tokens} tokens ({tokens / len(texts):.0f} a passage), {args.clients} clients")
    binary = llama_server(args.cache) if args.gguf else None
    times: dict[str, list[float]] = {"flover": [], "llama.cpp": [], "sentence-transformers": []}
    for round_ in range(args.rounds):
        runs = [
            (
                "flover",
                lambda: run_flover(
                    args.gguf if args.flover_gguf else args.model,
                    texts,
                    args.clients,
                    args.threads,
                    args.dtype,
                    args.seq_len,
                    args.flover_args,
                ),
            )
        ]
        if binary is not None:
            runs.append(
                (
                    "llama.cpp",
                    lambda: run_llama(
                        binary, args.gguf, texts, args.clients, args.threads, args.seq_len, args.llama_pooling
                    ),
                )
            )
        runs.append(
            (
                "sentence-transformers",
                lambda: run_sentence_transformers(args.model, texts, args.threads, args.seq_len, args.st_dtype),
            )
        )
        if round_ % 2:
            runs.reverse()
        for name, run in runs:
            seconds = run()
            times[name].append(seconds)
            log(f"round {round_ + 1}: {name} {len(texts) / seconds:.1f} passages/s")
    rate = {name: len(texts) / statistics.median(ts) for name, ts in times.items() if ts}
    result = {
        "passages": len(texts),
        "tokens": tokens,
        "clients": args.clients,
        "threads": args.threads,
        "dtype": args.dtype,
        "sentence_transformers_dtype": args.st_dtype,
        "llama_pooling": args.llama_pooling,
        "flover_model": "gguf" if args.flover_gguf else "directory",
        "passages_per_s": rate,
        "seconds": times,
        "flover_vs": {name: rate["flover"] / r for name, r in rate.items() if name != "flover"},
    }
    print(json.dumps(result, indent=1))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
    return 0


def chat_streams(args) -> int:
    """The issue's third figure: chat streams' TPOT alone and while passages go through, one server."""
    texts = passages(args.passages, args.seed, tokenizer_of(args.model))
    results = []
    for round_ in range(args.rounds):
        port = free_port()
        slots = args.chat_streams + args.clients
        serve_args = ["--dtype", args.dtype, *shlex.split(args.flover_args)]
        server, _ = launch_flover(args.model, serve_args, slots, args.threads, args.seq_len, port)
        try:
            url = f"http://127.0.0.1:{port}"
            results.append(asyncio.run(chats_beside_passages(url, served(url), texts, args.chat_streams, args.clients)))
        finally:
            server.stop()
        log(f"round {round_ + 1}: {results[-1]}")
    result = {key: statistics.median(r[key] for r in results) for key in results[0]}
    result |= {"rounds": results, "streams": args.chat_streams, "clients": args.clients, "dtype": args.dtype}
    print(json.dumps(result, indent=1))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
