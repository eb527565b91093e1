"""Lamb with DeepSpeed FusedLamb semantics (csrc/lamb/fused_lamb_cuda_kernel.cu).

Unlike the paper's pseudo-code, FusedLamb keeps the moments uncorrected and folds both bias
corrections into the step size, and its trust ratio compares ||p|| with the *uncorrected*
update m/(sqrt(v)+eps) + wd*p. The ratio is per tensor, hence ``elementwise=False``.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch

from fnzero._errors import ConfigError

from . import _validate as check
from ._base import Optimizer, OptState, Params, advance, flat_args, groups, pure, zeros_count, zeros_like

__all__ = ["LambState", "lamb"]


class LambState(NamedTuple):
    """count: applied steps so far; exp_avg, exp_avg_sq: moments, trees like params."""

    count: torch.Tensor
    exp_avg: Params
    exp_avg_sq: Params


def lamb(
    lr: float = 1e-3,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    bias_correction: bool = True,
    max_coeff: float = 10.0,
    min_coeff: float = 0.01,
    max_grad_norm: float = 0.0,
    eps_inside_sqrt: bool = False,
    **ignored: Any,
) -> Optimizer:
    """Lamb as DeepSpeed's FusedLamb computes it; see specs/optim.md for the formulas.

    ``max_grad_norm > 0`` is refused, as DeepSpeed's engine refuses it: clip with the
    config's ``gradient_clipping`` instead.

    >>> import torch
    >>> opt = lamb(lr=0.1)
    >>> p, s = opt.update([torch.ones(4)], opt.init([torch.ones(4)]), [torch.ones(4)], None)
    >>> # u = m/(sqrt(v)+eps) = 0.1/sqrt(0.001); ratio ||p||/||u|| = 2/(2*sqrt(10));
    >>> # step 0.1*sqrt(1-0.999)/(1-0.9): p = 1 - step*ratio*u = 1 - 0.1/sqrt(10)
    >>> [round(x, 4) for x in p[0].tolist()]
    [0.9684, 0.9684, 0.9684, 0.9684]
    """
    name = "lamb"
    default_lr = check.number(name, "lr", lr)
    beta1, beta2 = check.betas(name, betas)
    eps = check.number(name, "eps", eps)
    weight_decay = check.number(name, "weight_decay", weight_decay)
    bias_correction = check.flag(name, "bias_correction", bias_correction)
    max_coeff = check.number(name, "max_coeff", max_coeff)
    min_coeff = check.number(name, "min_coeff", min_coeff, hi=max_coeff)
    max_grad_norm = check.number(name, "max_grad_norm", max_grad_norm)
    eps_inside_sqrt = check.flag(name, "eps_inside_sqrt", eps_inside_sqrt)
    check.extra_kwargs(name, ignored)
    if max_grad_norm > 0.0:
        raise ConfigError(
            f"lamb: max_grad_norm={max_grad_norm!r} is not supported as an optimizer parameter "
            "(DeepSpeed refuses it too); use the config's gradient_clipping"
        )

    def init(params: Params) -> LambState:
        return LambState(zeros_count(), zeros_like(params), zeros_like(params))

    @torch.no_grad()
    def update_(grads: Params, opt_state: OptState, params: Params, lr: float | None = None, *, momentum: float | None = None,
                **extras):
        step_lr = default_lr if lr is None else float(lr)
        b1 = beta1 if momentum is None else check.momentum_override(name, momentum)
        treedef, p, g, m, v = flat_args(grads, opt_state, params, "exp_avg", "exp_avg_sq")
        t = advance(opt_state.count)
        step_size = step_lr * math.sqrt(1.0 - beta2**t) / (1.0 - b1**t) if bias_correction else step_lr
        for gp, gg, gm, gv in groups(p, g, m, v):
            _foreach_step_(gp, gg, gm, gv, step_size, b1, beta2, eps, eps_inside_sqrt, weight_decay, min_coeff, max_coeff)
        return params, opt_state

    return Optimizer(init=init, update=pure(update_), update_=update_, elementwise=False)


def _foreach_step_(gp, gg, gm, gv, step_size: float, b1: float, beta2: float, eps: float, eps_inside_sqrt: bool,
                   weight_decay: float, min_coeff: float, max_coeff: float) -> None:
    """One group's step in place (`torch._foreach_*` over its tensors): the moments `gm`, `gv`, each
    tensor's trust ratio, and the parameters `gp`, as FusedLamb computes them."""
    torch._foreach_mul_(gm, b1)
    torch._foreach_add_(gm, gg, alpha=1.0 - b1)
    torch._foreach_mul_(gv, beta2)
    torch._foreach_addcmul_(gv, gg, gg, value=1.0 - beta2)
    if eps_inside_sqrt:
        denom = torch._foreach_add(gv, eps)
        torch._foreach_sqrt_(denom)
    else:
        denom = torch._foreach_sqrt(gv)
        torch._foreach_add_(denom, eps)
    upd = torch._foreach_div(gm, denom)
    if weight_decay != 0.0:
        torch._foreach_add_(upd, gp, alpha=weight_decay)
    # One host transfer for all the trust ratios of the group, not one per tensor.
    w = torch.stack(torch._foreach_norm(gp))
    u = torch.stack(torch._foreach_norm(upd))
    ok = (w != 0) & (u != 0)
    ratio = torch.where(ok, (w / torch.where(ok, u, 1.0)).clamp(min_coeff, max_coeff), 1.0)
    torch._foreach_mul_(upd, ratio.tolist())
    torch._foreach_add_(gp, upd, alpha=-step_size)
