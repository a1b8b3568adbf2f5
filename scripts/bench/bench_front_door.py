#!/usr/bin/env python3
"""What one front door sustains: world rank 0's daemon loop over data-parallel groups whose
engines cost nothing, so that the loop itself is the bound (docs/data_parallel.md).

    python scripts/bench/bench_front_door.py --groups 8 --slots 32 --seconds 10

Rank 0's real code runs: the Daemon (ZeroMQ intake, one event per token to streaming clients,
finals, accounting), EngineGroups (routing, each group's message unpacked with msgpack, outputs
rebuilt) and group 0's output path. Each group's engine is replaced by one that gives every running
request one token an iteration without a model, and the other groups' leaders run in this process
(their step and msgpack packing are timed apart and left out of the loop's figure). Clients run in
another process: --clients connections keep groups x slots requests in flight, streamed or not.
Prints token events / s and CPU µs per token of the daemon's process (its ZeroMQ I/O thread
included), and what that gives as requests / s of --new-tokens tokens.
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from dataclasses import asdict

import msgpack

from flover.config import EngineConfig, SamplingParams
from flover.engine.groups import EngineGroups, _wire
from flover.engine.interface import EngineStats
from flover.engine.output import OutputProcessor
from flover.parallel.groups import GroupLayout
from flover.request import FinishReason, Request, RequestInput, RequestState, Timings
from flover.server.daemon import Daemon, ServeConfig


class InstantEngine:
    """A group's engine with no model: every running request gets one token an iteration."""

    def __init__(self, slots: int, max_seq_len: int = 4096):
        self.config = EngineConfig(model="instant", max_slots=slots, max_seq_len=max_seq_len)
        self.max_seq_len, self.comm, self.iterations, self.last_step_tokens = max_seq_len, None, 0, 0
        self.waiting: deque[Request] = deque()
        self.running: dict[str, Request] = {}
        self.text = OutputProcessor(None)

    def make_request(
        self,
        prompt,
        params,
        request_id,
        stream=False,
        messages=None,
        cache_salt=None,
        arrival_time=None,
        tokenized=None,
    ) -> Request:
        return Request(
            request_id,
            list(prompt),
            params,
            stream=False,
            cache_salt=cache_salt,
            timings=Timings(arrival=arrival_time or time.perf_counter()),
        )

    def enqueue(self, request: Request) -> None:
        self.waiting.append(request)

    def abort(self, request_id: str) -> bool:
        r = self.running.get(request_id)
        if r is not None:
            r.finish(FinishReason.CANCELLED, time.perf_counter())
        return r is not None

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def step(self):
        now = time.perf_counter()
        while self.waiting and len(self.running) < self.config.max_slots:
            r = self.waiting.popleft()
            r.state, r.timings.scheduled = RequestState.RUNNING, now
            self.running[r.request_id] = r
        outputs = []
        for r in list(self.running.values()):
            if not r.finished:
                r.output_token_ids.append(len(r.output_token_ids) % 1000 + 1)
                r.timings.first_token = r.timings.first_token or now
                if len(r.output_token_ids) >= r.params.max_new_tokens:
                    r.finish(FinishReason.LENGTH, now)
            outputs.append(
                self.text.output(r, r.output_token_ids[-1:] if r.finish_reason is not FinishReason.CANCELLED else [])
            )
            if r.finished:
                del self.running[r.request_id]
        self.iterations += 1
        self.last_step_tokens = len(outputs)
        return outputs

    def timed_iterations(self) -> list:
        return []

    def stats(self) -> EngineStats:
        return EngineStats(
            running=len(self.running),
            waiting=len(self.waiting),
            slots_total=self.config.max_slots,
            kv_bytes=0,
            kv_tokens=0,
            kv_use=0.0,
            iterations=self.iterations,
            last_step_tokens=self.last_step_tokens,
            shuffle_moves=0,
            shuffle_bytes=0,
            shuffle_seconds=0.0,
            draft_tokens=0,
            accepted_tokens=0,
            prefix_cache=None,
            native_kernels=None,
        )

    def shutdown(self) -> None:
        pass


class InProcessLeaders:
    """The Mailbox of rank 0 with the other groups' leaders in this process: what rank 0 sends
    them and what they send back goes through msgpack as over MPI; their own work is timed apart."""

    def __init__(self, groups: int, slots: int):
        self.leaders = {g: InstantEngine(slots) for g in range(1, groups)}
        self.leader_seconds = 0.0

    def send(self, dest: int, message) -> None:
        message = msgpack.unpackb(msgpack.packb(message))  # (the leader's unpacking counted as rank 0's)
        engine = self.leaders.get(dest)
        if "add" in message:
            request_id, token_ids, params, salt, stream, age = message["add"]
            engine.enqueue(
                engine.make_request(RequestInput(token_ids, SamplingParams(**params), request_id, cache_salt=salt))
            )
        elif "cancel" in message:
            engine.abort(message["cancel"])

    def receive(self):
        found = []
        for group, engine in self.leaders.items():
            if not engine.has_unfinished():
                continue
            started = time.perf_counter()
            packed = msgpack.packb({"outputs": [_wire(out) for out in engine.step()], "stats": asdict(engine.stats())})
            self.leader_seconds += time.perf_counter() - started
            found.append((group, msgpack.unpackb(packed)))
        return found

    def wait(self, timeout: float, max_sleep: float = 0.002) -> None:
        pass  # the leaders answer at once

    def flush(self, timeout: float = 5.0) -> None:
        pass


CLIENT = r"""
import json, sys, time, msgpack, zmq
addr, clients, in_flight, new_tokens, seconds, stream = sys.argv[1:7]
clients, in_flight, new_tokens = int(clients), int(in_flight), int(new_tokens)
seconds, stream = float(seconds), stream == "1"
ctx = zmq.Context()
socks = [ctx.socket(zmq.DEALER) for _ in range(clients)]
poller = zmq.Poller()
for s in socks:
    s.connect(addr); poller.register(s, zmq.POLLIN)
ids, events, tokens, finals, open_ = 0, 0, 0, 0, 0
def submit(s):
    global ids, open_
    ids += 1; open_ += 1
    s.send(msgpack.packb({"op": "generate", "id": ids, "input_ids": [1 + ids % 900] * 16, "stream": stream,
                          "params": {"max_new_tokens": new_tokens, "ignore_eos": True}}))
for i in range(in_flight):
    submit(socks[i % clients])
started = time.perf_counter(); first = None
while open_:
    for s, _ in poller.poll(1000):
        while True:
            try:
                event = msgpack.unpackb(s.recv(zmq.NOBLOCK))
            except zmq.Again:
                break
            kind = event["event"]
            if kind == "token":
                events += 1; tokens += len(event["token_ids"])
            elif kind == "final":
                finals += 1; open_ -= 1
                if not stream:
                    tokens += len(event["token_ids"])
                if time.perf_counter() - started < seconds:
                    submit(s)
            elif kind == "error":
                print("error", event, file=sys.stderr); open_ -= 1
print(json.dumps({"seconds": time.perf_counter() - started, "events": events, "tokens": tokens, "finals": finals}))
"""


def run(args, stream: bool) -> dict:
    slots = args.slots
    leaders = InProcessLeaders(args.groups, slots)
    front = EngineGroups(InstantEngine(slots), leaders, GroupLayout(0, tuple(range(args.groups))), world=None)
    with socket.socket() as probe:  # a free port
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    daemon = Daemon(
        front,
        ServeConfig(bind=f"tcp://127.0.0.1:{port}", handle_signals=False, max_waiting=args.groups * slots * 2),
        model_name="instant",
    )
    server = threading.Thread(target=daemon.serve_forever, daemon=True)
    server.start()
    cpu0, wall0 = time.process_time(), time.perf_counter()
    client = subprocess.run(
        [
            sys.executable,
            "-c",
            CLIENT,
            f"tcp://127.0.0.1:{port}",
            str(args.clients),
            str(args.groups * slots),
            str(args.new_tokens),
            str(args.seconds),
            "1" if stream else "0",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    daemon.draining = True
    server.join(10)
    got = json.loads(client.stdout)
    loop_cpu = cpu - leaders.leader_seconds
    return {
        "stream": stream,
        "tokens/s": got["tokens"] / got["seconds"],
        "requests/s": got["finals"] / got["seconds"],
        "events": got["events"],
        "cpu_us_per_token": 1e6 * loop_cpu / got["tokens"],
        "cpu_busy": loop_cpu / wall,
        "leaders_us_per_token": 1e6 * leaders.leader_seconds / got["tokens"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--slots", type=int, default=32)
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--seconds", type=float, default=10)
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    rows = [run(args, stream) for _ in range(args.runs) for stream in (True, False)]
    for stream in (True, False):
        mine = sorted((r for r in rows if r["stream"] is stream), key=lambda r: r["tokens/s"])
        median = mine[len(mine) // 2]
        print(
            f"{'streamed' if stream else 'not streamed'}: {median['tokens/s']:,.0f} tokens/s delivered "
            f"({median['requests/s']:,.0f} requests/s of {args.new_tokens} tokens), daemon process "
            f"{median['cpu_us_per_token']:.2f} µs CPU a token ({100 * median['cpu_busy']:.0f}% of a core), "
            f"in-process leaders {median['leaders_us_per_token']:.2f} µs a token (left out); runs: "
            + ", ".join(f"{r['tokens/s']:,.0f}" for r in mine)
        )


if __name__ == "__main__":
    main()
