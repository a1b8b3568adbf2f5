"""What costly structures and bodies do to the rest of a running `flover serve --http` (issue 45:
hardening, third pass). For a checkout (--src, default this one) each probe starts a fresh daemon
with the HTTP front on the model, runs an innocent greedy stream beside a hostile client, and
prints one line of JSON:

  bomb     a 1.4 KB string schema of 27 allOf patterns a{1}..a{27}: its answer (status, seconds),
           the daemon's peak RSS, an innocent chat sent just after it, the stream's worst gap
  masks    3 clients with a 6 KB Lark grammar of 200 overlapping lexemes /[a-z]*c[a-z]{n}/: the
           stream's gaps
  cache    4 distinct such grammars one after another: the daemon's RSS after each
  enums    8 distinct 830 KB enum schemas (--ranks 2: on a data-parallel job of 2 groups, two
           innocent streams, one per group): the streams' worst gap
  numbers  6 cities through a {name, country, population_millions: number} schema, greedy: how
           many answers parse, their finish reasons
  bodies   3 clients posting 1 MB bodies (200,000 [0] items in an unknown field) for 5 s, each as
           soon as its previous one is answered: how many were answered, the /health answers
           and the stream's gaps

    python scripts/bench/probe_grammars.py --model SmolLM2-135M-Instruct.Q4_1.gguf [--src OTHER] [--probes bomb,masks]

Wall-clock figures on a noisy machine: compare checkouts in one run, alternating.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time

import httpx

BOMB = {"type": "string", "allOf": [{"pattern": "a{%d}" % i} for i in range(1, 28)]}


def lark_grammar(variant: int) -> str:
    """~6 KB: 200 overlapping lexemes whose lexer states multiply (SmolLM2: 13-165 ms a mask)."""
    lexemes = "\n".join(f"T{i}: /[a-z]*{chr(97 + (i + variant) % 26)}[a-z]{{{4 + i % 8}}}/" for i in range(200))
    return "start: item+\nitem: " + " | ".join(f"T{i}" for i in range(200)) + "\n" + lexemes


def enum_schema(variant: int) -> dict:
    return {"enum": [f"v{variant}-{i:06d}-" + "x" * 14 for i in range(30_000)]}  # ~830 KB


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Daemon:
    def __init__(self, src: str, model: str, ranks: int):
        self.port = free_port()
        self.mark = f"FLOVER_PROBE={os.getpid()}-{self.port}".encode()  # every process of this daemon carries it
        env = {
            **os.environ,
            "PYTHONPATH": src,
            "PYTHONUNBUFFERED": "1",
            "OMPI_ALLOW_RUN_AS_ROOT": "1",
            "FLOVER_PROBE": self.mark.decode().split("=", 1)[1],
            "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
            "OMPI_MCA_btl": "self,sm",
        }
        args = [
            "-m",
            "flover.apps.cli",
            "serve",
            "--model",
            model,
            "--bind",
            f"tcp://127.0.0.1:{free_port()}",
            "--http",
            f"127.0.0.1:{self.port}",
            "--max-seq-len",
            "1024",
            "--max-slots",
            "8",
            "--speculate",
            "0",
        ]
        if ranks > 1:
            mpirun = os.path.join(os.path.dirname(sys.executable), "mpirun")
            cmd = [
                mpirun,
                "-np",
                str(ranks),
                "--oversubscribe",
                "--bind-to",
                "none",
                sys.executable,
                *args,
                "--tp",
                "1",
                "--threads",
                "1",
            ]
        else:
            cmd = [sys.executable, *args]
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env, cwd=src, start_new_session=True
        )
        assert "ready" in self.proc.stdout.readline()
        self.pid = self._rank0() if ranks > 1 else self.proc.pid
        self.url = f"http://127.0.0.1:{self.port}"

    def _rank0(self) -> int:
        for entry in os.listdir("/proc"):
            try:
                with open(f"/proc/{entry}/environ", "rb") as f:
                    if b"OMPI_COMM_WORLD_RANK=0" in f.read() and _parent_chain(int(entry), self.proc.pid):
                        return int(entry)
            except (OSError, ValueError):
                continue
        raise RuntimeError("rank 0 not found")

    def rss_mib(self) -> float:
        try:
            with open(f"/proc/{self.pid}/status") as f:
                return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024
        except OSError:
            return float("nan")

    def stop(self) -> None:
        """Every process it started: mpirun gives each rank a process group of its own, and the
        HTTP front has a session of its own."""
        for entry in os.listdir("/proc"):
            try:
                with open(f"/proc/{entry}/environ", "rb") as f:
                    if self.mark in f.read().split(b"\0"):
                        os.kill(int(entry), 9)
            except (OSError, ValueError):
                continue
        self.proc.wait()


def _parent_chain(pid: int, ancestor: int) -> bool:
    for _ in range(5):
        try:
            with open(f"/proc/{pid}/stat") as f:
                pid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError):
            return False
        if pid == ancestor:
            return True
    return False


class Stream(threading.Thread):
    """An innocent greedy stream: the times of its chunks."""

    def __init__(self, url: str, tokens: int = 300, prompt: str = "Once upon a time"):
        super().__init__(daemon=True)
        self.url, self.tokens, self.prompt, self.times = url, tokens, prompt, []
        self.first = threading.Event()

    def run(self) -> None:
        body = {"prompt": self.prompt, "max_tokens": self.tokens, "temperature": 0, "ignore_eos": True, "stream": True}
        with httpx.Client(timeout=600) as http, http.stream("POST", f"{self.url}/v1/completions", json=body) as r:
            for line in r.iter_lines():
                if line.startswith("data:"):
                    self.times.append(time.perf_counter())
                    self.first.set()
        self.first.set()

    def gaps_ms(self) -> list[float]:
        return [1000 * (b - a) for a, b in zip(self.times, self.times[1:])]


def summary(gaps: list[float]) -> dict:
    return (
        {
            "gap_p50_ms": round(statistics.median(gaps), 1),
            "gap_max_ms": round(max(gaps), 1),
            "gaps_over_100ms": sum(g > 100 for g in gaps),
        }
        if gaps
        else {}
    )


def chat(url: str, body: dict, timeout: float) -> tuple[int | str, float, dict | None]:
    started = time.perf_counter()
    try:
        r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=timeout)
        return r.status_code, time.perf_counter() - started, r.json()
    except httpx.HTTPError as e:
        return type(e).__name__, time.perf_counter() - started, None


def ask(text: str, **extra) -> dict:
    return {"messages": [{"role": "user", "content": text}], "temperature": 0, **extra}


def probe_bomb(d: Daemon) -> dict:
    stream, before = Stream(d.url, 600), d.rss_mib()
    stream.start()
    stream.first.wait(60)
    out: dict = {}
    peak = [before]

    def sample() -> None:
        while "bomb_status" not in out:
            peak[0] = max(peak[0], d.rss_mib())
            time.sleep(0.1)

    def bomb() -> None:
        fmt = {"type": "json_schema", "json_schema": {"name": "s", "schema": BOMB}}
        status, seconds, body = chat(d.url, ask("Say a's", response_format=fmt, max_tokens=20), 90)
        out.update(
            bomb_status=status,
            bomb_seconds=round(seconds, 1),
            bomb_error=(body or {}).get("error", {}).get("message", "")[:120],
        )

    threading.Thread(target=sample, daemon=True).start()
    hostile = threading.Thread(target=bomb, daemon=True)
    hostile.start()
    time.sleep(0.5)
    status, seconds, _ = chat(d.url, ask("What is the capital of France?", max_tokens=16), 60)
    out.update(innocent_chat_status=status, innocent_chat_seconds=round(seconds, 2))
    hostile.join(95)
    stream.join(120)
    out.setdefault("bomb_status", "no answer in 90 s")
    return {**out, "rss_before_mib": round(before), "rss_peak_mib": round(peak[0]), **summary(stream.gaps_ms())}


def probe_masks(d: Daemon) -> dict:
    stream = Stream(d.url, 300)
    stream.start()
    stream.first.wait(60)
    answers = []

    def hostile(i: int) -> None:
        status, seconds, body = chat(d.url, ask("Write words", guided_grammar=lark_grammar(0), max_tokens=20), 300)
        answers.append((status, round(seconds, 1), (body or {}).get("error", {}).get("message", "")[:100]))

    threads = [threading.Thread(target=hostile, args=(i,), daemon=True) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    stream.join(300)
    return {"hostile": answers, "rss_after_mib": round(d.rss_mib()), **summary(stream.gaps_ms())}


def probe_cache(d: Daemon) -> dict:
    rss = [round(d.rss_mib())]
    statuses = []
    for variant in range(4):
        status, _, _ = chat(d.url, ask("Write words", guided_grammar=lark_grammar(variant), max_tokens=5), 300)
        statuses.append(status)
        rss.append(round(d.rss_mib()))
    return {"statuses": statuses, "rss_mib": rss}


def probe_enums(d: Daemon) -> dict:
    streams = [Stream(d.url, 400, prompt=p) for p in ("Once upon a time", "The history of Rome")]
    for s in streams:
        s.start()
        s.first.wait(60)
    statuses = []

    def hostile(variant: int) -> None:
        fmt = {"type": "json_schema", "json_schema": {"name": "e", "schema": enum_schema(variant)}}
        statuses.append(chat(d.url, ask("Pick one", response_format=fmt, max_tokens=30), 300)[0])

    threads = [threading.Thread(target=hostile, args=(v,), daemon=True) for v in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    for s in streams:
        s.join(300)
    return {"statuses": statuses, **summary([g for s in streams for g in s.gaps_ms()])}


CITIES = ["Tokyo", "Paris", "Lagos", "Lima", "Mumbai", "Toronto"]
CITY = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "country": {"type": "string"},
        "population_millions": {"type": "number"},
    },
    "required": ["name", "country", "population_millions"],
    "additionalProperties": False,
}


def probe_numbers(d: Daemon) -> dict:
    parsed, finishes = 0, []
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY}}
    for city in CITIES:
        _, _, body = chat(d.url, ask(f"Give facts about {city} as JSON.", response_format=fmt, max_tokens=200), 120)
        choice = (body or {}).get("choices", [{}])[0]
        finishes.append(choice.get("finish_reason"))
        try:
            json.loads(choice["message"]["content"])
            parsed += 1
        except (KeyError, TypeError, ValueError):
            pass
    return {"parsed": f"{parsed}/{len(CITIES)}", "finish_reasons": finishes}


def probe_bodies(d: Daemon) -> dict:
    stream = Stream(d.url, 300)
    stream.start()
    stream.first.wait(60)
    stop = time.monotonic() + 5
    big = json.dumps({"prompt": "hi", "max_tokens": 1, "junk": [[0]] * 200_000}).encode()
    health, posted = [], []

    def poster() -> None:
        with httpx.Client(timeout=60) as http:
            while time.monotonic() < stop:
                http.post(f"{d.url}/v1/completions", content=big, headers={"content-type": "application/json"})
                posted.append(1)

    posters = [threading.Thread(target=poster, daemon=True) for _ in range(3)]
    for t in posters:
        t.start()
    with httpx.Client(timeout=60) as http:
        while time.monotonic() < stop:
            started = time.perf_counter()
            http.get(f"{d.url}/health")
            health.append(1000 * (time.perf_counter() - started))
            time.sleep(0.05)
    for t in posters:
        t.join(60)
    stream.join(120)
    return {
        "bodies_answered": len(posted),
        "health_max_ms": round(max(health), 1),
        "health_p50_ms": round(statistics.median(health), 1),
        **summary(stream.gaps_ms()),
    }


PROBES = {
    "bomb": probe_bomb,
    "masks": probe_masks,
    "cache": probe_cache,
    "enums": probe_enums,
    "numbers": probe_numbers,
    "bodies": probe_bodies,
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--src", default=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    ap.add_argument("--probes", default=",".join(PROBES))
    ap.add_argument("--ranks", type=int, default=1, help="2: a data-parallel job of two groups (mpirun)")
    args = ap.parse_args()
    for name in args.probes.split(","):
        d = Daemon(args.src, os.path.abspath(args.model), args.ranks)
        try:
            print(json.dumps({"probe": name, "src": args.src, "ranks": args.ranks, **PROBES[name](d)}), flush=True)
        finally:
            d.stop()


if __name__ == "__main__":
    main()
