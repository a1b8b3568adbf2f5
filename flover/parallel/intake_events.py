"""What rank 0 broadcasts at the start of every iteration (msgpack, never pickle): not a plan, but
the intake since the previous iteration, in the order it happened: requests queued
(token ids and sampling parameters), requests cancelled, and shutdown; and the one scheduling
input that is measured rather than derived, the leader's fit of iteration cost (how long a
speculative draft may be; flover/engine/speculation.py). Every rank feeds the same events to its own
deterministic scheduler, so all ranks agree on the batch by construction.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import msgpack

from flover.config import SamplingParams
from flover.request import EmbedParams


@dataclass
class AddEvent:
    request_id: str
    token_ids: list[int]
    params: SamplingParams
    cache_salt: str | None = None  # the request's prefix-cache partition
    embed: EmbedParams | None = None  # an embedding request's


@dataclass
class IntakeMessage:
    events: list[AddEvent | str] = field(default_factory=list)  # an AddEvent, or the id of a cancelled request
    shutdown: bool = False
    knee: float | None = None  # the leader's IterationCost.knee, for this iteration's drafts

    def add(self, event: AddEvent) -> None:
        self.events.append(event)

    def cancel(self, request_id: str) -> None:
        self.events.append(request_id)

    def encode(self) -> bytes:
        wire = [
            ["a", e.request_id, e.token_ids, asdict(e.params), e.cache_salt, e.embed and asdict(e.embed)]
            if isinstance(e, AddEvent)
            else ["c", e]
            for e in self.events
        ]
        return msgpack.packb({"events": wire, "shutdown": self.shutdown, "knee": self.knee})

    @classmethod
    def decode(cls, data: bytes) -> "IntakeMessage":
        raw = msgpack.unpackb(data)
        events = [
            AddEvent(e[1], e[2], SamplingParams(**e[3]), e[4], EmbedParams(**e[5]) if e[5] else None)
            if e[0] == "a"
            else e[1]
            for e in raw["events"]
        ]
        return cls(events=events, shutdown=raw["shutdown"], knee=raw["knee"])
