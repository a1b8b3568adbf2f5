"""Serving metrics the daemon keeps (pure Python; names modelled on vLLM's). The `stats` op
carries them (`"metrics"`); the HTTP front renders the same numbers in Prometheus' text format
(`/metrics`, flover/server/prometheus.py), so both doors report one truth.
"""

from __future__ import annotations

from bisect import bisect_left
from collections import Counter
from dataclasses import dataclass, field

LATENCY_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)

# name -> (buckets, help)
HISTOGRAMS = {
    "time_to_first_token_seconds": (LATENCY_BUCKETS, "Time from arrival to the first output token"),
    "time_per_output_token_seconds": (LATENCY_BUCKETS, "Mean time per output token after the first, per request"),
    "inter_token_latency_seconds": (LATENCY_BUCKETS, "Time between successive output tokens of a request"),
    "e2e_request_latency_seconds": (LATENCY_BUCKETS, "Time from arrival to the last output token"),
    "request_queue_time_seconds": (LATENCY_BUCKETS, "Time from arrival to the first iteration that computed it"),
    "iteration_time_seconds": (LATENCY_BUCKETS, "Wall time of one engine iteration"),
    "iteration_tokens": (TOKEN_BUCKETS, "Tokens computed in one engine iteration (prompt chunks + decode)"),
}


@dataclass
class Histogram:
    buckets: tuple
    counts: list[int] = field(default_factory=list)  # per bucket (value <= bound), then the overflow
    sum: float = 0.0

    def __post_init__(self):
        self.counts = self.counts or [0] * (len(self.buckets) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.buckets, value)] += 1
        self.sum += value


class ServingMetrics:
    def __init__(self):
        self.histograms = {name: Histogram(buckets) for name, (buckets, _) in HISTOGRAMS.items()}
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.finished: Counter = Counter()  # finish reason -> requests

    def iteration(self, seconds: float, tokens: int) -> None:
        self.histograms["iteration_time_seconds"].observe(seconds)
        self.histograms["iteration_tokens"].observe(tokens)

    def token_gap(self, seconds: float) -> None:
        self.histograms["inter_token_latency_seconds"].observe(seconds)

    def request_finished(self, reason: str, prompt_tokens: int, output_tokens: int, timings: dict) -> None:
        self.finished[reason] += 1
        self.prompt_tokens += prompt_tokens
        self.generation_tokens += output_tokens
        for name, key in (
            ("time_to_first_token_seconds", "ttft"),
            ("time_per_output_token_seconds", "tpot"),
            ("e2e_request_latency_seconds", "e2e"),
            ("request_queue_time_seconds", "queue_time"),
        ):
            if timings.get(key) is not None:
                self.histograms[name].observe(timings[key])

    def snapshot(self) -> dict:
        """Plain data for the wire (msgpack)."""
        return {
            "histograms": {
                name: {"buckets": list(h.buckets), "counts": list(h.counts), "sum": h.sum}
                for name, h in self.histograms.items()
            },
            "prompt_tokens": self.prompt_tokens,
            "generation_tokens": self.generation_tokens,
            "finished": dict(self.finished),
        }
