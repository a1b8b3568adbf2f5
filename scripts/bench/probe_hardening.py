"""What an adversarial client does to a running `flover serve`, class by class (issue: hardening).

Starts a daemon on a tiny random model, and for each probe prints one line: what the hostile
client saw, and what an innocent stream running beside it saw. Uses raw ZeroMQ + msgpack (no
flover client code), so it can probe any version of the daemon:

    python scripts/bench/probe_hardening.py --model models/tiny [--src DIR]   # DIR: another checkout to probe

Numbers (stalls, slowdowns) are wall-clock figures of this machine: compare versions in one run.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import threading
import time

import msgpack
import zmq


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Daemon:
    def __init__(self, src: str, model: str, *extra: str):
        self.addr = f"tcp://127.0.0.1:{free_port()}"
        env = {**os.environ, "PYTHONPATH": src, "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "flover.apps.cli",
                "serve",
                "--model",
                model,
                "--bind",
                self.addr,
                "--max-seq-len",
                "512",
                "--max-slots",
                "40",
                *extra,
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env=env,
            cwd=src,
        )
        assert "ready" in self.proc.stdout.readline()

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()


def dealer(addr: str, kind=zmq.DEALER):
    sock = zmq.Context.instance().socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(addr)
    return sock


def send(sock, rid, params=None, stream=False, **prompt):
    prompt = prompt or {"input_ids": [1, 2, 3]}
    sock.send(msgpack.packb({"op": "generate", "id": rid, "params": params or {}, "stream": stream, **prompt}))


def recv(sock, timeout=5.0):
    return msgpack.unpackb(sock.recv(), strict_map_key=False) if sock.poll(int(timeout * 1000)) else None


def first_reply(sock, timeout=5.0):
    while (event := recv(sock, timeout)) is not None:
        if event.get("event") != "keepalive":
            return event
    return None


def describe(event) -> str:
    if event is None:
        return "no reply"
    if event.get("event") == "error":
        return f"error {event.get('code')} (id {event.get('id')!r})"
    return f"{event.get('event')} {event.get('finish_reason', '')} (id {event.get('id')!r})".strip()


class Victim:
    """An innocent stream of `tokens` tokens; records the gaps between its token events."""

    def __init__(self, addr: str, tokens: int = 300):
        self.sock = dealer(addr)
        send(self.sock, "victim", {"max_new_tokens": tokens, "ignore_eos": True}, stream=True)
        self.times, self.end = [], None
        self.thread = threading.Thread(target=self._read)
        self.thread.start()

    def _read(self):
        while (event := recv(self.sock, 30)) is not None:
            if event["event"] == "token":
                self.times.append(time.perf_counter())
            elif event["event"] != "keepalive":
                self.end = event
                return

    def result(self) -> str:
        self.thread.join(60)
        gaps = [b - a for a, b in zip(self.times, self.times[1:])] or [0]
        return f"victim: {describe(self.end)}, {len(self.times)} token events, longest gap {1000 * max(gaps):.0f} ms"


def probe(name, daemon, action) -> None:
    victim = Victim(daemon.addr)
    time.sleep(0.05)
    try:
        seen = action(daemon.addr)
    except Exception as e:
        seen = f"probe failed: {e!r}"
    print(f"| {name} | {seen} | {victim.result()} |", flush=True)


def hostile_values(addr):
    sock = dealer(addr)
    out = []
    for rid, params in (
        ("k", {"top_k": 2**63}),
        ("t", {"temperature": 2**63}),
        ("e", {"ignore_eos": "false"}),
        ("l", {"logprobs": [[[[1]]]]}),
        ("s", {"stop": {"zz": 1}}),
    ):
        send(sock, rid, {**params, "max_new_tokens": 4})
        out.append(f"{next(iter(params))}: {describe(first_reply(sock))}")
    return "; ".join(out)


def subnormal_temperature(addr):
    sock = dealer(addr)
    send(sock, "g", {"max_new_tokens": 8, "ignore_eos": True})
    greedy = first_reply(sock)
    send(sock, "s", {"max_new_tokens": 8, "ignore_eos": True, "temperature": 1e-45})
    tiny = first_reply(sock)
    if tiny is None or tiny.get("event") != "final":
        return describe(tiny)
    return f"T=1e-45 gives {'the greedy tokens' if tiny['token_ids'] == greedy['token_ids'] else tiny['token_ids']}"


def big_prompts(addr):
    sock = dealer(addr)
    for i in range(10):
        send(sock, f"big{i}", {"max_new_tokens": 4}, prompt="word " * 200_000)
    replies = [describe(first_reply(sock, 30)) for _ in range(10)]
    return f"10 x 1 MB prompts: {sorted(set(replies))}"


def many_stop_strings(addr):
    sock = dealer(addr)
    for i in range(8):
        send(sock, f"stop{i}", {"max_new_tokens": 200, "ignore_eos": True, "stop": [f"zq{j}x" for j in range(40_000)]})
    replies = [describe(first_reply(sock, 60)) for _ in range(8)]
    return f"8 x 40,000 stop strings: {sorted(set(replies))}"


def multipart(addr):
    sock = dealer(addr)
    sock.send_multipart([b"x" * (1 << 20)] * 300 + [msgpack.packb({"op": "health", "id": "h"})])
    return f"300 frames x 1 MB: {describe(first_reply(sock))}"


def id_reuse_and_types(addr):
    sock = dealer(addr)
    send(sock, "a", {"max_new_tokens": 2})
    first = describe(first_reply(sock))
    send(sock, "a", {"max_new_tokens": 2})
    again = describe(first_reply(sock))
    send(sock, 7, {"max_new_tokens": 2})
    integer = first_reply(sock)
    send(sock, "", {"max_new_tokens": 2})
    empty = describe(first_reply(sock))
    return (
        f"id 'a' then again: {first}, then {again}; id 7 comes back as {integer and integer.get('id')!r}; "
        f"empty id: {empty}"
    )


def req_socket(addr):
    sock = dealer(addr, zmq.REQ)
    send(sock, "r", {"max_new_tokens": 2})
    return f"REQ socket: {describe(first_reply(sock))}"


def routing_id(addr):
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.ROUTING_ID, b"chosen")
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(addr)
    send(sock, "x", {"max_new_tokens": 2})
    return f"socket with its own routing id: {describe(first_reply(sock))}"


def slow_reader(addr):
    sock = dealer(addr)
    for i in range(40):
        send(sock, i, {"max_new_tokens": 480, "ignore_eos": True}, stream=True)
    time.sleep(6)
    tokens, ends = 0, {}
    while len(ends) < 40 and (event := recv(sock, 20)) is not None:
        if event["event"] == "token":
            tokens += 1
        elif event["event"] != "keepalive":
            ends[event["id"]] = event.get("finish_reason") or event.get("code")
    kinds = {k: list(ends.values()).count(k) for k in set(ends.values())}
    return f"40 x 480 tokens, 6 s unread: {tokens} of 19200 token events, ends {kinds}, {40 - len(ends)} missing"


PROBES = [
    ("out-of-range / wrongly typed values", hostile_values),
    ("subnormal temperature", subnormal_temperature),
    ("1 MB prompts", big_prompts),
    ("40,000 stop strings", many_stop_strings),
    ("multipart", multipart),
    ("ids", id_reuse_and_types),
    ("REQ socket", req_socket),
    ("chosen routing id", routing_id),
    ("slow reader", slow_reader),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--src", default=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    args = ap.parse_args()
    print(f"| probe | hostile client saw | innocent stream beside it saw |  ({args.src})\n|---|---|---|")
    for name, action in PROBES:
        daemon = Daemon(args.src, os.path.abspath(args.model))
        try:
            probe(name, daemon, action)
        finally:
            daemon.stop()


if __name__ == "__main__":
    main()
