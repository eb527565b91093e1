"""Trains a few ZeRO-3 steps on every rank of a multi-host job (the hostfile tests launch it) and
prints what each rank saw. argv: STEPS CHECKPOINT_ROOT [forever] [bytes=PATH]: with `bytes=`, the
ranks first measure the bytes crossing between the hosts (cross_host_bytes.py) into PATH. Each host
saves under its own ROOT/node<i> (a node-local disk): a plain save is refused, a node-local one commits and loads
back; with `forever` the ranks then go on training until the job is ended from outside."""

import os
import sys
import time

import torch
import torch.nn.functional as F

import fnzero
from fnzero.testing import MLP

steps, root, forever = int(sys.argv[1]), sys.argv[2], "forever" in sys.argv[3:]
dist = fnzero.init_distributed(timeout_s=60, watchdog_s=15)
for arg in sys.argv[3:]:
    if arg.startswith("bytes="):
        import cross_host_bytes  # beside this script

        cross_host_bytes.measure(arg.removeprefix("bytes="))
cfg = fnzero.load_config({"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW"},
                          "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}})
torch.manual_seed(0)
sm = fnzero.shard(MLP([4, 8, 2]), config=cfg)
state = sm.init_state()
step = fnzero.train_step(lambda p, b: F.mse_loss(sm.apply(p, b[0]), b[1]), cfg)
g = torch.Generator().manual_seed(dist.rank)
for i in range(steps):
    state, m = step(state, (torch.randn(2, 4, generator=g), torch.randn(2, 2, generator=g)))
ckpt = os.path.join(root, f"node{os.environ['GROUP_RANK']}")
try:
    fnzero.checkpoint.save(ckpt, state, tag="plain")
except fnzero.CheckpointError as e:
    print(f"REFUSED rank={dist.rank}: {e}", flush=True)
fnzero.checkpoint.save(ckpt, state, tag="local", node_local=True)
back, _ = fnzero.checkpoint.load(ckpt, state)
same = all(torch.equal(a, b) for a, b in zip(back.params.values(), state.params.values()))
print(f"NODE-LOCAL rank={dist.rank} loaded back equal={same}", flush=True)
print(f"RESULT rank={dist.rank} world={dist.world_size} node={os.environ.get('GROUP_RANK')} "
      f"var={os.environ.get('FNZ_HOSTFILE_TEST')} loss={m['loss']:.10f}", flush=True)
while forever:
    state, m = step(state, (torch.randn(2, 4, generator=g), torch.randn(2, 2, generator=g)))
    time.sleep(0.2)
