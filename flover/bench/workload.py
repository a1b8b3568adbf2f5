"""Seeded benchmark workloads: who arrives when, with which prompt, asking for how many tokens."""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class BenchRequest:
    id: str
    arrival_s: float  # seconds after the start of the run
    prompt_ids: list[int]
    new_tokens: int  # generated exactly (EOS ignored)


@dataclass(frozen=True)
class Workload:
    requests: int = 32
    prompt_len: tuple[int, int] = (64, 64)  # U(a, b); a == b for a fixed length
    gen_len: tuple[int, int] = (128, 128)
    arrival: str = "all"  # all | interval | poisson
    interval_ms: float = 0.0  # interval: time between arrivals; poisson: mean of the exponential gaps
    seed: int = 0

    def build(self, vocab: int) -> list[BenchRequest]:
        rng = random.Random(self.seed)
        t, out = 0.0, []
        for i in range(self.requests):
            if i:
                if self.arrival == "interval":
                    t += self.interval_ms / 1000
                elif self.arrival == "poisson":
                    t += rng.expovariate(1000 / self.interval_ms)
            length = rng.randint(*self.prompt_len)
            prompt = [rng.randrange(1, vocab) for _ in range(length)]
            out.append(BenchRequest(f"r{i}", t, prompt, rng.randint(*self.gen_len)))
        return out

    def describe(self) -> str:
        rng_text = lambda r: str(r[0]) if r[0] == r[1] else f"U({r[0]}, {r[1]})"  # noqa: E731
        when = {
            "all": "all at once",
            "interval": f"every {self.interval_ms:g} ms",
            "poisson": f"Poisson, mean interval {self.interval_ms:g} ms",
        }[self.arrival]
        return (
            f"{self.requests} requests, prompt {rng_text(self.prompt_len)} tokens, "
            f"{rng_text(self.gen_len)} new tokens, arrivals {when}, seed {self.seed}"
        )

    def as_dict(self) -> dict:
        return asdict(self)


def parse_range(text: str) -> tuple[int, int]:
    """'64' -> (64, 64); '32,128' -> (32, 128)."""
    parts = [int(p) for p in str(text).split(",")]
    if len(parts) == 1:
        parts *= 2
    if len(parts) != 2 or parts[0] < 1 or parts[1] < parts[0]:
        raise ValueError(f"{text!r}: give N or A,B with 1 <= A <= B")
    return parts[0], parts[1]
