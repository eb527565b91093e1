"""A ZeRO-3 training script whose rank 1 misbehaves inside step 3 (tests/test_launch_faults.py
launches it): `raise` raises RuntimeError in the loss function, `die` SIGKILLs itself, `hang`
sleeps there (a stuck data loader, a deadlock).
argv: MODE PG_TIMEOUT WATCHDOG, the timeouts in seconds or `default` (init_distributed's
timeout_s; no `watchdog` key in the config)."""

import os
import signal
import sys
import time

import torch
import torch.nn.functional as F

import fnzero
from fnzero.testing import MLP

mode, pg_timeout, watchdog = sys.argv[1], sys.argv[2], sys.argv[3]
dist = fnzero.init_distributed(**({} if pg_timeout == "default" else {"timeout_s": float(pg_timeout)}))
torch.manual_seed(0)
cfg = fnzero.load_config({"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW"},
                          "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
                          **({} if watchdog == "default" else {"watchdog": {"timeout_seconds": float(watchdog)}})},
                         world_size=dist.world_size)
sm = fnzero.shard(MLP([4, 8, 2]), config=cfg)
state = sm.init_state()
calls = [0]


def loss_fn(params, batch):
    calls[0] += 1
    if calls[0] == 3 and dist.rank == 1:
        if mode == "raise":
            raise RuntimeError("injected failure on rank 1")
        if mode == "hang":
            time.sleep(3600)
        os.kill(os.getpid(), signal.SIGKILL)
    return F.mse_loss(sm.apply(params, batch[0]), batch[1])


step = fnzero.train_step(loss_fn, cfg)
for i in range(5):
    try:
        state, m = step(state, (torch.randn(2, 4), torch.randn(2, 2)))
    except fnzero.DistributedError as e:
        print(f"rank {dist.rank} caught DistributedError: {e}", flush=True)
        raise
print("unreachable: rank", dist.rank, "finished")
