"""Lion (Chen et al. 2023; DeepSpeed FusedLion arithmetic): a sign update of an interpolated
momentum, with decoupled weight decay."""

from __future__ import annotations

from typing import Any, NamedTuple

import optree
import torch

from . import _validate as check
from ._base import (
    Optimizer, OptState, Params, advance, flat_args, groups, pure, scalars_as, traced_count, zeros_count, zeros_like,
)

__all__ = ["LionState", "lion"]


class LionState(NamedTuple):
    """count: applied steps so far (Lion itself needs none; kept for a uniform state layout);
    exp_avg: the momentum, a tree like params."""

    count: torch.Tensor
    exp_avg: Params


def lion(lr: float = 1e-4, betas: tuple[float, float] = (0.9, 0.99), weight_decay: float = 0.0, **ignored: Any) -> Optimizer:
    """Lion: ``p -= lr * (sign(b1*m + (1-b1)*g) + weight_decay*p)``, then ``m = b2*m + (1-b2)*g``.

    >>> import torch
    >>> opt = lion(lr=0.1)
    >>> p, s = opt.update([torch.tensor([3.0, -2.0])], opt.init([torch.zeros(2)]), [torch.zeros(2)], None)
    >>> [round(x, 6) for x in p[0].tolist()]
    [-0.1, 0.1]
    """
    name = "lion"
    default_lr = check.number(name, "lr", lr)
    beta1, beta2 = check.betas(name, betas)
    weight_decay = check.number(name, "weight_decay", weight_decay)
    check.extra_kwargs(name, ignored)

    def init(params: Params) -> LionState:
        return LionState(zeros_count(), zeros_like(params))

    @torch.no_grad()
    def update_(grads: Params, opt_state: OptState, params: Params, lr: float | None = None, *, momentum: float | None = None,
                **extras):
        step_lr = default_lr if lr is None else float(lr)
        b1 = beta1 if momentum is None else check.momentum_override(name, momentum)
        treedef, p, g, m = flat_args(grads, opt_state, params, "exp_avg")
        advance(opt_state.count)
        for gp, gg, gm in groups(p, g, m):
            # The same operation order as the reference (mul then add), so the sign of a value
            # near zero is decided identically.
            c = torch._foreach_mul(gm, b1)
            torch._foreach_add_(c, gg, alpha=1.0 - b1)
            torch._foreach_sign_(c)
            if weight_decay != 0.0:
                torch._foreach_mul_(gp, 1.0 - step_lr * weight_decay)
            torch._foreach_add_(gp, c, alpha=-step_lr)
            torch._foreach_mul_(gm, beta2)
            torch._foreach_add_(gm, gg, alpha=1.0 - beta2)
        return params, opt_state

    def graph_update(grads: Params, opt_state: OptState, params: Params, lr: torch.Tensor | None = None, *,
                     momentum: torch.Tensor | None = None, **extras):
        lr = default_lr if lr is None else lr
        b1 = beta1 if momentum is None else momentum
        treedef, p, g, m = flat_args(grads, opt_state, params, "exp_avg", cast=False)
        count, _ = traced_count(opt_state.count, p)
        new_p, new_m = [], []
        for pp, gg, mm in zip(p, g, m):
            gg = gg.to(pp.dtype)
            lr_, b1_ = scalars_as(pp, lr, b1)
            c = (mm * b1_ + gg * (1.0 - b1_)).sign()
            if weight_decay != 0.0:
                pp = pp * (1.0 - lr_ * weight_decay)
            new_p.append(pp - lr_ * c)
            new_m.append(mm * beta2 + gg * (1.0 - beta2))
        return optree.tree_unflatten(treedef, new_p), LionState(count, optree.tree_unflatten(treedef, new_m))

    return Optimizer(init=init, update=pure(update_), update_=update_, elementwise=True, graph_update=graph_update)
