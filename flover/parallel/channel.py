"""The leader/follower channel of tensor parallelism: what rank 0 took in since the last iteration
(requests queued and cancelled, shutdown, its cost fit) reaches every rank at the start of the
next one, in the order it happened (IntakeMessage). Followers wait for it without spinning."""

from __future__ import annotations

from flover.parallel.comm import Communicator
from flover.parallel.intake_events import AddEvent, IntakeMessage


class IntakeChannel:
    def __init__(self, comm: Communicator):
        self.comm = comm
        self.is_leader = comm.rank == 0
        self._intake = IntakeMessage()  # the leader's, since the last exchange
        self.closed = False  # the leader sent (or a follower received) shutdown

    # -- the leader ----------------------------------------------------------------------
    def added(self, event: AddEvent) -> None:
        if self.is_leader:
            self._intake.add(event)

    def cancelled(self, request_id: str) -> None:
        if self.is_leader:
            self._intake.cancel(request_id)

    def close(self) -> None:
        """Leader: the followers' loops end after this message."""
        if self.is_leader and not self.closed:
            self._intake.shutdown = True
            self.comm.broadcast_bytes(self._intake.encode())
            self.closed = True

    # -- both ----------------------------------------------------------------------------
    def exchange(self, knee: float) -> IntakeMessage | None:
        """The start of an iteration. Leader: send its intake (and `knee`, its cost fit), None
        back. Follower: the leader's message, to apply before scheduling."""
        if self.is_leader:
            self._intake.knee = knee
            self.comm.broadcast_bytes(self._intake.encode())
            self._intake = IntakeMessage()
            return None
        message = IntakeMessage.decode(self.comm.broadcast_bytes(None))
        self.closed = message.shutdown
        return message
