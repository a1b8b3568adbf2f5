"""How this process was launched: alone, or as one rank of an `mpirun`/`srun` job."""

from __future__ import annotations

import os
from dataclasses import dataclass

from flover.parallel.comm import Communicator, MPICommunicator
from flover.parallel.groups import GroupLayout, split_world
from flover.parallel.pipeline import StageLink, StagePlace

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
    comm: Communicator | None  # this rank's engine group, or its stage's (None: a group of one)
    world: MPICommunicator | None  # None: started without mpirun
    layout: GroupLayout
    pipe: StageLink | None = None  # pipeline stages (--pp): this rank's place and links


def launch_groups(device: str, tp: int | None, pp: int = 1) -> Launch:
    """This rank's place in the job: with `pp` x `tp` (ranks per engine) below the world's size,
    the world splits into data-parallel groups (flover/parallel/groups.py); with `pp` > 1 each
    group is `pp` pipeline stages of `tp` ranks (flover/parallel/pipeline.py)."""
    alone = Launch(None, None, GroupLayout(0, (0,)))
    if pp < 1:
        raise ValueError(f"--pp {pp}: at least 1 stage")
    if launched_ranks() <= 1:
        if tp not in (None, 1) or pp > 1:
            need = (tp or 1) * pp
            raise ValueError(
                f"--tp {tp or 1} --pp {pp} needs {need} ranks: launch with mpirun -np {need} (or a multiple)"
            )
        return alone
    try:
        world = MPICommunicator()
    except ImportError as e:
        raise RuntimeError("launched by mpirun but mpi4py is missing: pip install 'flover[mpi]'") from e
    if tp is None:
        if world.size % pp:
            raise ValueError(f"--pp {pp}: the {world.size} ranks do not split into {pp} stages")
        tp = world.size // pp
    size = tp * pp
    if not 1 <= size <= world.size or world.size % size:
        if pp == 1:
            raise ValueError(f"--tp {tp}: the {world.size} ranks must split into groups of --tp ranks")
        raise ValueError(f"--pp {pp} x --tp {tp}: the {world.size} ranks must split into groups of {size} ranks")
    group, layout = (world, GroupLayout(0, (0,))) if size == world.size else split_world(world, size)
    if pp > 1:
        return _stages(device, group, world, layout, StagePlace(group.rank // tp, pp, group.rank % tp, tp))
    if group.size <= 1:
        return Launch(None, world, layout)
    if device.startswith("cuda"):
        import torch

        from flover.parallel.nccl import NCCLCommunicator

        return Launch(NCCLCommunicator(group, torch.device(rank_device(device))), world, layout)
    return Launch(group, world, layout)


def _stages(device: str, group: MPICommunicator, world, layout: GroupLayout, place: StagePlace) -> Launch:
    """A group of pipeline stages: this rank's stage's communicator (tensor parallelism inside
    it) and its links to the group's other ranks."""
    if device.startswith("cuda"):
        raise ValueError("--pp runs on CPU ranks for now (its activations cross over MPI); use --tp on GPUs")
    stage = MPICommunicator(group.comm.Split(color=place.stage, key=group.rank))
    return Launch(stage if stage.size > 1 else None, world, layout, StageLink(group, place))


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
