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

    Reads the ranks torchrun, an MPI or SLURM sets, and MASTER_ADDR/MASTER_PORT (`specs/cli.md` §What
    each MPI's variables mean). `backend`: default NCCL when CUDA is available (each process then
    takes device `LOCAL_RANK`), else gloo. `timeout_s` bounds every collective (`specs/collectives.md`
    §Faults). `watchdog_s`: a rank missing from a collective that long ends the job, named (at most
    half of `timeout_s`; 0 = off; `specs/collectives.md` §Watchdog). `malloc_mmap_threshold`: this
    process's allocator policy (`fnzero.memory.return_freed_memory`); None or 0 leaves glibc's.

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
    """Destroy the process group this module created, at a normal exit, while the interpreter is whole
    (`specs/collectives.md` §Faults). A rank that an error ends keeps it: NCCL's destroy may block on
    a broken communicator."""
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
