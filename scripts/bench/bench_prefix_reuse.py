#!/usr/bin/env python3
"""Multi-turn chats with a shared system prompt: flover with and without its prefix cache, and
llama.cpp's llama-server with its prompt cache, on one model and one seeded workload.

    python scripts/bench/bench_prefix_reuse.py --model ~/.cache/flover-tests/SmolLM2-135M-Instruct.Q4_1.gguf

The workload (token ids, the same for every engine in a run): one system prompt of
--system-len random ids shared by every conversation; --conversations conversations starting at
Poisson times (mean gap --interval-ms); each has 3-5 turns; turn k sends the whole history —
system prompt, every earlier user message and every earlier answer (the ids the server returned)
— plus a new user message of --user-len ids, and asks for --gen-len tokens (greedy, EOS
ignored, streamed). A conversation sends its next turn as soon as the answer is complete.

Engines (alternating order per run, median of --runs): `flover` (bfloat16, --prefix-cache 0),
`flover + prefix cache` (the default 256 MiB), `llama.cpp f16` (llama-server -np N, its slot
prompt reuse and RAM prompt cache, `cache_prompt: true`). Builds and conversions are cached
under --cache as scripts/bench/bench_vs_llamacpp.py does (nothing is committed).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import statistics
import sys
import threading
import time
from pathlib import Path

from flover.bench.metrics import medians as median_of

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_vs_llamacpp import converted, hf_directory, launch_flover, launch_llama, llama_server, log


def start_flover(model: Path, slots: int, seq_len: int, threads: int, prefix_mib: float):
    from flover.client import Client

    server, addr = launch_flover(
        model, ["--dtype", "bfloat16", "--prefix-cache", str(prefix_mib)], slots, threads, seq_len
    )

    def send(ids: list[int], n: int) -> tuple[float, list[int], int]:
        start, first, out, cached = time.perf_counter(), None, [], 0
        with Client(addr, timeout=600) as c:
            for event in c.stream(input_ids=ids, max_new_tokens=n, ignore_eos=True):
                if event["event"] == "token":
                    first = first or time.perf_counter() - start
                    out += event["token_ids"]
                elif event["event"] == "final":
                    cached = event["usage"].get("cached_tokens", 0)
        return first, out, cached

    return server, send


def start_llama(binary: Path, model: Path, slots: int, seq_len: int, threads: int):
    server, port = launch_llama(binary, model, slots, threads, seq_len)

    def send(ids: list[int], n: int) -> tuple[float, list[int], int]:
        start = time.perf_counter()
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
        body = {
            "prompt": ids,
            "n_predict": n,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "cache_prompt": True,
            "return_tokens": True,
        }
        conn.request("POST", "/completion", json.dumps(body), {"Content-Type": "application/json"})
        response, first, out, cached = conn.getresponse(), None, [], 0
        for line in response:
            if not line.startswith(b"data: "):
                continue
            event = json.loads(line[6:])
            out += event.get("tokens", [])
            if out and first is None:
                first = time.perf_counter() - start
            if event.get("stop"):
                cached = event.get("timings", {}).get("cache_n", 0)
                break
        return first, out, cached

    return server, send


def conversations(args, seed: int) -> tuple[list[int], list[tuple[float, list[list[int]]]]]:
    """(the system prompt, [(start time, the user messages of each turn)])."""
    rng = random.Random(seed)
    ids = lambda n: [rng.randrange(1000, 40000) for _ in range(n)]  # noqa: E731
    system, at, convs = ids(args.system_len), 0.0, []
    for _ in range(args.conversations):
        convs.append((at, [ids(args.user_len) for _ in range(rng.randint(3, 5))]))
        at += rng.expovariate(1000 / args.interval_ms)
    return system, convs


def run_workload(send, system: list[int], convs, gen_len: int) -> dict:
    turns: list[tuple[int, float, int, int, int]] = []  # (turn, ttft, prompt len, cached, out tokens)
    lock, start = threading.Lock(), time.perf_counter()

    def talk(at: float, messages: list[list[int]]) -> None:
        time.sleep(max(0.0, start + at - time.perf_counter()))
        history = list(system)
        for k, message in enumerate(messages):
            history += message
            ttft, answer, cached = send(history, gen_len)
            with lock:
                turns.append((k, ttft, len(history), cached, len(answer)))
            history += answer

    threads = [threading.Thread(target=talk, args=c) for c in convs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    later = [t[1] for t in turns if t[0] > 0]
    return {
        "tok_s": sum(t[4] for t in turns) / wall,
        "ttft_p50": statistics.median(t[1] for t in turns),
        "ttft_p50_first_turns": statistics.median(t[1] for t in turns if t[0] == 0),
        "ttft_p50_later_turns": statistics.median(later),
        "ttft_p90": statistics.quantiles([t[1] for t in turns], n=10)[-1],
        "cached_share": sum(t[3] for t in turns) / sum(t[2] for t in turns),
        "turns": len(turns),
        "wall_s": wall,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="a GGUF file (SmolLM2-135M-Instruct)")
    ap.add_argument("--cache", default=str(Path.home() / ".cache" / "flover" / "llama.cpp"))
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--conversations", type=int, default=16)
    ap.add_argument("--interval-ms", type=float, default=500.0, help="mean gap between conversation starts")
    ap.add_argument("--system-len", type=int, default=400)
    ap.add_argument("--user-len", type=int, default=32)
    ap.add_argument("--gen-len", type=int, default=48)
    ap.add_argument("--slots", type=int, default=16)
    ap.add_argument("--max-seq-len", type=int, default=1024)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--engines", default="flover,flover + prefix cache,llama.cpp f16")
    ap.add_argument("--out", default="bench-prefix-reuse.json")
    args = ap.parse_args()
    cache = Path(args.cache)
    gguf = Path(args.model)
    binary = llama_server(cache)
    hf_dir = hf_directory(gguf, cache)
    f16 = converted(hf_dir, "f16", cache)
    starters = {
        "flover": lambda: start_flover(hf_dir, args.slots, args.max_seq_len, args.threads, 0),
        "flover + prefix cache": lambda: start_flover(hf_dir, args.slots, args.max_seq_len, args.threads, 256),
        "llama.cpp f16": lambda: start_llama(binary, f16, args.slots, args.max_seq_len, args.threads),
    }
    names = [n.strip() for n in args.engines.split(",")]
    table: dict[str, list[dict]] = {}
    for run in range(args.runs):
        system, convs = conversations(args, seed=run)
        order = names if run % 2 == 0 else names[::-1]
        for name in order:
            server, send = starters[name]()
            try:
                send([7] * 32, 4)  # warm-up (ids no conversation uses)
                r = run_workload(send, system, convs, args.gen_len)
            finally:
                server.stop()
            table.setdefault(name, []).append(r)
            log(
                f"run {run + 1}/{args.runs} {name:22s} {r['tok_s']:.1f} tok/s, TTFT p50 {1000 * r['ttft_p50']:.0f} ms "
                f"(first turns {1000 * r['ttft_p50_first_turns']:.0f}, later {1000 * r['ttft_p50_later_turns']:.0f}), "
                f"p90 {1000 * r['ttft_p90']:.0f} ms, cached {100 * r['cached_share']:.0f}% of prompt tokens"
            )
    keys = ("tok_s", "ttft_p50", "ttft_p50_first_turns", "ttft_p50_later_turns", "ttft_p90", "cached_share")
    medians = {name: median_of(runs, keys) for name, runs in table.items()}
    Path(args.out).write_text(json.dumps({"args": vars(args), "medians": medians, "runs": table}, indent=1))
    print(
        f"\nmedians of {args.runs} alternating run(s): {args.conversations} conversations of 3-5 turns, "
        f"{args.system_len}-token shared system prompt, {args.user_len}-token user turns, {args.gen_len} tokens out\n"
    )
    print(
        "| engine | out tok/s | TTFT p50 | TTFT p50, first turns | TTFT p50, later turns | TTFT p90 | "
        "prompt tokens reused |\n|---|---:|---:|---:|---:|---:|---:|"
    )
    for name, m in medians.items():
        print(
            f"| {name} | {m['tok_s']:.1f} | {1000 * m['ttft_p50']:.0f} ms | {1000 * m['ttft_p50_first_turns']:.0f} ms "
            f"| {1000 * m['ttft_p50_later_turns']:.0f} ms | {1000 * m['ttft_p90']:.0f} ms | "
            f"{100 * m['cached_share']:.0f}% |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
