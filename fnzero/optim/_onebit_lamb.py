"""1-bit LAMB (DeepSpeed's `OnebitLamb`, `deepspeed/runtime/fp16/onebit/lamb.py` before 0.19.8
removed it); the algorithm: `specs/optim.md` §1-bit optimizers."""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import optree
import torch

from . import _validate as check
from ._base import Optimizer, OptState, Params, pure, state_leaves, zeros_count
from ._onebit_common import (
    compressed_from, exchange_from, first_compressed_count, hyper, no_effect_kwargs, step_start, steps,
)

__all__ = ["OneBitLambState", "onebit_lamb"]


class OneBitLambState(NamedTuple):
    """count: applied steps; exp_avg, exp_avg_sq, exp_avg_sq_fresh: trees like params;
    lamb_coeff_freeze, last_factor, scaling_coeff: trees of 0-dim float64 per parameter;
    worker_error, server_error, tail: the flat buffer's errors and padding (0 elements until the
    first compressed step)."""

    # Each rank's own (a checkpoint stores one per rank: fnzero/checkpoint/_tree.py)
    PER_RANK_FIELDS = ("worker_error", "server_error", "tail")

    count: torch.Tensor
    exp_avg: Params
    exp_avg_sq: Params
    exp_avg_sq_fresh: Params
    lamb_coeff_freeze: Params
    last_factor: Params
    scaling_coeff: Params
    worker_error: torch.Tensor
    server_error: torch.Tensor
    tail: torch.Tensor


def _scalar(v: float) -> torch.Tensor:
    return torch.tensor(v, dtype=torch.float64)


class _Hyper(NamedTuple):
    beta2: float
    eps: float
    weight_decay: float
    max_coeff: float
    min_coeff: float
    coeff_beta: float
    factor_max: float
    factor_min: float
    factor_threshold: float


def onebit_lamb(lr: float = 1e-3, freeze_step: int = 100000, betas: tuple[float, float] = (0.9, 0.999),
                eps: float = 1e-8, weight_decay: float = 0.0, max_coeff: float = 10.0, min_coeff: float = 0.01,
                coeff_beta: float = 0.9, factor_max: float = 4.0, factor_min: float = 0.5,
                factor_threshold: float = 0.1, **deepspeed_keys: Any) -> Optimizer:
    """1-bit LAMB; `deepspeed_keys` takes DeepSpeed's keys that change nothing here (bias_correction,
    eps_inside_sqrt, max_grad_norm, cuda_aware, comm_backend_name, amsgrad=False)."""
    name = "onebit_lamb"
    default_lr, beta1, beta2, eps, weight_decay = hyper(name, lr, betas, eps, weight_decay)
    freeze_step = steps(name, "freeze_step", freeze_step)
    max_coeff = check.number(name, "max_coeff", max_coeff)
    h = _Hyper(beta2, eps, weight_decay, max_coeff, check.number(name, "min_coeff", min_coeff, hi=max_coeff),
               check.number(name, "coeff_beta", coeff_beta, hi=1.0),
               (fmax := check.number(name, "factor_max", factor_max)),
               check.number(name, "factor_min", factor_min, hi=fmax),
               check.number(name, "factor_threshold", factor_threshold))
    no_effect_kwargs(name, deepspeed_keys)
    first = first_compressed_count(freeze_step)
    local_gradients = compressed_from(first)

    def init(params: Params) -> OneBitLambState:
        with torch.no_grad():
            zeros = lambda: optree.tree_map(torch.zeros_like, params)  # noqa: E731
            per = lambda v: optree.tree_map(lambda _: _scalar(v), params)  # noqa: E731
            leaves = optree.tree_leaves(params)
            empty = (leaves[0] if leaves else torch.zeros(0)).new_zeros(0)
            return OneBitLambState(zeros_count(), zeros(), zeros(), zeros(), per(0.0), per(1.0), per(0.0),
                                   empty, empty.clone(), empty.clone())

    @torch.no_grad()
    def update_(grads: Params, opt_state: OptState, params: Params, lr: float | None = None, *,
                momentum: float | None = None, **extras):
        count = int(opt_state.count)
        s = step_start(name, grads, opt_state, params, lr, momentum, default_lr, beta1)
        if s is None:
            return params, opt_state
        t, step_lr, b1, p, g, treedef = s.t, s.lr, s.b1, s.p, s.g, s.treedef
        names = ("exp_avg", "exp_avg_sq", "exp_avg_sq_fresh", "lamb_coeff_freeze", "last_factor", "scaling_coeff")
        fields = dict(zip(names, state_leaves(opt_state, treedef, *names)))
        if count < first:
            _warm_up(t == freeze_step, step_lr, b1, h, p, g, fields)
            return params, opt_state._replace(
                lamb_coeff_freeze=optree.tree_unflatten(treedef, fields["lamb_coeff_freeze"]))
        errors = _compressed(count == first, step_lr, b1, h, p, g, fields, opt_state, exchange_from(name, extras),
                             _model_order(params))
        return params, opt_state._replace(**{f: optree.tree_unflatten(treedef, fields[f]) for f in
                                             ("last_factor", "scaling_coeff")}, **errors)

    return Optimizer(init=init, update=pure(update_), update_=update_, elementwise=False,
                     local_gradients=local_gradients)


def _model_order(params: Params) -> list[int]:
    """The leaves' indices in the order the flat buffer lays them out: a dict's own order (the model's
    parameter order, as DeepSpeed's flat buffer of `param_groups`), where optree sorts dict keys."""
    if not isinstance(params, dict):
        return list(range(len(optree.tree_leaves(params))))
    position = {path[0]: i for i, path in enumerate(optree.tree_paths(params))}
    return [position[k] for k in params]


def _norm(x: torch.Tensor) -> torch.Tensor:
    return x.pow(2).sum().sqrt()


def _warm_up(keep_variance: bool, lr: float, b1: float, h: _Hyper, p, g, fields) -> None:
    """LAMB on averaged gradients; the ratios that are not 1 feed `lamb_coeff_freeze` (in place,
    but for the new 0-dim coefficients, which replace the list's entries)."""
    coeffs = fields["lamb_coeff_freeze"]
    for i, (pi, gi, mi, vi, fresh) in enumerate(zip(p, g, fields["exp_avg"], fields["exp_avg_sq"],
                                                    fields["exp_avg_sq_fresh"])):
        mi.mul_(b1).add_(gi, alpha=1 - b1)
        vi.mul_(h.beta2).addcmul_(gi, gi, value=1 - h.beta2)
        if keep_variance:
            fresh.copy_(vi)
        weight_norm = _norm(pi)
        upd = mi / (vi.sqrt() + h.eps)
        if h.weight_decay > 0.0:
            upd += h.weight_decay * pi
        update_norm = _norm(upd)
        coeff = 1.0
        if weight_norm != 0 and update_norm != 0:
            coeff = max(min((weight_norm / update_norm).item(), h.max_coeff), h.min_coeff)  # DeepSpeed's order
        if coeff != 1.0:
            coeffs[i] = _scalar(h.coeff_beta * float(coeffs[i]) + (1 - h.coeff_beta) * coeff)
        pi.add_(-lr * coeff * upd)


def _compressed(first: bool, lr: float, b1: float, h: _Hyper, p, g, fields, opt_state: OneBitLambState, exchange_fn,
                order: list[int]):
    """One compressed step; returns the new error and tail buffers."""
    # Long: DeepSpeed's frozen step read top to bottom (scale, exchange, unscale, the factor's clamps).
    m, v, fresh = fields["exp_avg"], fields["exp_avg_sq"], fields["exp_avg_sq_fresh"]
    last = [mi.clone() for mi in m]
    if first:  # the momentum scales, fixed once: DeepSpeed computes them from Python floats
        scales = [(torch.linalg.vector_norm(mi) / math.sqrt(mi.numel())).item() for mi in m]
        united = sum(scales) / len(scales)
        fields["scaling_coeff"] = [_scalar(united / s) for s in scales]
    coeff = [float(c) for c in fields["scaling_coeff"]]
    for mi, gi, c in zip(m, g, coeff):
        mi.mul_(b1).add_(gi, alpha=1 - b1)
        mi.mul_(c)
    flat = torch.cat([m[i].reshape(-1) for i in order] + [opt_state.tail])
    out = exchange_fn([flat], [opt_state.worker_error], [opt_state.server_error])
    result, offset = out[0][0], 0
    for i in order:
        m[i].copy_(result[offset:offset + m[i].numel()].view_as(m[i]))
        offset += m[i].numel()
    factors = fields["last_factor"]
    for i, (pi, mi, vi, fi, mlast, c) in enumerate(zip(p, m, v, fresh, last, coeff)):
        mi.div_(c)
        grad_reconstruct = (mi - mlast * b1) / (1 - b1)
        fi.mul_(h.beta2).addcmul_(grad_reconstruct, grad_reconstruct, value=1 - h.beta2)
        denom = vi.sqrt() + h.eps
        prelim = mi / denom
        upd = prelim + h.weight_decay * pi if h.weight_decay > 0.0 else prelim
        update_norm = _norm(upd)
        factor = (denom / (fi.sqrt() + h.eps)).max().item()
        if h.weight_decay > 0.0:
            ratio = min(1.0, (_norm(prelim) / update_norm).item())
            factor = factor * ratio + (1.0 - ratio)
        factor = max(min(factor, h.factor_max), h.factor_min)  # DeepSpeed's order: the upper bound first
        last_factor = float(factors[i])
        factor = max(min(factor, last_factor * (1.0 + h.factor_threshold)), last_factor * (1.0 - h.factor_threshold))
        factors[i] = _scalar(factor)
        pi.add_(-lr * (float(fields["lamb_coeff_freeze"][i]) * factor) * upd)
    return {"worker_error": out[1][0], "server_error": out[2][0], "tail": result[offset:]}
