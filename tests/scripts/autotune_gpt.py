"""A DeepSpeed-style training script for the autotuner's tests: a tiny GPT, its config from
`--deepspeed_config`, its steps logged through fnzero.monitor.Monitor (which reports an autotuner
trial's profile steps and ends it)."""

import argparse

import torch
import torch.nn.functional as F

import fnzero
from fnzero.monitor import Monitor
from fnzero.testing import GPT, token_batches

p = argparse.ArgumentParser()
p.add_argument("--deepspeed_config", required=True)
p.add_argument("--steps", type=int, default=20)
p.add_argument("--seq-len", type=int, default=16)
p.add_argument("--d-model", type=int, default=32)
args = p.parse_args()

dist = fnzero.init_distributed()
torch.manual_seed(0)
cfg = fnzero.load_config(args.deepspeed_config, world_size=dist.world_size)
sm = fnzero.shard(GPT(vocab_size=64, seq_len=args.seq_len, d_model=args.d_model, n_layer=2, n_head=2), config=cfg,
                  device=dist.device)
state = sm.init_state()
step = fnzero.train_step(lambda params, b: F.cross_entropy(sm.apply(params, b["x"]).flatten(0, 1), b["y"].flatten()),
                         cfg, donate=True)
per_rank = cfg.train_micro_batch_size_per_gpu * cfg.gradient_accumulation_steps
batches = token_batches(per_rank, args.seq_len, seed=dist.rank)
with Monitor.from_config(cfg, rank=dist.rank, world_size=dist.world_size,
                         tokens_per_step=per_rank * args.seq_len * dist.world_size, total_steps=args.steps) as mon:
    for i in range(1, args.steps + 1):
        b = next(batches)
        b = {"x": b["x"] % 64, "y": b["y"] % 64}
        state, m = step(state, b)
        mon.log(i, m, state=state)
if dist.rank == 0:
    print(f"trained {args.steps} steps, loss {m['loss']:.3f}")
