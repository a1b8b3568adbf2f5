"""Pipeline stages (--pp): each rank runs its stage's layers of every plan, in the leader's order.

The leader (group rank 0, on the first stage) carries out a plan in two halves with other plans
in between (Orca's iterations in flight, engine/engine.py): `start` makes the plan's copies, sends
every other rank of the group its `StageWork` (the copies and the token matrix: plain data, no
requests) and runs the first stage's layers, whose residual rows go on to the next stage;
`finish` takes the last stage's rows of the sampled requests back, runs the head and samples,
exactly as a single engine's runner. The other ranks `follow`: each work message's copies, then
its layers over the rows that came from the stage before.

Every stage applies the plans' copies (prefix saves, the shuffle's moves, loads, window slides)
and runs their rows in the same order, so each stage's slot buffer holds its layers' KV of the
same slots as the leader's scheduler believes, whatever the timing.

The rows travel with one more row, a ledger: stage s writes its seconds of work so far at column
s and the MiB it sent at column stages + s, so the leader learns every stage's busy share (the
pipeline's bubble is the rest) without a message of its own.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import NamedTuple

import torch

from flover.models.attention import ForwardBatch, PrefillSpan
from flover.parallel.pipeline import StageLink, StageTimeout, wire_dtype
from flover.request import StepResult
from flover.runner.kv_window import WindowShift
from flover.runner.plan import Move
from flover.runner.runner import IterationRows, ModelRunner, plain_greedy

log = logging.getLogger(__name__)


class BlockCopy(NamedTuple):
    """A prefix-cache block copy as it crossed the wire (engine/prefix_cache.py's BlockCopy fields)."""

    slot: int
    position: int
    block: int
    window_row: int | None


@dataclass
class InFlight:
    """A plan between `start` and `finish`."""

    plan: object  # the scheduler's StepPlan
    rows: IterationRows
    out_rows: int  # residual rows that come back (the sampled and scoring rows)
    token_rows: int
    draft_rows: int
    started: float


def _copies(plan) -> dict:
    """A plan's copies as plain data, in the order they run."""
    return {
        "saves": [[c.slot, c.position, c.block, c.window_row] for c in plan.saves],
        "moves": [[m.src, m.dst] for m in plan.moves],
        "moved": plan.moved_kv_len,
        "loads": [[c.slot, c.position, c.block, c.window_row] for c in plan.loads],
        "bases": [[r.slot, r.window_base] for r in plan.admitted],
        "shifts": [[s.slot, s.start, s.count, s.base] for s in plan.shifts],
    }


def _ints(t: torch.Tensor | None) -> list[int] | None:
    return None if t is None else t.tolist()


def encode_batch(batch: ForwardBatch) -> dict:
    fields = {
        "ids": batch.input_ids.tolist(),
        "positions": batch.positions.tolist(),
        "slots": batch.write_slots.tolist(),
        "num_decode": batch.num_decode,
        "span": batch.decode_span,
        "decode_rows": _ints(batch.decode_rows),
        "span_lens": _ints(batch.span_lens),
        "max_len": batch.max_decode_len,
        "prefills": [[p.token_start, p.length, p.slot, p.start_pos] for p in batch.prefills],
        "sample_rows": batch.sample_rows.tolist(),
        "draft_rows": batch.draft_rows,
    }
    if batch.window is not None:  # the sliding-window layers' view: relative positions, lengths, chunk starts
        w = batch.window
        fields["window"] = {
            "positions": w.positions.tolist(),
            "span_lens": _ints(w.span_lens),
            "max_len": w.max_decode_len,
            "starts": [p.start_pos for p in w.prefills],
        }
    return fields


def decode_batch(fields: dict, device: torch.device) -> ForwardBatch:
    def tensor(values):
        return None if values is None else torch.tensor(values, dtype=torch.int64, device=device)

    batch = ForwardBatch(
        input_ids=tensor(fields["ids"]),
        positions=tensor(fields["positions"]),
        write_slots=tensor(fields["slots"]),
        num_decode=fields["num_decode"],
        decode_span=fields["span"],
        decode_rows=tensor(fields["decode_rows"]),
        span_lens=tensor(fields["span_lens"]),
        max_decode_len=fields["max_len"],
        prefills=[PrefillSpan(*p) for p in fields["prefills"]],
        sample_rows=tensor(fields["sample_rows"]),
        draft_rows=fields["draft_rows"],
    )
    w = fields.get("window")
    if w is not None:  # as ModelRunner._window_rows makes it
        batch.window = dataclasses.replace(
            batch,
            positions=tensor(w["positions"]),
            span_lens=tensor(w["span_lens"]),
            max_decode_len=w["max_len"],
            prefills=[dataclasses.replace(p, start_pos=s) for p, s in zip(batch.prefills, w["starts"])],
            _masks={},
        )
    return batch


class PipelineRunner(ModelRunner):
    """A stage's runner: its layers (the first stage's also the embedding and head) and its slot
    buffer; `comm` is its stage's tensor-parallel communicator. The leader's sampler, as a
    single engine's, gathers the head's vocabulary blocks over its stage (no broadcast of ids:
    only the leader's scheduler takes them)."""

    def __init__(self, *args, link: StageLink, timeout: float | None = None, **kwargs):
        """`timeout`: seconds the leader waits for a plan's rows from the last stage (StageTimeout)."""
        super().__init__(*args, **kwargs)
        self.link, self.timeout = link, timeout
        self.broken = False  # a stage timed out: nothing more is sent or waited for
        self.place = link.place
        self.broadcasts_ids = False
        self.wire = wire_dtype(self.buffer.dtype)
        self.hidden_size = self.model.cfg.hidden_size
        self.busy_seconds = 0.0  # in this stage's layers and head (the rest: waiting, the bubble)
        self.started_at = time.perf_counter()
        stages = self.place.stages
        self.stage_busy = [0.0] * stages  # the leader: each stage's busy seconds, as the last ledger said
        self.stage_mib_sent = [0.0] * stages
        self.stage_expert_load: dict[int, list[dict] | None] = {}  # the leader: group rank -> its last report
        self._asked: set[int] = set()  # ... and the ranks asked again, not answered yet
        assert self.hidden_size >= 2 * stages, "the ledger row holds two figures per stage"

    # -- both ---------------------------------------------------------------------------------
    def _apply_copies(self, c: dict) -> None:
        """A plan's copies (as _copies wrote them), in ModelRunner.execute's order: prefix saves,
        the shuffle's moves, prefix loads and the admitted slots' window bases, window slides."""
        if c["saves"]:
            self.buffer.save_blocks([BlockCopy(*s) for s in c["saves"]])
        if c["moves"]:
            self.buffer.apply_moves([Move(*m) for m in c["moves"]], positions=max(1, c["moved"]))
        self.buffer.load_blocks([BlockCopy(*x) for x in c["loads"]])
        if self.buffer.window_base is not None:
            for slot, base in c["bases"]:
                self.buffer.window_base[slot] = base
        if c["shifts"]:
            self.buffer.apply_shifts([WindowShift(*s) for s in c["shifts"]])

    def _stage_forward(self, batch: ForwardBatch, hidden_in: torch.Tensor | None) -> torch.Tensor:
        """This stage's layers: [T, hidden] residual rows (wire dtype) after them."""
        started = time.perf_counter()
        out = self.native.run_stage(batch, hidden_in) if self.native is not None else None
        if out is None:
            dtype = self.buffer.dtype
            hidden = self.model.embed_tokens(batch) if hidden_in is None else hidden_in.to(self.device, dtype)
            out = self.model.run_layers(hidden, batch, self.buffer.layers).to(self.wire)
        self.busy_seconds += time.perf_counter() - started
        return out

    def _head(self, hidden: torch.Tensor, greedy: bool) -> torch.Tensor | list[int]:
        started = time.perf_counter()
        out = self.native.head(hidden, greedy) if self.native is not None else None
        if out is None:
            out = self.model.head(hidden.to(self.device, self.buffer.dtype))
        self.busy_seconds += time.perf_counter() - started
        return out

    def _after_layers(self, batch: ForwardBatch, hidden: torch.Tensor, ledger: torch.Tensor) -> None:
        """The next stage gets every row; the last stage sends only the rows the head needs; the
        ledger row after them, with this stage's figures written in."""
        s, stages = self.place.stage, self.place.stages
        ledger[0, s] = self.busy_seconds
        ledger[0, stages + s] = self.link.bytes_sent / 2**20
        rows = hidden[batch.sample_rows] if self.place.last else hidden
        self.link.send_hidden(torch.cat((rows.to(self.wire), ledger)))

    def _receive(self, rows: int, timeout: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """`rows` residual rows from the stage before, and the ledger row after them."""
        try:
            both = self.link.receive_hidden(rows + 1, self.hidden_size, self.wire, timeout)
        except StageTimeout:
            self.broken = True
            raise
        return both[:rows], both[rows:]

    # -- the leader ---------------------------------------------------------------------------
    def start(self, plan) -> InFlight | None:
        """The plan's copies here and on every stage, then (unless it has no rows) its first
        stage's layers; None when there is nothing to finish."""
        copies = _copies(plan)
        self._apply_copies(copies)  # (as every other rank of the group applies them)
        for request in plan.admitted:
            self.sampling_state(request)
        if plan.empty:
            if plan.saves or plan.moves or plan.loads or plan.shifts:
                self.link.send_work({"op": "forward", "copies": copies})
            return None
        started = time.perf_counter()
        batch, rows = self.build_batch(plan)
        self.link.send_work({"op": "forward", "copies": copies, "batch": encode_batch(batch)})
        ledger = torch.zeros(1, self.hidden_size, dtype=self.wire)
        self._after_layers(batch, self._stage_forward(batch, None), ledger)
        tokens = batch.input_ids.shape[0]
        return InFlight(plan, rows, batch.sample_rows.shape[0], tokens, batch.draft_rows, started)

    def finish(self, flight: InFlight) -> StepResult:
        """The plan's rows back from the last stage: the head, then sampling (and drafts' checks)."""
        if self.place.tp > 1:  # the first stage's other ranks run their vocabulary blocks of the head
            self.link.send_work({"op": "head", "rows": flight.out_rows}, range(1, self.place.tp))
        hidden, ledger = self._receive(flight.out_rows, self.timeout)
        stages = self.place.stages
        self.stage_busy = [self.busy_seconds, *ledger[0, 1:stages].tolist()]
        self.stage_mib_sent = [self.link.bytes_sent / 2**20, *ledger[0, stages + 1 : 2 * stages].tolist()]
        rows = flight.rows
        greedy = not rows.scoring and plain_greedy(rows.sampled)
        logits = self._head(hidden, greedy)
        result = self.sample(logits, rows)
        result.rows, result.draft_rows = flight.token_rows, flight.draft_rows
        result.seconds = time.perf_counter() - flight.started
        return result

    def pipeline_stats(self, in_flight: int) -> dict:
        """Each stage's busy share since the start (1 - it: the bubble) and seconds, MiB sent,
        and the plans in flight now."""
        elapsed = max(1e-9, time.perf_counter() - self.started_at)
        return {
            "stages": self.place.stages,
            "in_flight": in_flight,
            "busy": [min(1.0, b / elapsed) for b in self.stage_busy],
            "busy_s": list(self.stage_busy),
            "mib_sent": list(self.stage_mib_sent),
        }

    def expert_load(self) -> list[dict] | None:
        """The leader: its own layers' and, as the other stages last reported them, theirs (each
        stage's first rank is asked again now, answering after the work already sent)."""
        if getattr(self.model.cfg, "moe", None) is None:
            return None
        self._take_reports()
        others = range(self.place.tp, self.link.size, self.place.tp)  # (each later stage's tp rank 0)
        ask = [r for r in others if r not in self._asked]  # (one question at a time: none left unanswered)
        if ask:
            self.link.send_work({"op": "report"}, ask)
            self._asked.update(ask)
        loads = [*(super().expert_load() or ()), *(x for r in others for x in self.stage_expert_load.get(r) or ())]
        return sorted(loads, key=lambda x: x["layer"]) or None

    def _take_reports(self) -> bool:
        """File the reports that arrived; True when no question is left unanswered."""
        for rank, loads in self.link.receive_reports().items():
            self.stage_expert_load[rank] = loads
            self._asked.discard(rank)
        return not self._asked

    def stop_followers(self) -> None:
        if self.broken:  # a stage is frozen: the job is ended by an abort, which stops it too
            return
        deadline = time.monotonic() + 10.0  # questions still open: their answers before the stages stop
        while not self._take_reports() and time.monotonic() < deadline:
            time.sleep(0.01)
        self.link.send_work({"op": "shutdown"})
        self.link.sends.flush()

    # -- every other rank ---------------------------------------------------------------------
    def follow(self) -> None:
        """Until the leader shuts down: each work message in turn."""
        while True:
            work = self.link.receive_work()
            op = work["op"]
            if op == "shutdown":
                return
            if op == "report":  # (a stage's first rank: its layers' expert load)
                self.link.send_report(super().expert_load())
                continue
            if op == "head":
                hidden, _ = self._receive(work["rows"])
                self.comm.gather_to_root(self._head(hidden, False))  # the leader samples
                continue
            self._apply_copies(work["copies"])
            if "batch" not in work:
                continue
            batch = decode_batch(work["batch"], self.device)
            rows = batch.input_ids.shape[0]
            if self.place.stage == 0:  # (a tensor-parallel rank of the first stage)
                hidden_in, ledger = None, torch.zeros(1, self.hidden_size, dtype=self.wire)
            else:
                hidden_in, ledger = self._receive(rows)
            self._after_layers(batch, self._stage_forward(batch, hidden_in), ledger)
