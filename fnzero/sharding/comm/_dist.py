"""Process-group setup from the launcher's environment (torchrun, `fnzero launch`, an MPI's
mpirun, SLURM's srun; `specs/cli.md` §What each MPI's variables mean)."""

from __future__ import annotations

import atexit
import dataclasses
import datetime
import os
import socket
import sys

import torch
import torch.distributed as dist

from ..._errors import DistributedError
from ..._launch_env import launcher_ranks
from ._collectives import provided_collectives
from ._failure import uncaught
from ._watchdog import start_watchdog

__all__ = ["init_distributed", "DistInfo", "free_port"]


@dataclasses.dataclass(frozen=True)
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    backend: str | None
    device: torch.device


def init_distributed(backend: str | None = None, timeout_s: float = 600.0,
                     malloc_mmap_threshold: int | None = 4 << 20, watchdog_s: float = 300.0) -> DistInfo:
    """Join the process group described by the environment, or run as a world of one.

    Reads torchrun's RANK/WORLD_SIZE/LOCAL_RANK, or an MPI's (Open MPI's OMPI_COMM_WORLD_*,
    MVAPICH2's MV2_COMM_WORLD_*, MPICH/Intel MPI's PMI_RANK/PMI_SIZE/MPI_LOCALRANKID) or
    SLURM's (SLURM_PROCID/SLURM_NTASKS/SLURM_LOCALID) when torchrun's are absent
    (`launcher_ranks`), and MASTER_ADDR/MASTER_PORT, which `fnzero launch --launcher ...` exports to
    every rank. The backend defaults to NCCL when CUDA is available and gloo otherwise; on CUDA
    each process takes device `LOCAL_RANK`. `timeout_s` bounds every collective, so a rank that
    dies makes the others fail instead of hang.
    `watchdog_s` starts the collective watchdog: a rank missing from a collective that long ends
    the job, named (`specs/collectives.md` §Watchdog; 0 = off; a config's
    `watchdog.timeout_seconds` given to `shard` replaces it). It never waits more than half of
    `timeout_s`, so that it names the stuck rank before the backend's timeout fails another.
    `malloc_mmap_threshold` sets this process's allocator policy (`fnzero.memory.return_freed_memory`);
    None or 0 leaves glibc's defaults.

    Inside `fnzero.testing.simulated_world(n).run(fn)` it returns the calling thread's rank
    (backend "simulated", CPU) and touches neither torch.distributed nor the environment.
    """
    # A rank of fnzero.testing.simulated_world is a thread with no process group: its
    # collectives are provided to the code it runs (`providing_collectives`).
    comm = provided_collectives()
    if comm is not None:
        backend = getattr(comm, "backend", "provided")
        return DistInfo(comm.rank, comm.world_size, comm.rank, backend, torch.device("cpu"))
    if malloc_mmap_threshold:
        from ..._ext import return_freed_memory

        return_freed_memory(malloc_mmap_threshold)
    rank, world, local, _ = launcher_ranks()
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    if world is None or world == 1 and not dist.is_initialized():
        return DistInfo(0, 1, 0, None, device)
    if rank is None:
        raise DistributedError("WORLD_SIZE is set but RANK is not; launch with `fnzero launch` or torchrun")
    if "MASTER_ADDR" not in os.environ or "MASTER_PORT" not in os.environ:
        raise DistributedError(f"MASTER_ADDR and MASTER_PORT must be set for a multi-process run (rank {rank} of "
                               f"{world}); `fnzero launch` sets them for every launcher")
    backend = backend or ("nccl" if cuda else "gloo")
    if not dist.is_initialized():
        dist.init_process_group(
            backend, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=timeout_s),
            device_id=device if backend == "nccl" else None,
        )
        atexit.register(_destroy_at_exit)  # before the watchdog's: atexit runs it after (last in, first out)
    start_watchdog(dist.get_rank(), dist.get_world_size(), watchdog_s, timeout_s)
    return DistInfo(dist.get_rank(), dist.get_world_size(), local, backend, device)


def _destroy_at_exit() -> None:
    """Destroy the process group this module created, at a normal exit (a `SystemExit` included:
    an autotuner trial ends so), while the interpreter is still whole. Left to interpreter
    teardown, gloo's worker threads may still hold finished work whose tensors need the GIL, and
    the rank then ends by SIGABRT ("terminate called without an active exception") after its job
    is done: one autotuner trial in about 140 was recorded as failed so. A rank that an error ends
    keeps the group: NCCL's destroy may block on a broken communicator, and the watchdog's records
    (`_failure.py`) already name the rank at fault."""
    if uncaught() is not None or not dist.is_initialized():
        return
    try:
        dist.destroy_process_group()
    except Exception as e:  # the job's work is done; say so, and do not fail it for this
        print(f"fnzero: destroying the process group at exit failed: {type(e).__name__}: {e}", file=sys.stderr)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (a one-node rendezvous)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
