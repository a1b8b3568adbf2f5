"""How this process was launched: alone, or as one rank of an `mpirun`/`srun` job."""

from __future__ import annotations

import os
from dataclasses import dataclass

from flover.parallel.comm import Communicator, MPICommunicator
from flover.parallel.groups import GroupLayout, split_world

_SIZE_VARS = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE", "MPI_WORLD_SIZE", "SLURM_STEP_NUM_TASKS")
_RANK_VARS = ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "SLURM_PROCID")
_LOCAL_SIZE_VARS = ("OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS", "PMI_LOCAL_SIZE", "SLURM_NTASKS_PER_NODE")
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


def rank_device(device: str) -> str:
    """Under a launcher, every rank of the job (whatever its group's size) uses its node's GPU
    `local_rank` (unless one is named)."""
    if launched_ranks() > 1 and device == "cuda":
        return f"cuda:{local_rank()}"
    return device


def make_communicator(device: str) -> Communicator | None:
    """None for a single process (TP=1 needs no MPI runtime); MPI for CPU tensors; NCCL for CUDA."""
    return launch_groups(device, None).comm


@dataclass
class Launch:
    comm: Communicator | None  # this rank's engine group (None: a group of one)
    world: MPICommunicator | None  # None: started without mpirun
    layout: GroupLayout


def launch_groups(device: str, tp: int | None) -> Launch:
    """This rank's place in the job: with `tp` (ranks per engine) below the world's size, the
    world splits into data-parallel groups (flover/parallel/groups.py)."""
    alone = Launch(None, None, GroupLayout(0, (0,)))
    if launched_ranks() <= 1:
        if tp not in (None, 1):
            raise ValueError(f"--tp {tp} needs {tp} ranks: launch with mpirun -np {tp} (or a multiple)")
        return alone
    try:
        world = MPICommunicator()
    except ImportError as e:
        raise RuntimeError("launched by mpirun but mpi4py is missing: pip install 'flover[mpi]'") from e
    tp = world.size if tp is None else tp
    if not 1 <= tp <= world.size or world.size % tp:
        raise ValueError(f"--tp {tp}: the {world.size} ranks must split into groups of --tp ranks")
    group, layout = (world, GroupLayout(0, (0,))) if tp == world.size else split_world(world, tp)
    if group.size <= 1:
        return Launch(None, world, layout)
    if device.startswith("cuda"):
        import torch

        from flover.parallel.nccl import NCCLCommunicator

        return Launch(NCCLCommunicator(group, torch.device(rank_device(device))), world, layout)
    return Launch(group, world, layout)


def local_ranks() -> int | None:
    """Ranks of this job on this node (they share its cores): 1 without a launcher, None when the
    launcher does not say."""
    if launched_ranks() <= 1:
        return 1
    for var in _LOCAL_SIZE_VARS:
        if os.environ.get(var, "").isdigit():
            return int(os.environ[var])
    return None


def launched_rank() -> int:
    for var in _RANK_VARS:
        if os.environ.get(var, "").isdigit():
            return int(os.environ[var])
    return 0
