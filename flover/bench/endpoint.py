"""`flover bench --endpoint URL`: the seeded workloads against any OpenAI-compatible server
(flover's own `--http`, llama.cpp's `llama-server`, vLLM, ...), measured like the other modes.

Each request is sent at its arrival time as a streamed `POST /v1/completions` with the workload's
token ids as the prompt, `max_tokens` = its length, greedy, `ignore_eos` (flover, llama.cpp and
vLLM all honour it) and `stream_options.include_usage`. A token's time is the arrival of the
chunk that carried it; tokens a server sends together (its usage counts more tokens than chunks
came) count at the time of the last chunk. Plain `http.client` in one thread per request: the
load generator stays light and needs nothing beyond the standard library.
"""

from __future__ import annotations

import http.client
import json
import threading
import time
from urllib.parse import urlsplit

from flover.bench.modes import RequestTrace, RunTrace
from flover.bench.workload import BenchRequest


class Endpoint:
    def __init__(self, url: str, api_key: str | None = None):
        parts = urlsplit(url if "://" in url else f"http://{url}")
        if parts.scheme not in ("http", "https"):
            raise ValueError(f"--endpoint {url!r}: expected http://HOST:PORT[/v1]")
        self.https, self.netloc = parts.scheme == "https", parts.netloc
        self.prefix = parts.path.rstrip("/").removesuffix("/v1")
        self.headers = {"Content-Type": "application/json"}
        if api_key:
            self.headers["Authorization"] = f"Bearer {api_key}"

    def connection(self, timeout: float = 600) -> http.client.HTTPConnection:
        kind = http.client.HTTPSConnection if self.https else http.client.HTTPConnection
        return kind(self.netloc, timeout=timeout)

    def request(self, method: str, path: str, body: dict | None = None, timeout: float = 600):
        conn = self.connection(timeout)
        conn.request(method, self.prefix + path, None if body is None else json.dumps(body), self.headers)
        return conn, conn.getresponse()

    def model(self) -> str:
        """The first model the server lists."""
        conn, r = self.request("GET", "/v1/models", timeout=30)
        try:
            if r.status != 200:
                raise RuntimeError(f"GET /v1/models: HTTP {r.status}: {r.read()[:300]!r}")
            return json.loads(r.read())["data"][0]["id"]
        finally:
            conn.close()


def stream_one(endpoint: Endpoint, model: str, req: BenchRequest, t0: float, trace: RequestTrace) -> None:
    body = {
        "model": model,
        "prompt": req.prompt_ids,
        "max_tokens": req.new_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    conn, r = endpoint.request("POST", "/v1/completions", body)
    try:
        if r.status != 200:
            raise RuntimeError(f"request {req.id}: HTTP {r.status}: {r.read()[:300]!r}")
        times, counted = [], None
        for line in r:
            if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices") and chunk["choices"][0].get("text"):
                times.append(time.perf_counter() - t0)
            if chunk.get("usage"):
                counted = chunk["usage"]["completion_tokens"]
        if counted is not None and counted > len(times) and times:
            times += [times[-1]] * (counted - len(times))
        trace.token_times = times
    finally:
        conn.close()


def run_endpoint(reqs: list[BenchRequest], endpoint: Endpoint, model: str) -> RunTrace:
    traces = [RequestTrace(r.id, r.arrival_s, len(r.prompt_ids), r.new_tokens) for r in reqs]
    errors: list[BaseException] = []
    t0 = time.perf_counter()

    def one(req: BenchRequest, trace: RequestTrace) -> None:
        time.sleep(max(0.0, t0 + req.arrival_s - time.perf_counter()))
        try:
            stream_one(endpoint, model, req, t0, trace)
        except BaseException as e:  # reported after every thread ended
            errors.append(e)

    threads = [threading.Thread(target=one, args=pair, daemon=True) for pair in zip(reqs, traces)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise RuntimeError(f"{len(errors)} of {len(reqs)} requests failed; the first: {errors[0]}")
    empty = [t.id for t in traces if not t.token_times]
    if empty:
        raise RuntimeError(f"requests {', '.join(empty[:5])} streamed no text")
    return RunTrace("endpoint", traces, note=f"{endpoint.netloc}, model {model}")
