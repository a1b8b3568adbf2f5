"""What the front ends (the daemon, prompt files, benchmarks) use of an engine, written down: one
`Engine`, or `EngineGroups` (data-parallel groups behind world rank 0) both implement it."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Sequence

from flover.config import EngineConfig
from flover.engine.intake import Intake
from flover.parallel.comm import Communicator
from flover.request import Request, RequestInput, RequestOutput
from flover.structured.grammars import Grammars


@dataclass
class EngineStats:
    """What the engine can tell about itself (like vLLM's SchedulerStats): for the daemon's stats,
    /metrics, batch progress and benchmarks."""

    running: int  # requests in a slot, not finished
    waiting: int  # queued for a slot
    slots_total: int
    kv_bytes: int
    kv_tokens: int  # positions cached for the running requests
    kv_use: float  # kv_tokens / every slot's positions
    iterations: int  # that ran a forward
    last_step_tokens: int  # rows of the last iteration's token matrix
    shuffle_moves: int
    shuffle_bytes: int
    shuffle_seconds: float
    draft_tokens: int  # speculation: draft rows computed ...
    accepted_tokens: int  # ... and accepted
    prefix_cache: dict | None  # its counters and blocks, or None when off
    native_kernels: str | None  # the native step's kernel family (e.g. "AVX2+FMA"), None: PyTorch runs
    groups: list[dict] | None = None  # data-parallel groups (engine/groups.py): each one's figures
    # a mixture of experts: per layer of experts {"layer": n, "rows": rows routed to each expert so far}
    # (routing skew: an expert far above the others' mean is the one every iteration waits on)
    expert_load: list[dict] | None = None
    # pipeline stages: {"stages", "in_flight": plans now, "busy": each stage's share of time at work
    # since the start (1 - busy: its bubble), "busy_s": those seconds, "mib_sent": each stage's activations sent}
    pipeline: dict | None = None
    kv_bytes_per_token: int = 0  # one position's K and V over every layer that keeps them (this rank's)


class ServingEngine(ABC):
    config: EngineConfig  # resolved: no "auto" left
    comm: Communicator | None  # every rank behind it (None: one rank alone)
    intake: Intake
    groups: int  # data-parallel groups behind it (1: one engine)
    iterations: int  # iterations run (with groups: every group's)

    # -- intake (Intake's, shared) ----------------------------------------------------------------
    @property
    def max_seq_len(self) -> int:
        return self.intake.max_seq_len

    def tokenize(
        self,
        prompt: str | Sequence[int] | None,
        messages: list | None = None,
        tools: list | None = None,
        template_kwargs: dict | None = None,
    ) -> tuple[list[int], str | None]:
        return self.intake.tokenize(prompt, messages, tools, template_kwargs=template_kwargs)

    def input_ids(self, prompt: str | Sequence[int], keep: int | None = None, document: str | None = None):
        """An embedding input's or a pair's (Intake.input_ids)."""
        return self.intake.input_ids(prompt, keep, document)

    @property
    @abstractmethod
    def embeddings_refused(self) -> str | None:
        """Why this engine makes no embeddings (None: it makes them)."""

    @property
    def capabilities(self) -> list[str]:
        """What the served model does, as /v1/models lists it."""
        scores_only = self.intake.model_config.embeds_only or self.intake.scores_only
        text = [] if scores_only else ["completion", "chat"]
        if self.embeddings_refused is not None:
            return text
        return text + (["rerank", "score"] if self.intake.pairs else ["embeddings", "rerank", "score"])

    @property
    def grammars(self) -> Grammars:
        return self.intake.grammars

    def prepare_grammars(self, checked_elsewhere: bool = False) -> None:
        self.intake.prepare_grammars(checked_elsewhere)

    @abstractmethod
    def make_request(self, given: RequestInput) -> Request:
        """Validated and tokenized, not queued; ValueError naming what is wrong."""

    # -- requests in flight -----------------------------------------------------------------------
    @abstractmethod
    def enqueue(self, request: Request) -> str:
        """Queue a made request; it joins the running batch at the next iteration."""

    @abstractmethod
    def abort(self, request_id: str) -> bool:
        """Cancel; its final output comes with a later step(). False if unknown or done."""

    @abstractmethod
    def step(self) -> list[RequestOutput]:
        """One iteration (every group's outputs since the last call)."""

    @abstractmethod
    def has_unfinished(self) -> bool: ...

    @property
    @abstractmethod
    def num_in_flight(self) -> int: ...

    @abstractmethod
    def can_accept(self, max_waiting: int) -> bool:
        """Whether fewer than `max_waiting` requests wait for a slot."""

    # -- figures and the end ----------------------------------------------------------------------
    @abstractmethod
    def timed_iterations(self) -> list[tuple[float, int]]:
        """(seconds, rows) of each iteration since the last call."""

    @abstractmethod
    def stats(self) -> EngineStats: ...

    @abstractmethod
    def shutdown(self) -> None: ...
