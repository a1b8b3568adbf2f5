#!/usr/bin/env python3
"""The prefix cache on disk across a restart: a long chat's next turn after `flover serve` was
restarted, with the cache's directory (--prefix-cache-dir) and without (cold).

    python scripts/bench/bench_prefix_restart.py --model ~/.cache/flover-tests/SmolLM2-135M-Instruct.Q4_1.gguf

One conversation of --turns turns (token ids, seeded): turn k sends the whole history (every
earlier user message of --user-len random ids and every earlier answer) plus a new message, and
takes --gen-len greedy tokens (EOS ignored). A server with a fresh directory runs turns 1 to
turns - 1 and is stopped (SIGTERM: it drains and writes what it stored). Then, --rounds times
in alternating order: a server on a copy of that directory, and one on an empty directory, each
sent the last turn: its TTFT (the daemon's own, from arrival to first token), its cached tokens,
and whether both gave the same tokens. Medians of the rounds; the machine and the files' bytes
with them. Nothing is committed but the JSON (--out).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_vs_llamacpp import launch_flover, log


def machine() -> str:
    """The CPU's model name and the flags that choose kernels (these machines vary: say which)."""
    from flover.hardware import cpu_flags

    names = [
        line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines() if "model name" in line
    ]
    kept = sorted(cpu_flags() & {"avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_int8"})
    return f"{names[0] if names else platform.machine()}, {os.cpu_count()} cores, {' '.join(kept)}"


def ask(addr: str, ids: list[int], gen_len: int) -> dict:
    from flover.client import Client

    with Client(addr, timeout=600) as c:
        return c.generate(input_ids=ids, max_new_tokens=gen_len, ignore_eos=True)


def serve(model: Path, directory: Path, args) -> tuple:
    flags = ["--prefix-cache-dir", str(directory), "--speculate", "0"]
    return launch_flover(model, flags, slots=2, threads=args.threads, seq_len=args.seq_len)


def history(args) -> tuple[list[int], list[int], Path]:
    """Turns 1 .. turns - 1 on a fresh server: (the last turn's prompt, its first turns' TTFTs
    (ms), the directory they left)."""
    rng, directory = random.Random(args.seed), Path(tempfile.mkdtemp(prefix="flover-restart-"))
    server, addr = serve(Path(args.model), directory, args)
    sent, ttfts = [], []
    try:
        for turn in range(1, args.turns):
            sent += [rng.randrange(100, 40000) for _ in range(args.user_len)]
            out = ask(addr, sent, args.gen_len)
            ttfts.append(1000 * out["timings"]["ttft_s"])
            sent += out["token_ids"]
            log(f"turn {turn}: {len(sent)} tokens, TTFT {ttfts[-1]:.0f} ms, cached {out['usage']['cached_tokens']}")
    finally:
        server.stop()
    sent += [rng.randrange(100, 40000) for _ in range(args.user_len)]
    return sent, ttfts, directory


def last_turn(args, prompt: list[int], source: Path | None) -> dict:
    """The last turn on a new server whose directory is a copy of `source` (None: empty)."""
    directory = Path(tempfile.mkdtemp(prefix="flover-restart-"))
    if source is not None:
        shutil.copytree(source, directory, dirs_exist_ok=True)
    server, addr = serve(Path(args.model), directory, args)
    try:
        out = ask(addr, prompt, args.gen_len)
    finally:
        server.stop()
        shutil.rmtree(directory, ignore_errors=True)
    return {
        "ttft_ms": 1000 * out["timings"]["ttft_s"],
        "cached": out["usage"]["cached_tokens"],
        "ids": out["token_ids"],
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--turns", type=int, default=20)
    ap.add_argument("--user-len", type=int, default=180)
    ap.add_argument("--gen-len", type=int, default=24)
    ap.add_argument("--seq-len", type=int, default=8192)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="bench-prefix-restart.json")
    args = ap.parse_args()
    prompt, ttfts, directory = history(args)
    files = list(directory.rglob("*.block"))
    mib = sum(f.stat().st_size for f in files) / 2**20
    log(f"last turn: {len(prompt)} prompt tokens; {len(files)} block files, {mib:.1f} MiB")
    runs = {"disk": [], "cold": []}
    for r in range(args.rounds):
        for kind in ("disk", "cold") if r % 2 == 0 else ("cold", "disk"):
            runs[kind].append(last_turn(args, prompt, directory if kind == "disk" else None))
            log(f"round {r + 1} {kind}: TTFT {runs[kind][-1]['ttft_ms']:.0f} ms, cached {runs[kind][-1]['cached']}")
    same = all(a["ids"] == b["ids"] for a in runs["disk"] for b in runs["cold"])
    disk, cold = (statistics.median(x["ttft_ms"] for x in runs[k]) for k in ("disk", "cold"))
    result = {
        "model": args.model,
        "machine": machine(),
        "prompt_tokens": len(prompt),
        "turns": args.turns,
        "earlier_turns_ttft_ms": ttfts,
        "files": len(files),
        "file_mib": mib,
        "ttft_ms_disk": disk,
        "ttft_ms_cold": cold,
        "cached_tokens_disk": [x["cached"] for x in runs["disk"]],
        "rounds": {k: [x["ttft_ms"] for x in v] for k, v in runs.items()},
        "same_tokens": same,
    }
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"\nlast turn of {len(prompt)} tokens after a restart: TTFT {disk:.0f} ms with the disk cache, ", end="")
    print(f"{cold:.0f} ms cold ({cold / disk:.1f}x); same tokens: {same}")
    shutil.rmtree(directory, ignore_errors=True)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
