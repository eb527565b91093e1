"""Which launcher started this process, and the rank, world size, local rank and local size it
gave (`specs/cli.md` §What each MPI's variables mean). No torch: `fnzero launch`'s core-binding step
reads it in front of every rank, and `init_distributed` to join the process group."""

from __future__ import annotations

import os

from ._errors import DistributedError

__all__ = ["RANK_VARIABLES", "launcher_ranks", "env_int"]


def env_int(*names: str) -> int | None:
    for n in names:
        v = os.environ.get(n)
        if v not in (None, ""):
            try:
                return int(v)
            except ValueError as e:
                raise DistributedError(f"environment variable {n}={v!r} is not an integer") from e
    return None


# Who set the process's rank, world size and local rank (and local size), in the order they are
# looked for: torchrun (and `fnzero launch`, DeepSpeed's launch.py, Intel MPI under `fnzero launch
# --launcher impi`), Open MPI's mpirun, MVAPICH2's, MPICH's and Intel MPI's Hydra (PMI), PMIx, SLURM's
# srun last: mpirun inside an allocation leaves the allocation's SLURM_PROCID=0 on every rank.
RANK_VARIABLES: tuple[tuple[str, tuple[str, ...], tuple[str, ...], tuple[str, ...], tuple[str, ...]], ...] = (
    ("torchrun", ("RANK",), ("WORLD_SIZE",), ("LOCAL_RANK",), ("LOCAL_WORLD_SIZE", "LOCAL_SIZE")),
    ("openmpi", ("OMPI_COMM_WORLD_RANK",), ("OMPI_COMM_WORLD_SIZE",), ("OMPI_COMM_WORLD_LOCAL_RANK",),
     ("OMPI_COMM_WORLD_LOCAL_SIZE",)),
    ("mvapich", ("MV2_COMM_WORLD_RANK",), ("MV2_COMM_WORLD_SIZE",), ("MV2_COMM_WORLD_LOCAL_RANK",),
     ("MV2_COMM_WORLD_LOCAL_SIZE",)),
    ("mpich", ("PMI_RANK", "PMIX_RANK"), ("PMI_SIZE", "WORLD_SIZE"), ("MPI_LOCALRANKID", "PALS_LOCAL_RANKID"),
     ("MPI_LOCALNRANKS", "LOCAL_SIZE")),
    ("slurm", ("SLURM_PROCID",), ("SLURM_NTASKS",), ("SLURM_LOCALID",), ("SLURM_NTASKS_PER_NODE",)),
)


def launcher_ranks() -> tuple[int | None, int | None, int, int | None]:
    """(rank, world size, local rank, local size) from the first launcher family whose rank
    variable is set (`RANK_VARIABLES`; within a field, the first name set). Without any: (None,
    WORLD_SIZE, LOCAL_RANK or 0, None)."""
    for _, rank, world, local, local_size in RANK_VARIABLES:
        if any(os.environ.get(n, "") != "" for n in rank):
            return env_int(*rank), env_int(*world), env_int(*local) or 0, env_int(*local_size)
    return None, env_int("WORLD_SIZE"), env_int("LOCAL_RANK") or 0, None
