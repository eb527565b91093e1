"""Trains a few ZeRO-3 steps and prints rank, world size and final loss (multi-node test), and at
exit whether the process group is gone (init_distributed destroys the group it created)."""

import atexit

import torch
import torch.nn.functional as F

import fnzero
from fnzero.testing import MLP

# Registered first, so it runs last (atexit is last in, first out).
atexit.register(lambda: print(f"EXIT group destroyed={not torch.distributed.is_initialized()}", flush=True))
dist = fnzero.init_distributed(timeout_s=60)
torch.manual_seed(0)
cfg = fnzero.load_config({"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW"},
                          "zero_optimization": {"stage": 3}}, world_size=dist.world_size)
sm = fnzero.shard(MLP([4, 8, 2]), config=cfg)
state = sm.init_state()
step = fnzero.train_step(lambda p, b: F.mse_loss(sm.apply(p, b[0]), b[1]), cfg)
g = torch.Generator().manual_seed(dist.rank)
for i in range(3):
    state, m = step(state, (torch.randn(2, 4, generator=g), torch.randn(2, 2, generator=g)))
print(f"RESULT rank={dist.rank} world={dist.world_size} loss={m['loss']:.10f}", flush=True)
