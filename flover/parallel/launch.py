"""How this process was launched: alone, or as one rank of an `mpirun`/`srun` job."""

from __future__ import annotations

import os

from flover.parallel.comm import Communicator, MPICommunicator

_SIZE_VARS = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE", "MPI_WORLD_SIZE", "SLURM_STEP_NUM_TASKS")
_RANK_VARS = ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "SLURM_PROCID")
_LOCAL_RANK_VARS = ("OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "PMI_LOCAL_RANK", "SLURM_LOCALID")


def launched_ranks() -> int:
    """World size announced by the MPI launcher; 1 when started without one (then no MPI is used)."""
    for var in _SIZE_VARS:
        if os.environ.get(var, "").isdigit():
            return int(os.environ[var])
    return 1


def local_rank() -> int:
    for var in _LOCAL_RANK_VARS:
        if os.environ.get(var, "").isdigit():
            return int(os.environ[var])
    return 0


def rank_device(device: str, ranks: int) -> str:
    """With several ranks on a GPU node, rank r uses local GPU `local_rank` (unless one is named)."""
    if ranks > 1 and device == "cuda":
        return f"cuda:{local_rank()}"
    return device


def make_communicator(device: str) -> Communicator | None:
    """None for a single process (TP=1 needs no MPI runtime); MPI for CPU tensors; NCCL for CUDA."""
    if launched_ranks() <= 1:
        return None
    try:
        mpi = MPICommunicator()
    except ImportError as e:
        raise RuntimeError("launched by mpirun but mpi4py is missing: pip install 'flover[mpi]'") from e
    if mpi.size <= 1:
        return None
    if device.startswith("cuda"):
        import torch

        from flover.parallel.nccl import NCCLCommunicator
        return NCCLCommunicator(mpi, torch.device(rank_device(device, mpi.size)))
    return mpi


def launched_rank() -> int:
    for var in _RANK_VARS:
        if os.environ.get(var, "").isdigit():
            return int(os.environ[var])
    return 0
