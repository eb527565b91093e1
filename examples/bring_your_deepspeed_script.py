"""Bring your DeepSpeed script: the same config file, the same loop, as a pure fnzero step.

Run (a few seconds on CPU; any stage's config works, e.g. examples/configs/zero3.json):

    python examples/bring_your_deepspeed_script.py --config examples/configs/zero2.json
    fnzero launch --nproc-per-node 2 examples/bring_your_deepspeed_script.py --config examples/configs/zero2.json

The DeepSpeed loop this replaces (deepspeed is not needed here, so it is shown, not run):

    import deepspeed, torch.nn.functional as F

    deepspeed.init_distributed()
    model = GPT(...)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                           config="examples/configs/zero2.json")
    for i, batch in enumerate(loader):
        logits = engine(batch["x"])                          # forward, on the engine's module
        loss = F.cross_entropy(logits.flatten(0, 1), batch["y"].flatten())
        engine.backward(loss)                                # backward + gradient reduction
        engine.step()                                        # optimizer, lr schedule, loss scale
        # loss, lr, grad norm: engine.get_lr(), engine.get_global_grad_norm();
        # printing every steps_per_print, csv/tensorboard/flops/wall-clock from the same config

    engine.save_checkpoint("ckpt")

The fnzero equivalent, line by line (what this file runs):

    fnzero.init_distributed()                                # deepspeed.init_distributed()
    cfg = fnzero.load_config("examples/configs/zero2.json")  # the same file, validated strictly
    sm = fnzero.shard(model, config=cfg)                     # deepspeed.initialize(...): the layout
    state = sm.init_state()                                  # ... and the state, as an explicit value
    step = fnzero.train_step(loss_fn, cfg)                   # forward + backward + step, pure
    with Monitor.from_config(cfg, rank=..., world_size=...) as mon:   # the config's logging sections
        for i, batch in enumerate(loader, 1):
            state, metrics = step(state, batch)              # loss, lr, grad_norm, loss_scale, skipped
            mon.log(i, metrics, state=state)                 # printing happens here, outside the step

Differences worth knowing: the step never mutates `state` (keep the old one to retry or compare);
the loss function receives the parameters (`sm.apply(params, x)`) instead of closing over a
module; a batch is one optimizer step's data for this rank, split into
`gradient_accumulation_steps` micro-batches by the step itself.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

import fnzero
from fnzero.monitor import Monitor
from fnzero.testing import GPT, token_batches

p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
p.add_argument("--config", default="examples/configs/zero2.json", help="a DeepSpeed JSON config (the same file)")
p.add_argument("--steps", type=int, default=30)
p.add_argument("--seq-len", type=int, default=32)
args = p.parse_args()

dist = fnzero.init_distributed()
torch.manual_seed(0)  # the same initial weights on every rank
cfg = fnzero.load_config(args.config, world_size=dist.world_size)
model = GPT(vocab_size=256, seq_len=args.seq_len, d_model=64, n_layer=2, n_head=4)
sm = fnzero.shard(model, config=cfg, device=dist.device)
state = sm.init_state()


def loss_fn(params, batch):
    # DeepSpeed: logits = engine(x). fnzero: the parameters are an argument, not the module's.
    logits = sm.apply(params, batch["x"])
    return F.cross_entropy(logits.flatten(0, 1).float(), batch["y"].flatten())


step = fnzero.train_step(loss_fn, cfg)  # engine.backward(loss); engine.step() -- as one pure function

per_rank = cfg.train_micro_batch_size_per_gpu * cfg.gradient_accumulation_steps
batches = token_batches(per_rank, args.seq_len, seed=dist.rank)
with Monitor.from_config(cfg, rank=dist.rank, world_size=dist.world_size, total_steps=args.steps,
                         tokens_per_step=per_rank * args.seq_len * dist.world_size) as mon:
    first = None
    for i in range(1, args.steps + 1):
        batch = {k: v.to(dist.device) for k, v in next(batches).items()}
        if mon.should_profile(i):  # flops_profiler.enabled in the config; every rank calls it
            micro = fnzero.split_micro_batches(batch, cfg.gradient_accumulation_steps)[0]
            mon.profile_flops(loss_fn, state.params, micro)
        state, metrics = step(state, batch)
        mon.log(i, metrics, state=state)
        first = metrics["loss"] if first is None else first

if dist.rank == 0:
    print(f"done: {args.steps} steps at ZeRO stage {cfg.zero_stage}, loss {first:.3f} -> {metrics['loss']:.3f}")
