"""SGD with momentum, dampening, Nesterov and L2 weight decay (torch.optim.SGD arithmetic)."""

from __future__ import annotations

from typing import Any, NamedTuple

import optree
import torch

from fnzero._errors import ConfigError

from . import _validate as check
from ._base import (
    Optimizer, OptState, Params, advance, flat_args, groups, pure, scalars_as, traced_count, zeros_count, zeros_like,
)

__all__ = ["SGDState", "sgd"]


class SGDState(NamedTuple):
    """count: applied steps so far; momentum_buffer: a tree like params, or None when the
    optimizer was built with momentum=0 (plain SGD keeps no per-parameter state)."""

    count: torch.Tensor
    momentum_buffer: Params | None


def sgd(
    lr: float = 1e-3,
    momentum: float = 0.0,
    dampening: float = 0.0,
    weight_decay: float = 0.0,
    nesterov: bool = False,
    **ignored: Any,
) -> Optimizer:
    """Stochastic gradient descent, as torch.optim.SGD.

    >>> import torch
    >>> opt = sgd(lr=0.5, momentum=0.9)
    >>> params = (torch.tensor([1.0]),)
    >>> state = opt.init(params)
    >>> params, state = opt.update((torch.tensor([1.0]),), state, params, None)
    >>> params, state = opt.update((torch.tensor([1.0]),), state, params, None)
    >>> round(params[0].item(), 6)  # 1 - 0.5*1 - 0.5*(0.9*1 + 1)
    -0.45
    """
    name = "sgd"
    default_lr = check.number(name, "lr", lr)
    default_mom = check.number(name, "momentum", momentum)
    dampening = check.number(name, "dampening", dampening, hi=1.0)
    weight_decay = check.number(name, "weight_decay", weight_decay)
    nesterov = check.flag(name, "nesterov", nesterov)
    check.extra_kwargs(name, ignored)
    if nesterov and (default_mom == 0.0 or dampening != 0.0):
        raise ConfigError(
            f"sgd: nesterov=True needs momentum > 0 and dampening=0, got momentum={momentum!r}, dampening={dampening!r}"
        )
    has_buffer = default_mom != 0.0
    fields = ("momentum_buffer",) if has_buffer else ()

    def init(params: Params) -> SGDState:
        return SGDState(zeros_count(), zeros_like(params) if has_buffer else None)

    @torch.no_grad()
    def update_(grads: Params, opt_state: OptState, params: Params, lr: float | None = None, *, momentum: float | None = None,
                **extras):
        step_lr = default_lr if lr is None else float(lr)
        mom = default_mom if momentum is None else check.momentum_override(name, momentum, hi_open=False)
        if mom != 0.0 and not has_buffer:
            raise ValueError("sgd: a momentum override needs an optimizer built with momentum > 0 (its state has no buffer)")
        treedef, p, g, *buf = flat_args(grads, opt_state, params, *fields)
        buf = buf[0] if has_buffer else g
        t = advance(opt_state.count)
        for gp, gg, gb in groups(p, g, buf):
            _foreach_step_(gp, gg, gb, t, step_lr, mom, dampening, weight_decay, nesterov)
        return params, opt_state

    def graph_update(grads: Params, opt_state: OptState, params: Params, lr: torch.Tensor | None = None, *,
                     momentum: torch.Tensor | None = None, **extras):
        if momentum is not None and not has_buffer:
            raise ValueError("sgd: a momentum override needs an optimizer built with momentum > 0 (its state has no buffer)")
        lr = default_lr if lr is None else lr
        mom = default_mom if momentum is None else momentum
        treedef, p, g, *buf = flat_args(grads, opt_state, params, *fields, cast=False)
        buf = buf[0] if has_buffer else g
        count, t = traced_count(opt_state.count, p)
        new_p, new_buf = [], []
        for pp, gg, bb in zip(p, g, buf):
            pp, bb = _traced_step(pp, gg, bb, t, lr, mom, dampening, weight_decay, nesterov, has_buffer)
            new_p.append(pp)
            if has_buffer:
                new_buf.append(bb)
        state_buf = optree.tree_unflatten(treedef, new_buf) if has_buffer else None
        return optree.tree_unflatten(treedef, new_p), SGDState(count, state_buf)

    return Optimizer(init=init, update=pure(update_), update_=update_, elementwise=True, graph_update=graph_update)


def _foreach_step_(gp, gg, gb, t: int, lr: float, mom: float, dampening: float, weight_decay: float,
                   nesterov: bool) -> None:
    """One group's step in place (`torch._foreach_*` over its tensors): the parameters `gp` and,
    with momentum, their buffers `gb`, as torch.optim.SGD computes them."""
    if weight_decay != 0.0:
        gg = torch._foreach_add(gg, gp, alpha=weight_decay)
    if mom != 0.0:
        if t == 1:
            # torch starts the buffer at the first gradient itself (no dampening).
            torch._foreach_copy_(gb, gg)
        else:
            torch._foreach_mul_(gb, mom)
            torch._foreach_add_(gb, gg, alpha=1.0 - dampening)
        gg = torch._foreach_add(gg, gb, alpha=mom) if nesterov else gb
    torch._foreach_add_(gp, gg, alpha=-lr)


def _traced_step(pp, gg, bb, t, lr, mom, dampening: float, weight_decay: float, nesterov: bool, has_buffer: bool):
    """One parameter's step in plain tensor ops (`lr`, `mom` and the count `t` may be 0-dim
    tensors): (the new parameter, its new momentum buffer, or `bb` itself without momentum)."""
    gg = gg.to(pp.dtype)
    if weight_decay != 0.0:
        gg = gg + weight_decay * pp
    lr_, mom_ = scalars_as(pp, lr, mom)
    if has_buffer:
        # torch starts the buffer at the first gradient itself (no dampening).
        bb = torch.where(t == 1.0, gg, bb * mom_ + gg * (1.0 - dampening))
        gg = gg + bb * mom_ if nesterov else bb
    return pp - lr_ * gg, bb
