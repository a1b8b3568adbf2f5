"""Data-parallel groups: an `mpirun -np N` job split into N / tp engines of `tp` ranks each.

Each group is one fused engine (tensor parallel inside it, exactly as a job of `tp` ranks);
world rank 0 leads group 0 and is the front door, and talks to the other groups' leaders through
a Mailbox. A group stays inside one node when every node holds a multiple of `tp` ranks (the
ranks of a node are grouped in rank order); otherwise groups are consecutive world ranks."""

from __future__ import annotations

import time
from dataclasses import dataclass

import msgpack
import numpy as np

from flover.parallel.comm import MPICommunicator, PendingSends


@dataclass(frozen=True)
class GroupLayout:
    index: int  # this rank's group
    leaders: tuple[int, ...]  # the world rank leading each group (its group rank 0)

    @property
    def count(self) -> int:
        return len(self.leaders)


def group_of_ranks(nodes: list[str], tp: int) -> list[int]:
    """World rank -> group, given each rank's node name: groups inside nodes when every node has
    a multiple of `tp` ranks, numbered in the order of their lowest rank (rank 0's group is 0)."""
    size = len(nodes)
    if size % tp:
        raise ValueError(f"{size} ranks cannot make groups of --tp {tp}: launch a multiple of {tp}")
    by_node: dict[str, list[int]] = {}
    for rank, node in enumerate(nodes):
        by_node.setdefault(node, []).append(rank)
    if all(len(ranks) % tp == 0 for ranks in by_node.values()):
        teams = [ranks[i : i + tp] for ranks in by_node.values() for i in range(0, len(ranks), tp)]
    else:  # a node with a part of a group: consecutive ranks, some groups across nodes
        teams = [list(range(i, i + tp)) for i in range(0, size, tp)]
    teams.sort(key=min)
    group = [0] * size
    for g, team in enumerate(teams):
        for rank in team:
            group[rank] = g
    return group


def split_world(world: MPICommunicator, tp: int) -> tuple[MPICommunicator, GroupLayout]:
    """This rank's group communicator (group rank 0: its lowest world rank) and the layout."""
    nodes = world.comm.allgather(world.MPI.Get_processor_name())  # (strings: mpi4py's own encoding)
    group = group_of_ranks(nodes, tp)
    leaders = tuple(min(r for r in range(world.size) if group[r] == g) for g in range(max(group) + 1))
    sub = world.comm.Split(color=group[world.rank], key=world.rank)
    return MPICommunicator(sub), GroupLayout(group[world.rank], leaders)


class Mailbox:
    """msgpack messages between world ranks (byte buffers over MPI, never pickle): sent without
    blocking, read when they are there. MPI keeps the order between two ranks."""

    TAG = 71

    def __init__(self, world: MPICommunicator):
        self.comm, self.MPI = world.comm, world.MPI
        self.sends = PendingSends()

    def send(self, dest: int, message) -> None:
        buf = np.frombuffer(msgpack.packb(message), dtype=np.uint8)
        self.sends.add(self.comm.Isend([buf, self.MPI.BYTE], dest=dest, tag=self.TAG), buf)

    def receive(self) -> list[tuple[int, object]]:
        """Every message that has arrived: (source rank, message), in order per source."""
        self.sends.progress()
        found, status = [], self.MPI.Status()
        while self.comm.Iprobe(source=self.MPI.ANY_SOURCE, tag=self.TAG, status=status):
            buf = np.empty(status.Get_count(self.MPI.BYTE), dtype=np.uint8)
            source = status.Get_source()
            self.comm.Recv([buf, self.MPI.BYTE], source=source, tag=self.TAG)
            found.append((source, msgpack.unpackb(buf.tobytes())))
        return found

    def wait(self, timeout: float, max_sleep: float = 0.002) -> None:
        """Until a message is there or `timeout` passed, sleeping (an idle rank costs ~0% CPU)."""
        deadline, sleep = time.monotonic() + timeout, 50e-6
        while not self.comm.Iprobe(source=self.MPI.ANY_SOURCE, tag=self.TAG):
            self.sends.progress()
            if time.monotonic() >= deadline:
                return
            time.sleep(sleep)
            sleep = min(sleep * 2, max_sleep)

    def flush(self, timeout: float = 5.0) -> None:
        """Wait (a while) for what was sent to leave: before this rank stops."""
        self.sends.flush(timeout)
