"""A few ZeRO-3 steps on every rank of a job started by `fnzero launch --launcher ...` (the hostfile
tests launch it): each rank prints its rank, world, local rank, network namespace (its "host"),
which launcher variables gave its rank, a forwarded variable, the cores it may run on and its
OMP_NUM_THREADS, and the global loss. With the argument `wait`, the ranks then wait until the job
is ended from outside."""

import os
import sys
import time

import torch
import torch.nn.functional as F

import fnzero
from fnzero.testing import MLP

dist = fnzero.init_distributed(timeout_s=60, watchdog_s=15)
cfg = fnzero.load_config({"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW"},
                          "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}})
torch.manual_seed(0)
sm = fnzero.shard(MLP([4, 8, 2]), config=cfg)
state = sm.init_state()
step = fnzero.train_step(lambda p, b: F.mse_loss(sm.apply(p, b[0]), b[1]), cfg)
g = torch.Generator().manual_seed(dist.rank)
for i in range(3):
    state, m = step(state, (torch.randn(2, 4, generator=g), torch.randn(2, 2, generator=g)))
given = "openmpi" if "OMPI_COMM_WORLD_RANK" in os.environ else "torchrun" if "GROUP_RANK" in os.environ else "?"
with open("/proc/self/status") as f:
    cpus = f.read().split("Cpus_allowed_list:")[1].split()[0]
print(f"RESULT rank={dist.rank} world={dist.world_size} local={dist.local_rank} net={os.readlink('/proc/self/ns/net')} "
      f"by={given} var={os.environ.get('FNZ_HOSTFILE_TEST')} cpus={cpus} omp={os.environ.get('OMP_NUM_THREADS')} "
      f"loss={m['loss']:.10f}", flush=True)
while sys.argv[1:] == ["wait"]:
    time.sleep(0.2)
