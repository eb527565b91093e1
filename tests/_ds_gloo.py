"""Shared by the runners that run DeepSpeed itself (`_ds_*_runner.py`, under the interpreter of
FNZERO_DEEPSPEED_PYTHON): join this rank's gloo world on CPU as DeepSpeed's launcher would."""

from __future__ import annotations

import os
import sys

import torch


def init_deepspeed_gloo(rank: int, world: int, store: str | None = None):
    """DeepSpeed, its process group joined as `rank` of `world` over gloo on CPU: through the file
    `store` (rendezvous without a port), else MASTER_ADDR/MASTER_PORT from the environment."""
    os.environ.update(DS_ACCELERATOR="cpu", RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      LOCAL_SIZE=str(world))
    torch.set_num_threads(1)
    import deepspeed
    import deepspeed.comm.torch  # noqa: F401

    # On CPU, DeepSpeed's TorchBackend JIT-builds a shared-memory op on init (a minute, or a hang on
    # a stale build lock); gloo needs none of it.
    sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None
    if store is None:
        deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    else:
        deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False, verbose=False,
                                   init_method=f"file://{store}", rank=rank, world_size=world)
    return deepspeed


def run_ranks(worker) -> None:
    """A runner's main: the spec (JSON) named on the command line, run by `worker(rank, spec, store)`
    on each of its `world` ranks (spawned; one in this process), meeting through a file store that
    is removed afterwards."""
    import json
    import shutil
    import tempfile

    with open(sys.argv[1]) as f:
        spec = json.load(f)
    tmp = tempfile.mkdtemp(prefix="ds_store_")
    store = os.path.join(tmp, "store")  # must not exist yet: the ranks create it
    try:
        if spec["world"] == 1:
            worker(0, spec, store)
        else:
            import torch.multiprocessing as mp

            mp.spawn(worker, args=(spec, store), nprocs=spec["world"], join=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
