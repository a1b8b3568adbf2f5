"""NCCL data plane for CUDA tensors (through CuPy), with MPI for the control plane.

The NCCL unique id is created on rank 0 and broadcast over MPI as a plain byte array. Tensors
are passed zero-copy by device pointer, on torch's current CUDA stream, so NCCL work is ordered
with the kernels that produce and consume them.
"""

from __future__ import annotations

import numpy as np
import torch

from flover.parallel.comm import MPICommunicator


def _nccl():
    try:
        from cupy.cuda import nccl
    except ImportError as e:  # pragma: no cover - depends on the optional gpu extra
        raise RuntimeError("tensor parallelism on CUDA needs the gpu extra: pip install 'flover[gpu]'") from e
    return nccl


class NCCLCommunicator:
    def __init__(self, mpi: MPICommunicator, device: torch.device):
        nccl = _nccl()
        self.mpi, self.rank, self.size, self.device = mpi, mpi.rank, mpi.size, device
        uid = np.zeros(nccl.NCCL_UNIQUE_ID_BYTES if hasattr(nccl, "NCCL_UNIQUE_ID_BYTES") else 128, dtype=np.int8)
        if self.rank == 0:
            uid[:] = np.array(nccl.get_unique_id(), dtype=np.int8)
        mpi.comm.Bcast(uid, root=0)
        with torch.cuda.device(device):
            self.comm = nccl.NcclCommunicator(self.size, tuple(int(x) for x in uid), self.rank)
        self._types = {
            torch.float32: nccl.NCCL_FLOAT32,
            torch.float64: nccl.NCCL_FLOAT64,
            torch.float16: nccl.NCCL_FLOAT16,
        }
        if hasattr(nccl, "NCCL_BFLOAT16"):
            self._types[torch.bfloat16] = nccl.NCCL_BFLOAT16
        self._sum = nccl.NCCL_SUM

    def _type(self, tensor: torch.Tensor):
        if tensor.dtype not in self._types:
            raise TypeError(f"NCCL cannot reduce {tensor.dtype}")
        return self._types[tensor.dtype]

    def broadcast_bytes(self, data: bytes | None) -> bytes:
        return self.mpi.broadcast_bytes(data)

    def broadcast_ids(self, ids: list[int] | None, count: int) -> list[int]:
        return self.mpi.broadcast_ids(ids, count)

    def all_reduce(self, tensor: torch.Tensor) -> None:
        assert tensor.is_cuda and tensor.is_contiguous()
        stream = torch.cuda.current_stream(tensor.device).cuda_stream
        self.comm.allReduce(tensor.data_ptr(), tensor.data_ptr(), tensor.numel(), self._type(tensor), self._sum, stream)

    def gather_to_root(self, tensor: torch.Tensor) -> torch.Tensor | None:
        tensor = tensor.contiguous()
        out = torch.empty((self.size, *tensor.shape), dtype=tensor.dtype, device=tensor.device)
        stream = torch.cuda.current_stream(tensor.device).cuda_stream
        self.comm.allGather(tensor.data_ptr(), out.data_ptr(), tensor.numel(), self._type(tensor), stream)
        return out if self.rank == 0 else None

    def abort(self, code: int = 1) -> None:
        self.mpi.abort(code)
