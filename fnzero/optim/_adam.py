"""Adam and AdamW (DeepSpeed FusedAdam / torch.optim.Adam(W) arithmetic).

The in-place step uses torch's fused multi-tensor kernel when it applies, which is the fast
path on every device torch ships it for, and a `torch._foreach_*` sequence otherwise; both
compute the torch.optim formulas (see specs/optim.md).
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import optree
import torch

from . import _validate as check
from ._base import (
    Optimizer, OptState, Params, advance, flat_args, groups, pure, scalars_as, traced_count, zeros_count, zeros_like,
)

__all__ = ["AdamState", "adam", "adamw"]

_FUSED_DTYPES = (torch.float32, torch.float64)


class AdamState(NamedTuple):
    """count: applied steps so far (0-dim int64); exp_avg, exp_avg_sq: first and second
    moments, trees shaped and typed like params."""

    count: torch.Tensor
    exp_avg: Params
    exp_avg_sq: Params


def adam(
    lr: float = 1e-3,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    adam_w_mode: bool = True,
    bias_correction: bool = True,
    *,
    _allow_fused: bool = True,
    **ignored: Any,
) -> Optimizer:
    """Adam; with ``adam_w_mode=True`` (DeepSpeed's default) weight decay is decoupled (AdamW).

    ``adam_w_mode=False`` is torch.optim.Adam's L2 penalty (``g += weight_decay * p``).
    ``_allow_fused=False`` forces the `_foreach` path (for tests and comparisons).

    >>> import torch
    >>> opt = adam(lr=0.1)
    >>> params = {"w": torch.ones(3)}
    >>> state = opt.init(params)
    >>> params, state = opt.update({"w": torch.ones(3)}, state, params, None)
    >>> [round(x, 4) for x in params["w"].tolist()]
    [0.9, 0.9, 0.9]
    """
    return _make("adam", lr, betas, eps, weight_decay, adam_w_mode, bias_correction, _allow_fused, ignored)


def adamw(
    lr: float = 1e-3,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    adam_w_mode: bool = True,
    bias_correction: bool = True,
    *,
    _allow_fused: bool = True,
    **ignored: Any,
) -> Optimizer:
    """AdamW: `adam` with decoupled weight decay, ``p *= 1 - lr * weight_decay``.

    ``adam_w_mode`` is accepted for DeepSpeed configs and has no effect: DeepSpeed's AdamW type
    is decoupled whatever it says.

    >>> import torch
    >>> opt = adamw(lr=0.1, weight_decay=0.5)
    >>> p, s = opt.update([torch.zeros(1)], opt.init([torch.ones(1)]), [torch.ones(1)], None)
    >>> round(p[0].item(), 4)
    0.95
    """
    check.flag("adamw", "adam_w_mode", adam_w_mode)
    return _make("adamw", lr, betas, eps, weight_decay, True, bias_correction, _allow_fused, ignored)


def _make(name, lr, betas, eps, weight_decay, adam_w_mode, bias_correction, allow_fused, ignored) -> Optimizer:
    # Long: the three update forms (in place, fused, traced) are closures over one set of checked hyper-
    # parameters.
    default_lr = check.number(name, "lr", lr)
    beta1, beta2 = check.betas(name, betas)
    eps = check.number(name, "eps", eps)
    weight_decay = check.number(name, "weight_decay", weight_decay)
    adam_w_mode = check.flag(name, "adam_w_mode", adam_w_mode)
    bias_correction = check.flag(name, "bias_correction", bias_correction)
    check.extra_kwargs(name, ignored)

    def init(params: Params) -> AdamState:
        return AdamState(zeros_count(), zeros_like(params), zeros_like(params))

    @torch.no_grad()
    def update_(grads: Params, opt_state: OptState, params: Params, lr: float | None = None, *, momentum: float | None = None,
                **extras):
        step_lr = default_lr if lr is None else float(lr)
        b1 = beta1 if momentum is None else check.momentum_override(name, momentum)
        treedef, p, g, m, v = flat_args(grads, opt_state, params, "exp_avg", "exp_avg_sq")
        t = advance(opt_state.count)
        for gp, gg, gm, gv in groups(p, g, m, v):
            if allow_fused and bias_correction and _fusable(gp, gg, gm, gv):
                _fused_step_(gp, gg, gm, gv, opt_state.count, t, step_lr, b1, beta2, eps, weight_decay, adam_w_mode)
            else:
                _foreach_step_(gp, gg, gm, gv, t, step_lr, b1, beta2, eps, weight_decay, adam_w_mode, bias_correction)
        return params, opt_state

    def graph_update(grads: Params, opt_state: OptState, params: Params, lr: torch.Tensor | None = None, *,
                     momentum: torch.Tensor | None = None, **extras):
        lr = default_lr if lr is None else lr
        b1 = beta1 if momentum is None else momentum
        treedef, p, g, m, v = flat_args(grads, opt_state, params, "exp_avg", "exp_avg_sq", cast=False)
        count, t = traced_count(opt_state.count, p)
        if bias_correction:
            step_size = lr / (1.0 - b1**t)
            bc2_sqrt = (1.0 - beta2**t).sqrt()
        else:
            step_size, bc2_sqrt = lr, None
        new_p, new_m, new_v = [], [], []
        for pp, gg, mm, vv in zip(p, g, m, v):
            gg = gg.to(pp.dtype)
            lr_, b1_, ss, bc2 = scalars_as(pp, lr, b1, step_size, bc2_sqrt)
            if weight_decay != 0.0:
                if adam_w_mode:
                    pp = pp * (1.0 - lr_ * weight_decay)
                else:
                    gg = gg + weight_decay * pp
            mm = mm + (gg - mm) * (1.0 - b1_)
            vv = vv * beta2 + gg * gg * (1.0 - beta2)
            denom = vv.sqrt() if bc2 is None else vv.sqrt() / bc2
            new_p.append(pp - ss * mm / (denom + eps))
            new_m.append(mm)
            new_v.append(vv)
        unflat = lambda xs: optree.tree_unflatten(treedef, xs)  # noqa: E731
        return unflat(new_p), AdamState(count, unflat(new_m), unflat(new_v))

    return Optimizer(init=init, update=pure(update_), update_=update_, elementwise=True, graph_update=graph_update)


def _fusable(*lists: list[torch.Tensor]) -> bool:
    # The fused kernel is only trusted on dense float32/float64 buffers; anything else (views
    # with gaps, half precision, complex) takes the foreach path, which handles all of them.
    if lists[0][0].dtype not in _FUSED_DTYPES:
        return False
    return all(t.is_contiguous() for lst in lists for t in lst)


def _fused_step_(p, g, m, v, count, t, lr, b1, b2, eps, wd, adam_w_mode) -> None:
    # The kernel reads one step tensor per parameter and does not advance it itself. On CPU the
    # int64 counter is read directly; elsewhere it wants a tensor on the params' device.
    dev = p[0].device
    step = count if dev.type == "cpu" else torch.full((), float(t), dtype=torch.float32, device=dev)
    kernel = torch._fused_adamw_ if adam_w_mode else torch._fused_adam_
    kernel(
        p, g, m, v, [], [step] * len(p),
        lr=lr, beta1=b1, beta2=b2, weight_decay=wd, eps=eps, amsgrad=False, maximize=False,
    )


def _foreach_step_(p, g, m, v, t, lr, b1, b2, eps, wd, adam_w_mode, bias_correction) -> None:
    if wd != 0.0:
        if adam_w_mode:
            torch._foreach_mul_(p, 1.0 - lr * wd)
        else:
            g = torch._foreach_add(g, p, alpha=wd)  # a new list: the caller's grads stay intact
    torch._foreach_lerp_(m, g, 1.0 - b1)
    torch._foreach_mul_(v, b2)
    torch._foreach_addcmul_(v, g, g, value=1.0 - b2)
    denom = torch._foreach_sqrt(v)
    if bias_correction:
        # Fold the corrections into two scalars, as torch does: m_hat/(sqrt(v_hat)+eps) ==
        # (m/bc1) / (sqrt(v)/sqrt(bc2) + eps).
        step_size = lr / (1.0 - b1**t)
        torch._foreach_div_(denom, math.sqrt(1.0 - b2**t))
    else:
        step_size = lr
    torch._foreach_add_(denom, eps)
    torch._foreach_addcdiv_(p, m, denom, value=-step_size)
