"""The step plan rank 0 broadcasts at the start of every iteration (msgpack, never pickle).

It carries only intake since the previous iteration: requests admitted to the queue (token ids
and sampling parameters), requests cancelled, and shutdown. Every rank feeds the same events to
its own deterministic scheduler, so all ranks agree on the batch by construction.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import msgpack

from flover.config import SamplingParams


@dataclass
class AddEvent:
    request_id: str
    token_ids: list[int]
    params: SamplingParams


@dataclass
class StepPlanMessage:
    added: list[AddEvent] = field(default_factory=list)
    cancelled: list[str] = field(default_factory=list)
    order: list[str] = field(default_factory=list)  # "a" / "c": the order events happened in
    shutdown: bool = False

    def add(self, event: AddEvent) -> None:
        self.added.append(event)
        self.order.append("a")

    def cancel(self, request_id: str) -> None:
        self.cancelled.append(request_id)
        self.order.append("c")

    def events(self):
        """(kind, payload) in the order they happened on rank 0."""
        added, cancelled = iter(self.added), iter(self.cancelled)
        for kind in self.order:
            yield (kind, next(added) if kind == "a" else next(cancelled))

    def encode(self) -> bytes:
        return msgpack.packb({
            "add": [[e.request_id, e.token_ids, asdict(e.params)] for e in self.added],
            "cancel": self.cancelled, "order": "".join(self.order), "shutdown": self.shutdown,
        })

    @classmethod
    def decode(cls, data: bytes) -> "StepPlanMessage":
        raw = msgpack.unpackb(data)
        added = [AddEvent(rid, ids, SamplingParams(**params)) for rid, ids, params in raw["add"]]
        return cls(added=added, cancelled=list(raw["cancel"]), order=list(raw["order"]), shutdown=raw["shutdown"])
