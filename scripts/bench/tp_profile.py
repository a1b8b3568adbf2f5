#!/usr/bin/env python3
"""One tensor-parallel measurement, run alone (TP=1) or under mpirun (TP=N); driven by
scripts/bench/bench_tp.py. For each batch size B: B requests decode `--new-tokens` tokens together;
reports output tok/s, decode iteration time and the time spent inside all-reduce per iteration
(the leader's view), plus every rank's resident memory after loading. Prints JSON lines."""

from __future__ import annotations

import argparse
import json
import time

from flover.config import EngineConfig, SamplingParams
from flover.engine.engine import Engine
from flover.parallel.launch import make_communicator


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]

    comm = make_communicator("cpu")
    timer = {"t": 0.0, "n": 0}
    if comm is not None:
        reduce = comm.all_reduce

        def timed_all_reduce(tensor):
            start = time.perf_counter()
            reduce(tensor)
            timer["t"] += time.perf_counter() - start
            timer["n"] += 1

        comm.all_reduce = timed_all_reduce
    engine = Engine(
        EngineConfig(
            args.model, max_slots=max(batches), num_threads=args.threads, max_seq_len=args.prompt_len + args.new_tokens
        ),
        comm,
    )
    rank = comm.rank if comm else 0
    print(json.dumps({"rank": rank, "ranks": comm.size if comm else 1, "rss_mib": rss_mib()}), flush=True)
    if not engine.is_leader:
        engine.follow()
        return
    params = SamplingParams(max_new_tokens=args.new_tokens, ignore_eos=True)
    vocab = engine.model_config.vocab_size
    for b in batches:
        for r in range(b):
            engine.add_request([(13 * r + 7 * i) % (vocab - 1) + 1 for i in range(args.prompt_len)], params)
        start = time.perf_counter()
        decode_time, decode_iters, reduce_time, reduce_calls = 0.0, 0, 0.0, 0
        while engine.has_unfinished():
            live_before = engine.scheduler.num_live
            timer["t"], timer["n"] = 0.0, 0
            t0 = time.perf_counter()
            outs = engine.step()
            dt = time.perf_counter() - t0
            if live_before == b and all(len(o.token_ids) > 1 for o in outs) and len(outs) == b:
                decode_time += dt
                decode_iters += 1
                reduce_time += timer["t"]
                reduce_calls += timer["n"]
        wall = time.perf_counter() - start
        print(
            json.dumps(
                {
                    "rank": 0,
                    "batch": b,
                    "tok_s": b * args.new_tokens / wall,
                    "iter_ms": 1000 * decode_time / max(decode_iters, 1),
                    "allreduce_ms_per_iter": 1000 * reduce_time / max(decode_iters, 1),
                    "allreduce_calls_per_iter": reduce_calls / max(decode_iters, 1),
                }
            ),
            flush=True,
        )
    engine.shutdown()


if __name__ == "__main__":
    main()
