"""1-bit Adam (DeepSpeed's `OnebitAdam`, `deepspeed/runtime/fp16/onebit/adam.py` before 0.19.8
removed it); the algorithm: `specs/optim.md` §1-bit optimizers."""

from __future__ import annotations

from typing import Any, NamedTuple

import optree
import torch

from ._base import Optimizer, OptState, Params, pure, state_leaves, zeros_count
from ._onebit_common import (
    compressed_from, empty_error, exchange, exchange_from, first_compressed_count, hyper, no_effect_kwargs,
    step_start, steps,
)

__all__ = ["OneBitAdamState", "onebit_adam"]


class OneBitAdamState(NamedTuple):
    """count: applied steps; exp_avg, exp_avg_sq: the moments (trees like params); worker_error,
    server_error: the compression errors per parameter (flat; 0 elements until the first
    compressed step sizes them for its world)."""

    # Each rank's own (a checkpoint stores one per rank: fnzero/checkpoint/_tree.py)
    PER_RANK_FIELDS = ("worker_error", "server_error")

    count: torch.Tensor
    exp_avg: Params
    exp_avg_sq: Params
    worker_error: Params
    server_error: Params


def onebit_adam(lr: float = 1e-3, freeze_step: int = 100000, betas: tuple[float, float] = (0.9, 0.999),
                eps: float = 1e-8, weight_decay: float = 0.0, **deepspeed_keys: Any) -> Optimizer:
    """1-bit Adam; `deepspeed_keys` takes DeepSpeed's keys that change nothing here
    (bias_correction, eps_inside_sqrt, max_grad_norm, cuda_aware, comm_backend_name, amsgrad=False).

    >>> import torch
    >>> opt = onebit_adam(lr=0.1, freeze_step=10)
    >>> p = [torch.ones(2)]
    >>> s = opt.init(p)
    >>> p, s = opt.update([torch.ones(2)], s, p)  # step 1: DeepSpeed's initialisation step
    >>> p, s = opt.update([torch.ones(2)], s, p)  # m = 0.1, v = 0.001: p -= 0.1 * 0.1 / sqrt(0.001)
    >>> [round(x, 4) for x in p[0].tolist()], opt.local_gradients(s)
    ([0.6838, 0.6838], False)
    """
    name = "onebit_adam"
    default_lr, beta1, beta2, eps, weight_decay = hyper(name, lr, betas, eps, weight_decay)
    freeze_step = steps(name, "freeze_step", freeze_step)
    no_effect_kwargs(name, deepspeed_keys)
    local_gradients = compressed_from(first_compressed_count(freeze_step))

    def init(params: Params) -> OneBitAdamState:
        with torch.no_grad():
            return OneBitAdamState(zeros_count(), optree.tree_map(torch.zeros_like, params),
                                   optree.tree_map(torch.zeros_like, params), optree.tree_map(empty_error, params),
                                   optree.tree_map(empty_error, params))

    @torch.no_grad()
    def update_(grads: Params, opt_state: OptState, params: Params, lr: float | None = None, *,
                momentum: float | None = None, **extras):
        compressed = local_gradients(opt_state)
        s = step_start(name, grads, opt_state, params, lr, momentum, default_lr, beta1)
        if s is None:
            return params, opt_state
        step_lr, b1, p, g, treedef = s.lr, s.b1, s.p, s.g, s.treedef
        m, v, we, se = state_leaves(opt_state, treedef, "exp_avg", "exp_avg_sq", "worker_error", "server_error")
        for mi, gi in zip(m, g):
            mi.mul_(b1).add_(gi, alpha=1 - b1)
        if compressed:
            averaged, we, se = exchange(exchange_from(name, extras), m, we, se)
            for mi, ai in zip(m, averaged):
                mi.copy_(ai)
        else:
            for vi, gi in zip(v, g):
                vi.mul_(beta2).addcmul_(gi, gi, value=1 - beta2)
        for pi, mi, vi in zip(p, m, v):
            upd = mi / (vi.sqrt() + eps)
            if weight_decay > 0.0:
                upd += weight_decay * pi
            pi.add_(-step_lr * upd)
        state = opt_state._replace(worker_error=optree.tree_unflatten(treedef, we),
                                   server_error=optree.tree_unflatten(treedef, se))
        return params, state

    return Optimizer(init=init, update=pure(update_), update_=update_, elementwise=False,
                     local_gradients=local_gradients)
