"""A training script whose rank 1 raises after two steps (the fault-handling test launches it)."""

import torch
import torch.nn.functional as F

import fnzero
from fnzero.testing import MLP

dist = fnzero.init_distributed(timeout_s=30)
torch.manual_seed(0)
cfg = fnzero.load_config({"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW"},
                          "zero_optimization": {"stage": 3}}, world_size=dist.world_size)
sm = fnzero.shard(MLP([4, 8, 2]), config=cfg)
state = sm.init_state()
step = fnzero.train_step(lambda p, b: F.mse_loss(sm.apply(p, b[0]), b[1]), cfg)
for i in range(5):
    if i == 2 and dist.rank == 1:
        raise RuntimeError("injected failure on rank 1")
    state, m = step(state, (torch.randn(2, 4), torch.randn(2, 2)))
print("unreachable: rank", dist.rank, "finished")
