"""The communicator contract and the MPI implementation (CPU tensors).

Control plane (step plans, sampled ids) always goes through MPI. The data plane (all-reduce of
activations, gather of vocabulary-sharded logits) goes through MPI for CPU tensors and through
NCCL for CUDA tensors (flover.parallel.nccl).
"""

from __future__ import annotations

import time
from typing import Protocol

import numpy as np
import torch


class Communicator(Protocol):
    rank: int
    size: int

    def broadcast_bytes(self, data: bytes | None) -> bytes:
        """Root's bytes to every rank. Non-root ranks wait without spinning."""

    def broadcast_ids(self, ids: list[int] | None, count: int) -> list[int]:
        """Root's `count` token ids to every rank."""

    def all_reduce(self, tensor: torch.Tensor) -> None:
        """In-place sum over ranks."""

    def gather_to_root(self, tensor: torch.Tensor) -> torch.Tensor | None:
        """[*shape] on every rank -> [size, *shape] on the root, None elsewhere."""


def wait_without_spinning(request, max_sleep: float = 0.005) -> None:
    """Wait for a non-blocking MPI request. Spins for ~1 ms (the common case while generating:
    the root is only sampling), then sleeps with exponential back-off, so an idle rank costs ~0% CPU
    (a blocking MPI call in Open MPI busy-polls a core at 100%)."""
    wait_until(request.Test, max_sleep=max_sleep)


def wait_until(ready, spin: float = 0.001, max_sleep: float = 0.005) -> None:
    """Until `ready()`: asked in a loop for `spin` seconds, then between sleeps that double from
    50 us up to `max_sleep`."""
    deadline = time.perf_counter() + spin
    while not ready():
        if time.perf_counter() < deadline:
            continue
        sleep = min(50e-6, max_sleep)
        while not ready():
            time.sleep(sleep)
            sleep = min(sleep * 2, max_sleep)
        return


class PendingSends:
    """Non-blocking MPI sends whose buffers must live until each one completes."""

    def __init__(self):
        self._sending: list = []  # (request, buffer)

    def add(self, request, buffer) -> None:
        self._sending.append((request, buffer))
        self.progress()

    def progress(self) -> None:
        self._sending = [(r, b) for r, b in self._sending if not r.Test()]

    def flush(self, timeout: float = 5.0) -> None:
        """Wait (a while) for what was sent to leave: before this rank stops."""
        deadline = time.monotonic() + timeout
        while self._sending and time.monotonic() < deadline:
            self.progress()
            time.sleep(0.001)


class MPICommunicator:
    """mpi4py over COMM_WORLD; tensors cross as zero-copy NumPy views of CPU tensors."""

    def __init__(self, comm=None):
        from mpi4py import MPI

        self.MPI = MPI
        self.comm = comm or MPI.COMM_WORLD
        self.rank = self.comm.Get_rank()
        self.size = self.comm.Get_size()

    def broadcast_bytes(self, data: bytes | None) -> bytes:
        header = np.array([len(data) if self.rank == 0 else 0], dtype=np.int64)
        request = self.comm.Ibcast(header, root=0)
        if self.rank == 0:
            request.Wait()
        else:
            wait_without_spinning(request)
        payload = np.frombuffer(data, dtype=np.uint8).copy() if self.rank == 0 else np.empty(int(header[0]), np.uint8)
        self.comm.Bcast(payload, root=0)
        return payload.tobytes()

    def broadcast_ids(self, ids: list[int] | None, count: int) -> list[int]:
        buf = np.asarray(ids, dtype=np.int64) if self.rank == 0 else np.empty(count, dtype=np.int64)
        self.comm.Bcast(buf, root=0)
        return buf.tolist()

    def all_reduce(self, tensor: torch.Tensor) -> None:
        if tensor.dtype in (torch.bfloat16, torch.float16):
            # MPI has no 16-bit float type: reduce in float32 (also the more accurate sum).
            wide = tensor.float()
            self.comm.Allreduce(self.MPI.IN_PLACE, wide.numpy(), op=self.MPI.SUM)
            tensor.copy_(wide)
            return
        assert tensor.is_contiguous() and tensor.device.type == "cpu"
        self.comm.Allreduce(self.MPI.IN_PLACE, tensor.numpy(), op=self.MPI.SUM)

    def gather_to_root(self, tensor: torch.Tensor) -> torch.Tensor | None:
        send = tensor.float() if tensor.dtype in (torch.bfloat16, torch.float16) else tensor.contiguous()
        recv = torch.empty((self.size, *send.shape), dtype=send.dtype) if self.rank == 0 else None
        self.comm.Gather(send.numpy(), recv.numpy() if recv is not None else None, root=0)
        return recv

    def abort(self, code: int = 1) -> None:
        self.comm.Abort(code)
