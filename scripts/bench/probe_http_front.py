"""What costly or half-sent input does to the rest of a running `flover serve --http` (issue:
hardening, second pass). For a checkout (--src, default this one) it starts a daemon with the
HTTP front and prints one line per probe:

  tokenize   the longest /health answer while 4 clients /tokenize a long digit string each
  intake     the longest gap between an innocent stream's token events while another client sends
             10 long text prompts over the socket (tokenized on the loop before this change)
  slowloris  how long 200 half-sent requests keep their connections
  legit      what a legitimate 1,500-word text prompt waits for its first token beside 7 streams
             (the cost of tokenizing off the loop at low priority, if any)

    python scripts/bench/probe_http_front.py --model SmolLM2-135M-Instruct.Q4_1.gguf [--src OTHER_CHECKOUT]

Figures are wall-clock on this machine (noisy): compare checkouts in one run.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.request

import msgpack
import zmq


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(src: str, model: str, max_seq_len: int) -> tuple[subprocess.Popen, str, int]:
    zport, hport = free_port(), free_port()
    env = {**os.environ, "PYTHONPATH": src, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "flover.apps.cli",
            "serve",
            "--model",
            model,
            "--bind",
            f"tcp://127.0.0.1:{zport}",
            "--http",
            f"127.0.0.1:{hport}",
            "--max-seq-len",
            str(max_seq_len),
            "--max-slots",
            "8",
            "--speculate",
            "0",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=env,
        cwd=src,
    )
    assert "ready" in proc.stdout.readline()
    return proc, f"tcp://127.0.0.1:{zport}", hport


def post(port: int, path: str, body: dict, timeout: float = 120) -> int:
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}", data=json.dumps(body).encode(), headers={"content-type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def probe_tokenize(port: int, text_bytes: int) -> str:
    text = "1" * text_bytes
    workers = [threading.Thread(target=post, args=(port, "/tokenize", {"prompt": text})) for _ in range(4)]
    for w in workers:
        w.start()
    worst = 0.0
    while any(w.is_alive() for w in workers):
        started = time.perf_counter()
        urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=120).read()
        worst = max(worst, time.perf_counter() - started)
        time.sleep(0.02)
    return f"tokenize   longest /health answer while 4 x {text_bytes} B /tokenize ran: {1000 * worst:.0f} ms"


def probe_intake(addr: str, text_bytes: int) -> str:
    ctx = zmq.Context()
    innocent, hostile = ctx.socket(zmq.DEALER), ctx.socket(zmq.DEALER)
    innocent.connect(addr)
    hostile.connect(addr)
    innocent.send(
        msgpack.packb(
            {
                "op": "generate",
                "id": "i",
                "stream": True,
                "prompt": "Tell me a story",
                "params": {"max_new_tokens": 300, "ignore_eos": True},
            }
        )
    )
    gaps, last, sent = [], None, False
    while True:
        event = msgpack.unpackb(innocent.recv())
        now = time.perf_counter()
        if last is not None and sent:
            gaps.append(now - last)
        last = now
        if event["event"] == "token" and not sent and len(gaps) == 0:
            for i in range(10):
                hostile.send(
                    msgpack.packb(
                        {"op": "generate", "id": i, "prompt": "1" * text_bytes, "params": {"max_new_tokens": 1}}
                    )
                )
            sent = True
        if event["event"] in ("final", "error"):
            break
    answers = [msgpack.unpackb(hostile.recv())["event"] for _ in range(10)]
    ctx.destroy(0)
    return (
        f"intake     longest token gap of a stream while 10 x {text_bytes} B prompts arrived: "
        f"{1000 * max(gaps):.0f} ms (their answers: {sorted(set(answers))})"
    )


def probe_slowloris(port: int) -> str:
    socks = []
    for _ in range(200):
        s = socket.create_connection(("127.0.0.1", port))
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Le")
        s.settimeout(0.05)
        socks.append(s)
    started, open_ = time.monotonic(), set(range(200))
    while open_ and time.monotonic() - started < 30:
        for i in list(open_):
            try:
                if socks[i].recv(1) == b"":
                    open_.discard(i)
            except socket.timeout:
                pass
            except OSError:
                open_.discard(i)
    for s in socks:
        s.close()
    return (
        f"slowloris  200 half-sent requests: {200 - len(open_)} closed by the server within "
        f"{time.monotonic() - started:.1f} s, {len(open_)} still open after 30 s"
    )


def probe_legit(addr: str, rounds: int = 6) -> str:
    ctx = zmq.Context()
    background, client = ctx.socket(zmq.DEALER), ctx.socket(zmq.DEALER)
    background.connect(addr)
    client.connect(addr)
    words = "the quick brown fox jumps over a lazy dog while rivers run to seas and mountains stand tall".split()
    ttfts = []
    for k in range(rounds):
        for i in range(7):
            background.send(
                msgpack.packb(
                    {
                        "op": "generate",
                        "id": f"{k}-{i}",
                        "prompt": f"Story {k} {i}",
                        "params": {"max_new_tokens": 300, "ignore_eos": True},
                    }
                )
            )
        time.sleep(0.3)
        text = " ".join(words[(j * 7 + k) % len(words)] for j in range(1500))
        started = time.perf_counter()
        client.send(
            msgpack.packb({"op": "generate", "id": k, "stream": True, "prompt": text, "params": {"max_new_tokens": 2}})
        )
        first = None
        while True:
            event = msgpack.unpackb(client.recv())
            if event["event"] == "token" and first is None:
                first = time.perf_counter() - started
            if event["event"] in ("final", "error"):
                break
        ttfts.append(first)
        for _ in range(7):
            while msgpack.unpackb(background.recv())["event"] not in ("final", "error"):
                pass
    ctx.destroy(0)
    ttfts.sort()
    return f"legit      TTFT of a 1500-word prompt beside 7 streams: median {1000 * ttfts[len(ttfts) // 2]:.0f} ms"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--src", default=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    ap.add_argument("--max-seq-len", type=int, default=2048)
    ap.add_argument("--text-bytes", type=int, default=300_000, help="digits per long text (fits the byte bound)")
    args = ap.parse_args()
    proc, addr, port = start(args.src, args.model, args.max_seq_len)
    try:
        print(probe_tokenize(port, args.text_bytes), flush=True)
        print(probe_intake(addr, args.text_bytes), flush=True)
        print(probe_slowloris(port), flush=True)
        print(probe_legit(addr), flush=True)
    finally:
        proc.terminate()
        proc.wait(30)


if __name__ == "__main__":
    main()
