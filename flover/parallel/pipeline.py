"""The links of pipeline stages (--pp) over MPI: a data-parallel group of P x T ranks is P stages
of T tensor-parallel ranks (group rank = stage * T + tp rank). The group's rank 0 leads: it sends
every other rank of the group each plan's work (msgpack, in plan order), and stage s's tp rank t
sends its residual rows to stage s + 1's tp rank t; the last stage's go back to the first stage,
whose head samples (the ring closes where the scheduler lives).

MPI keeps the order of messages between two ranks with one tag, so every rank sees the plans,
and every stage the activations, in the order the leader made them."""

from __future__ import annotations

import time
from dataclasses import dataclass

import msgpack
import numpy as np
import torch

from flover.parallel.comm import MPICommunicator, PendingSends, wait_until

WORK_TAG, HIDDEN_TAG, REPORT_TAG = 81, 82, 83
_WIRE_DTYPES = {torch.float32: np.float32, torch.float64: np.float64}


@dataclass(frozen=True)
class StagePlace:
    stage: int  # 0 .. stages - 1
    stages: int
    tp_rank: int
    tp: int

    @property
    def group_rank(self) -> int:
        return self.stage * self.tp + self.tp_rank

    @property
    def last(self) -> bool:
        return self.stage == self.stages - 1


class StageLink:
    """This rank's messages to and from the other ranks of its pipeline group."""

    def __init__(self, group: MPICommunicator, place: StagePlace):
        self.group = group  # (the engine's communicator of every rank: its collectives at start-up)
        self.comm, self.MPI, self.place = group.comm, group.MPI, place
        self.size = group.size
        self.sends = PendingSends()
        t = place.tp
        self.next_rank = ((place.stage + 1) % place.stages) * t + place.tp_rank  # (the last stage: the first)
        self.prev_rank = ((place.stage - 1) % place.stages) * t + place.tp_rank
        self.bytes_sent = 0

    @property
    def is_leader(self) -> bool:
        return self.place.group_rank == 0

    # -- the leader's work messages ----------------------------------------------------------
    def send_work(self, message: dict, ranks: range | None = None) -> None:
        """Leader: `message` to every other rank of the group (or to `ranks`)."""
        buf = np.frombuffer(msgpack.packb(message), dtype=np.uint8)
        for rank in ranks if ranks is not None else range(1, self.size):
            self._isend(buf, rank, WORK_TAG)

    def receive_work(self, max_sleep: float = 0.002) -> dict:
        """The leader's next message. Polls with a growing sleep (up to `max_sleep`): an idle
        rank costs ~0% CPU (a blocking MPI receive in Open MPI busy-polls a core)."""
        status = self.MPI.Status()
        wait_until(lambda: self.comm.Iprobe(source=0, tag=WORK_TAG, status=status), max_sleep=max_sleep)
        buf = np.empty(status.Get_count(self.MPI.BYTE), dtype=np.uint8)
        self.comm.Recv([buf, self.MPI.BYTE], source=0, tag=WORK_TAG)
        return msgpack.unpackb(buf.tobytes(), strict_map_key=False)

    # -- a stage's figures, asked for by the leader (plain data) ----------------------------
    def send_report(self, report) -> None:
        """To the leader: this stage's figures (after the work before the question)."""
        self._isend(np.frombuffer(msgpack.packb(report), dtype=np.uint8), 0, REPORT_TAG)

    def receive_reports(self) -> dict[int, object]:
        """Leader: the reports that have arrived, by group rank (none waited for)."""
        status, found = self.MPI.Status(), {}
        while self.comm.Iprobe(source=self.MPI.ANY_SOURCE, tag=REPORT_TAG, status=status):
            buf = np.empty(status.Get_count(self.MPI.BYTE), dtype=np.uint8)
            self.comm.Recv([buf, self.MPI.BYTE], source=status.Get_source(), tag=REPORT_TAG)
            found[status.Get_source()] = msgpack.unpackb(buf.tobytes(), strict_map_key=False)
        return found

    # -- activations -------------------------------------------------------------------------
    def send_hidden(self, hidden: torch.Tensor) -> None:
        """[rows, hidden] residual rows to the next stage (the last stage's: to the first)."""
        array = hidden.detach().cpu().contiguous().numpy()
        self.bytes_sent += array.nbytes
        self._isend(array, self.next_rank, HIDDEN_TAG)

    def receive_hidden(self, rows: int, width: int, dtype: torch.dtype, timeout: float | None = None) -> torch.Tensor:
        """[rows, width] from the previous stage (the first stage: from the last); StageTimeout
        when they have not come within `timeout` seconds (None: no bound)."""
        out = np.empty((rows, width), dtype=_WIRE_DTYPES[dtype])
        received = self.comm.Irecv(out, source=self.prev_rank, tag=HIDDEN_TAG)
        deadline = None if timeout is None else time.monotonic() + timeout
        done = received.Test
        if deadline is not None:  # (checked between the polls, which stay as short)
            done = lambda: received.Test() or time.monotonic() > deadline  # noqa: E731
        # on the hot path: a stage waits for its neighbour most of the time it is not computing, and
        # a longer back-off would add its overshoot to every iteration
        wait_until(done, spin=200e-6, max_sleep=200e-6)
        if deadline is not None and not received.Test():
            raise StageTimeout(
                f"pipeline stage {self.prev_rank // self.place.tp} sent no rows for {timeout:g} s (frozen, or its "
                f"host gone silent; --stage-timeout): the job ends"
            )
        return torch.from_numpy(out)

    def _isend(self, array: np.ndarray, rank: int, tag: int) -> None:
        self.sends.add(self.comm.Isend(array, dest=rank, tag=tag), array)


class StageTimeout(RuntimeError):
    """A stage did not answer within the bound: the pipeline cannot go on (the job ends)."""


def wire_dtype(dtype: torch.dtype) -> torch.dtype:
    """Residual rows cross in float64 for a float64 model, else float32 (bfloat16 values exactly,
    and the native step's own float32 residual)."""
    return torch.float64 if dtype == torch.float64 else torch.float32
