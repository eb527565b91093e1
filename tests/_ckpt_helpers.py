"""Shared helpers of the checkpoint tests: train from any state, consolidate states across ranks."""

from __future__ import annotations

import torch

import fnzero
from _worlds import config, global_batch, loss_of, make_model

GLOBAL_ROWS = 12  # world * micro: the same global batch at world sizes 1, 2, 3, 4


def setup(kind, stage, comm, precision="fp32", dtype=torch.float64, optimizer=None):
    world = comm.world_size
    extra = {"optimizer": optimizer} if optimizer else None
    cfg = config(stage, 1, GLOBAL_ROWS // world, world, 1.0, precision, extra)
    model = make_model(kind, dtype)
    if precision != "fp32":
        model = model.float()
    sm = fnzero.shard(model, config=cfg, comm=comm)
    state = sm.init_state()

    def loss_fn(params, batch):
        x, y = batch
        return loss_of(kind, sm.apply(params, x), y)

    return cfg, sm, state, fnzero.train_step(loss_fn, cfg)


def run_steps(kind, step, state, comm, start, n, dtype=torch.float64):
    world, rank = comm.world_size, comm.rank
    losses = []
    for s in range(start, start + n):
        x, y = global_batch(kind, s, world, 1, GLOBAL_ROWS // world, dtype)
        state, m = step(state, (x[:, rank].flatten(0, 1), y[:, rank].flatten(0, 1)))
        losses.append(m["loss"])
    return state, losses


def full_buffers(states, field):
    """unit name -> real elements of the consolidated per-unit tensor `field` ('params', 'master',
    'exp_avg', 'exp_avg_sq') from every rank's state (rank order). Independent of the checkpoint code."""
    plan = states[0].sharding.plan
    out = {}
    for u in plan.units:
        if field in ("params", "master"):
            parts = [getattr(s, field)[u.name] for s in states]
        else:
            parts = [getattr(s.opt_state, field)[u.name] for s in states]
        if parts[0].numel() == u.padded_numel:
            full = parts[0]
        else:
            full = torch.cat(parts)
        out[u.name] = full[: u.numel].detach().clone()
    return out
