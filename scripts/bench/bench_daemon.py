#!/usr/bin/env python3
"""The daemon measured from outside, on loopback only, bounded in count and time.

python scripts/bench/bench_daemon.py overhead --model models/bench-124m --repeats 3
    latency of the socket path against the offline API, 1 and 32 concurrent requests
python scripts/bench/bench_daemon.py soak --model models/bench-124m --rate 4 --duration 120
    Poisson traffic (streaming, non-streaming, cancels, bad input) against one daemon; reports
    requests, errors, slots free at the end, daemon memory at start and end
python scripts/bench/bench_daemon.py errors --model models/tiny
    what a client sees for each kind of bad input (a Markdown table)
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time

import msgpack
import zmq

from flover import LLM, SamplingParams
from flover.bench.metrics import resident_mib
from flover.client import Client, FloverError


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_daemon(model: str, *extra: str) -> tuple[subprocess.Popen, str]:
    addr = f"tcp://127.0.0.1:{free_port()}"
    proc = subprocess.Popen(
        [sys.executable, "-m", "flover.apps.cli", "serve", "--model", model, "--bind", addr, *extra],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert "ready on" in proc.stdout.readline()
    return proc, addr


def prompts(n: int, length: int, vocab: int = 50257) -> list[list[int]]:
    return [[(31 * r + 17 * i) % (vocab - 1) + 1 for i in range(length)] for r in range(n)]


def overhead(args) -> None:
    params = SamplingParams(max_new_tokens=args.new_tokens, ignore_eos=True)
    llm = LLM(args.model, max_slots=32, max_seq_len=args.prompt_len + args.new_tokens)
    proc, addr = start_daemon(args.model, "--max-slots", "32", "--max-seq-len", str(args.prompt_len + args.new_tokens))
    rows = {}
    try:
        with Client(addr, timeout=600) as c:
            for n in (1, 32):
                ps = prompts(n, args.prompt_len)
                offline, socket_path = [], []
                for _ in range(args.repeats):
                    start = time.perf_counter()
                    llm.generate(ps, params)
                    offline.append(time.perf_counter() - start)
                    start = time.perf_counter()
                    ids = [c.new_id() for _ in ps]
                    for rid, p in zip(ids, ps):
                        c.send(
                            {
                                "op": "generate",
                                "id": rid,
                                "input_ids": p,
                                "params": {"max_new_tokens": args.new_tokens, "ignore_eos": True},
                            }
                        )
                    for rid in ids:
                        c.wait(rid)
                    socket_path.append(time.perf_counter() - start)
                rows[n] = (statistics.median(offline), statistics.median(socket_path))
                print(n, offline, socket_path, flush=True)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    print(
        f"\n{args.prompt_len}-token prompts, {args.new_tokens} new tokens, median of {args.repeats}; wall time "
        "until every request's final result\n"
    )
    print("| concurrent requests | offline API (s) | through the socket (s) | overhead |\n|---:|---:|---:|---:|")
    for n, (a, b) in rows.items():
        print(f"| {n} | {a:.3f} | {b:.3f} | {100 * (b - a) / a:+.1f}% |")


def soak(args) -> None:
    proc, addr = start_daemon(args.model, "--max-slots", "32", "--max-seq-len", "256", "--max-waiting", "64")
    time.sleep(1.0)
    rss_start = resident_mib(proc.pid)
    rng = random.Random(0)
    counts = {
        "sent": 0,
        "final": 0,
        "cancelled": 0,
        "errors_expected": 0,
        "errors_unexpected": 0,
        "overloaded": 0,
        "timeouts": 0,
    }
    lock = threading.Lock()

    def one(kind: str, p: list[int]) -> None:
        outcome = "final"
        try:
            with Client(addr, timeout=120) as c:
                if kind == "stream":
                    for _ in c.stream(input_ids=p, max_new_tokens=rng.randint(8, 64), ignore_eos=True):
                        pass
                elif kind == "cancel":
                    events = c.stream(input_ids=p, request_id="x", max_new_tokens=128, ignore_eos=True)
                    next(events)
                    c.cancel("x")
                    outcome = "cancelled" if list(events)[-1]["finish_reason"] == "cancelled" else "final"
                elif kind == "bad":
                    try:
                        c.generate(input_ids=[10**9], max_new_tokens=4)
                        outcome = "errors_unexpected"
                    except FloverError:
                        outcome = "errors_expected"
                else:
                    c.generate(input_ids=p, max_new_tokens=rng.randint(8, 64), ignore_eos=True)
        except FloverError as e:
            outcome = "overloaded" if e.code == "overloaded" else "errors_unexpected"
        except TimeoutError:
            outcome = "timeouts"
        with lock:
            counts[outcome] += 1

    threads = []
    start = time.time()
    next_at = start
    rss_series, next_sample = [], start
    while time.time() - start < args.duration:
        if time.time() >= next_sample:
            rss_series.append(round(resident_mib(proc.pid)))
            next_sample += args.duration / 8
        next_at += rng.expovariate(args.rate)
        time.sleep(max(0.0, next_at - time.time()))
        kind = rng.choices(["plain", "stream", "cancel", "bad"], weights=[45, 40, 10, 5])[0]
        t = threading.Thread(target=one, args=(kind, prompts(1, rng.randint(8, 96))[0]))
        t.start()
        threads.append(t)
        counts["sent"] += 1
    for t in threads:
        t.join(timeout=180)
    wall = time.time() - start
    with Client(addr, timeout=10) as c:
        stats = c.stats()
    rss_end = resident_mib(proc.pid)
    proc.send_signal(signal.SIGTERM)
    code = proc.wait(timeout=60)
    print(
        json.dumps(
            {
                "duration_s": round(wall, 1),
                "rate_per_s": args.rate,
                **counts,
                "slots_used_at_end": stats["slots_used"],
                "in_flight_at_end": stats["in_flight"],
                "waiting_at_end": stats["waiting"],
                "daemon_counters": {
                    k: stats[k]
                    for k in ("requests", "completed", "cancelled", "rejected", "clients_gone", "tokens_out")
                },
                "rss_mib_start": round(rss_start),
                "rss_mib_end": round(rss_end),
                "rss_mib_every_eighth_of_the_run": rss_series,
                "exit_code": code,
            },
            indent=1,
        )
    )


def errors(args) -> None:
    proc, addr = start_daemon(args.model, "--max-seq-len", "128", "--max-message-bytes", "4096")
    cases = [
        ("not msgpack", [b"\xc1\xff garbage"]),
        ("msgpack, not a map", [msgpack.packb([1, 2])]),
        ("two frames", [b"a", msgpack.packb({"op": "health"})]),
        ("unknown op", [msgpack.packb({"op": "explode", "id": "a"})]),
        ("missing id", [msgpack.packb({"op": "generate", "prompt": "x"})]),
        ("no prompt", [msgpack.packb({"op": "generate", "id": "a"})]),
        ("unknown field", [msgpack.packb({"op": "generate", "id": "a", "prompt": "x", "colour": 1})]),
        ("prompt of wrong type", [msgpack.packb({"op": "generate", "id": "a", "prompt": 5})]),
        (
            "NaN temperature",
            [msgpack.packb({"op": "generate", "id": "a", "prompt": "x", "params": {"temperature": float("nan")}})],
        ),
        (
            "negative max_new_tokens",
            [msgpack.packb({"op": "generate", "id": "a", "prompt": "x", "params": {"max_new_tokens": -3}})],
        ),
        (
            "unknown sampling parameter",
            [msgpack.packb({"op": "generate", "id": "a", "prompt": "x", "params": {"max_tokens": 3}})],
        ),
        ("token id out of vocabulary", [msgpack.packb({"op": "generate", "id": "a", "input_ids": [1, 10**9]})]),
        ("empty prompt", [msgpack.packb({"op": "generate", "id": "a", "input_ids": []})]),
        ("prompt too long", [msgpack.packb({"op": "generate", "id": "a", "input_ids": list(range(1, 200))})]),
        ("bad chat messages", [msgpack.packb({"op": "generate", "id": "a", "messages": [{"role": 1}]})]),
        ("cancel of an unknown id", [msgpack.packb({"op": "cancel", "id": "zzz"})]),
        ("message over --max-message-bytes", [msgpack.packb({"op": "generate", "id": "a", "prompt": "x" * 10000})]),
    ]
    ctx = zmq.Context()
    print("| bad input | what the client gets |\n|---|---|")
    try:
        for name, frames in cases:
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(addr)
            sock.send_multipart(frames)
            if sock.poll(2000):
                e = msgpack.unpackb(sock.recv())
                print(f"| {name} | `{e['event']}` `{e.get('code')}`: {e.get('message')} |")
            else:
                print(f"| {name} | no reply (connection dropped by ZeroMQ); daemon unaffected |")
            sock.close()
        with Client(addr, timeout=5) as c:
            c.send({"op": "generate", "id": "d", "input_ids": [1], "params": {"max_new_tokens": 100}})
            c.send({"op": "generate", "id": "d", "input_ids": [1], "params": {"max_new_tokens": 100}})
            first = c.next_event("d")
            print(
                f"| same id twice in flight | `{first['event']}` `{first.get('code')}`: {first.get('message')} "
                f"(the first request completes) |"
            )
            print(f"| (afterwards) health | `{c.health()['status']}` |")
    finally:
        ctx.term()
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=("overhead", "soak", "errors"))
    ap.add_argument("--model", required=True)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--rate", type=float, default=4.0, help="soak: requests per second (Poisson)")
    ap.add_argument("--duration", type=float, default=120.0, help="soak: seconds of traffic")
    args = ap.parse_args()
    {"overhead": overhead, "soak": soak, "errors": errors}[args.what](args)


if __name__ == "__main__":
    main()
