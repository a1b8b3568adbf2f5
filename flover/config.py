"""Contracts between the parts: how a request wants to be sampled, how the engine is sized."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, fields, replace


@dataclass(frozen=True)
class SamplingParams:
    """Per-request generation settings (names follow vLLM's SamplingParams).

    temperature == 0 means greedy; the default is greedy so that a plain call gives the same
    tokens as transformers' `generate` on the same weights.
    """

    max_new_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    min_p: float = 0.0  # 0 = off
    repetition_penalty: float = 1.0  # 1 = off (transformers' definition)
    seed: int | None = None  # same seed => same tokens, whatever else is in the batch
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()  # stop strings; never part of the returned text
    ignore_eos: bool = False
    eos_token_ids: tuple[int, ...] | None = None  # None = the checkpoint's EOS ids
    logprobs: bool = False  # return the log-probability of every sampled token

    def __post_init__(self) -> None:
        # Lists are accepted for convenience and frozen into tuples.
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        object.__setattr__(self, "stop", (self.stop,) if isinstance(self.stop, str) else tuple(self.stop))
        if self.eos_token_ids is not None:
            object.__setattr__(self, "eos_token_ids", tuple(self.eos_token_ids))
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the first bad field."""

        def bad(name: str, why: str) -> None:
            raise ValueError(f"SamplingParams.{name}={getattr(self, name)!r}: {why}")

        if not _is_int(self.max_new_tokens) or self.max_new_tokens < 1:
            bad("max_new_tokens", "must be an integer >= 1")
        if not _is_finite(self.temperature) or self.temperature < 0:
            bad("temperature", "must be a finite number >= 0")
        if not _is_int(self.top_k) or self.top_k < 0:
            bad("top_k", "must be an integer >= 0 (0 disables it)")
        if not _is_finite(self.top_p) or not 0 < self.top_p <= 1:
            bad("top_p", "must be in (0, 1]")
        if not _is_finite(self.min_p) or not 0 <= self.min_p <= 1:
            bad("min_p", "must be in [0, 1]")
        if not _is_finite(self.repetition_penalty) or self.repetition_penalty <= 0:
            bad("repetition_penalty", "must be a finite number > 0")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed < 2**63):
            bad("seed", "must be an integer in [0, 2**63) or None")
        if not all(_is_int(t) and t >= 0 for t in self.stop_token_ids):
            bad("stop_token_ids", "must be non-negative integers")
        if self.eos_token_ids is not None and not all(_is_int(t) and t >= 0 for t in self.eos_token_ids):
            bad("eos_token_ids", "must be non-negative integers")
        if not all(isinstance(s, str) and s for s in self.stop):
            bad("stop", "must be non-empty strings")

    def with_updates(self, **changes) -> "SamplingParams":
        return replace(self, **changes)

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_finite(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


SAMPLING_KEYS = frozenset(SamplingParams.field_names())  # what a request may set per request

DTYPES = ("float32", "bfloat16", "float16", "float64")


def default_num_threads() -> int:
    """Cores this process may run on (respects taskset/cgroups affinity)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def threads_per_rank(ranks: int) -> int:
    """Default torch threads for one of `ranks` processes on this machine: the cores it is bound to
    when mpirun bound it, else an equal share of the cores available."""
    cores = default_num_threads()
    bound = cores < (os.cpu_count() or cores)
    return cores if bound or ranks == 1 else max(1, cores // ranks)


@dataclass
class EngineConfig:
    """How one engine instance is sized. Everything is fixed at start-up."""

    model: str
    dtype: str = "float32"
    device: str = "cpu"
    max_slots: int = 32  # requests in flight at once
    max_seq_len: int | None = None  # prompt + generated tokens; None = min(model limit, 2048)
    max_batch_tokens: int = 512  # token budget of one iteration (prompts are chunked to fit)
    num_threads: int | None = None  # torch intra-op threads; None = cores available
    seed: int = 0  # seeds requests that bring no seed of their own

    def validate(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype={self.dtype!r}: choose one of {', '.join(DTYPES)}")
        if self.max_slots < 1:
            raise ValueError(f"max_slots={self.max_slots}: must be >= 1")
        if self.max_seq_len is not None and self.max_seq_len < 2:
            raise ValueError(f"max_seq_len={self.max_seq_len}: must be >= 2")
        if self.max_batch_tokens < self.max_slots:
            # Every running request must be able to decode one token in every iteration.
            raise ValueError(
                f"max_batch_tokens={self.max_batch_tokens} must be >= max_slots={self.max_slots}"
            )
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"num_threads={self.num_threads}: must be >= 1")
