"""What one iteration does, as the scheduler (engine/scheduler.py) plans it and the runner
(runner/runner.py) carries it out: the data of that contract, no behaviour."""

from __future__ import annotations

from dataclasses import dataclass, field

from flover.request import Request
from flover.runner.kv_window import WindowShift


@dataclass(frozen=True)
class Move:
    src: int  # a live slot at or beyond the new live count
    dst: int  # a hole below the new live count


@dataclass(frozen=True)
class BlockCopy:
    slot: int
    position: int  # the block's first sequence position in the slot
    block: int  # its row in the pool
    window_row: int | None = None  # where the windowed layers keep it in the slot (None: they do not)


@dataclass(frozen=True)
class StateCopy:
    """A recurrent state snapshot (prefix pool row `row`) into a slot's recurrent layers."""

    slot: int
    row: int


@dataclass(frozen=True)
class PrefillChunk:
    request: Request
    start: int  # first prompt position of this chunk
    length: int
    snapshot: int | None = None  # recurrent layers: their states after this chunk into this snapshot row

    @property
    def completes_prompt(self) -> bool:
        return self.start + self.length == self.request.prompt_len


@dataclass
class StepPlan:
    retired: list[Request] = field(default_factory=list)
    moves: list[Move] = field(default_factory=list)
    decode: list[Request] = field(default_factory=list)  # in slot order
    drafts: list[list[int]] = field(default_factory=list)  # per decode request when speculating: its draft
    prefill: list[PrefillChunk] = field(default_factory=list)
    admitted: list[Request] = field(default_factory=list)  # got a slot in this plan
    saves: list[BlockCopy] = field(default_factory=list)  # slot -> prefix pool, before the moves
    loads: list[BlockCopy] = field(default_factory=list)  # prefix pool -> admitted slots, after them
    shifts: list[WindowShift] = field(default_factory=list)  # windowed layers' rows slide, after the loads
    state_loads: list[StateCopy] = field(default_factory=list)  # snapshots -> admitted slots, with the loads
    # blocks and snapshots a lookup read from disk (engine/prefix_disk.py): their bytes into their
    # pool and snapshot rows, before the loads copy them on
    pool_fills: list[tuple[int, bytes]] = field(default_factory=list)
    state_fills: list[tuple[int, bytes]] = field(default_factory=list)
    decode_snapshots: dict[int, int] = field(default_factory=dict)  # decode index -> row its state goes to
    num_live: int = 0  # live slots are [0, num_live) after this plan
    moved_kv_len: int = 0  # the longest cached sequence among the moved slots (what the moves copy)

    @property
    def num_tokens(self) -> int:
        return len(self.decode) + sum(map(len, self.drafts)) + sum(c.length for c in self.prefill)

    @property
    def empty(self) -> bool:
        return not self.decode and not self.prefill
