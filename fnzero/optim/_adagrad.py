"""Adagrad (torch.optim.Adagrad arithmetic: lr_decay, initial accumulator, eps outside the sqrt)."""

from __future__ import annotations

from typing import Any, NamedTuple

import optree
import torch

from . import _validate as check
from ._base import (
    Optimizer, OptState, Params, advance, flat_args, groups, pure, scalars_as, traced_count, zeros_count,
)

__all__ = ["AdagradState", "adagrad"]


class AdagradState(NamedTuple):
    """count: applied steps so far; sum: running sum of squared gradients, a tree like params."""

    count: torch.Tensor
    sum: Params


def adagrad(
    lr: float = 1e-2,
    eps: float = 1e-10,
    weight_decay: float = 0.0,
    lr_decay: float = 0.0,
    initial_accumulator_value: float = 0.0,
    **ignored: Any,
) -> Optimizer:
    """Adagrad, as torch.optim.Adagrad. It has no momentum, so a momentum override is an error.

    >>> import torch
    >>> opt = adagrad(lr=1.0)
    >>> p, s = opt.update([torch.tensor([2.0])], opt.init([torch.zeros(1)]), [torch.zeros(1)], None)
    >>> p[0].item()  # 0 - 1 * 2 / sqrt(4)
    -1.0
    """
    name = "adagrad"
    default_lr = check.number(name, "lr", lr)
    eps = check.number(name, "eps", eps)
    weight_decay = check.number(name, "weight_decay", weight_decay)
    lr_decay = check.number(name, "lr_decay", lr_decay)
    init_acc = check.number(name, "initial_accumulator_value", initial_accumulator_value)
    check.extra_kwargs(name, ignored)

    def init(params: Params) -> AdagradState:
        with torch.no_grad():
            return AdagradState(zeros_count(), optree.tree_map(lambda p: torch.full_like(p, init_acc), params))

    @torch.no_grad()
    def update_(grads: Params, opt_state: OptState, params: Params, lr: float | None = None, *, momentum: float | None = None,
                **extras):
        if momentum is not None:
            raise ValueError("adagrad: has no momentum to override (DeepSpeed also disables cycle_momentum for it)")
        step_lr = default_lr if lr is None else float(lr)
        treedef, p, g, acc = flat_args(grads, opt_state, params, "sum")
        t = advance(opt_state.count)
        clr = step_lr / (1.0 + (t - 1) * lr_decay)
        for gp, gg, ga in groups(p, g, acc):
            if weight_decay != 0.0:
                gg = torch._foreach_add(gg, gp, alpha=weight_decay)
            torch._foreach_addcmul_(ga, gg, gg, value=1.0)
            std = torch._foreach_sqrt(ga)
            torch._foreach_add_(std, eps)
            torch._foreach_addcdiv_(gp, gg, std, value=-clr)
        return params, opt_state

    def graph_update(grads: Params, opt_state: OptState, params: Params, lr: torch.Tensor | None = None, *,
                     momentum: torch.Tensor | None = None, **extras):
        if momentum is not None:
            raise ValueError("adagrad: has no momentum to override (DeepSpeed also disables cycle_momentum for it)")
        lr = default_lr if lr is None else lr
        treedef, p, g, acc = flat_args(grads, opt_state, params, "sum", cast=False)
        count, t = traced_count(opt_state.count, p)
        clr = lr / (1.0 + (t - 1.0) * lr_decay)
        new_p, new_acc = [], []
        for pp, gg, aa in zip(p, g, acc):
            gg = gg.to(pp.dtype)
            if weight_decay != 0.0:
                gg = gg + weight_decay * pp
            aa = aa + gg * gg
            (clr_,) = scalars_as(pp, clr)
            new_p.append(pp - clr_ * gg / (aa.sqrt() + eps))
            new_acc.append(aa)
        return optree.tree_unflatten(treedef, new_p), AdagradState(count, optree.tree_unflatten(treedef, new_acc))

    return Optimizer(init=init, update=pure(update_), update_=update_, elementwise=True, graph_update=graph_update)
