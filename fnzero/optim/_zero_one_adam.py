"""0/1 Adam (DeepSpeed's `ZeroOneAdam`, `deepspeed/runtime/fp16/onebit/zoadam.py` before 0.19.8
removed it); the algorithm: `specs/optim.md` §1-bit optimizers."""

from __future__ import annotations

from typing import Any, NamedTuple

import optree
import torch

from ._base import Optimizer, OptState, Params, pure, state_leaves, zeros_count
from ._onebit_common import (
    empty_error, exchange, exchange_from, hyper, no_effect_kwargs, step_start, steps,
)

__all__ = ["ZeroOneAdamState", "zero_one_adam"]


class ZeroOneAdamState(NamedTuple):
    """count: applied steps; exp_avg, exp_avg_sq, momentum_accumulator: trees like params;
    worker_error, server_error: the compression errors (flat, 0 elements until first used);
    var_interval, var_counter, local_step_interval, local_step_counter: 0-dim int64 (DeepSpeed's
    per-parameter counters, equal for every parameter); lrs: Σ lr since the last exchange (0-dim
    float64)."""

    # Each rank's own (a checkpoint stores one per rank: fnzero/checkpoint/_tree.py)
    PER_RANK_FIELDS = ("worker_error", "server_error")

    count: torch.Tensor
    exp_avg: Params
    exp_avg_sq: Params
    momentum_accumulator: Params
    worker_error: Params
    server_error: Params
    var_interval: torch.Tensor
    var_counter: torch.Tensor
    local_step_interval: torch.Tensor
    local_step_counter: torch.Tensor
    lrs: torch.Tensor

    def checkpoint_problem(self) -> str | None:
        """Why a checkpoint cannot hold this state now (`fnzero.checkpoint.save` asks): between two
        exchanges each rank has taken local steps, so the ranks' parameters and momenta differ."""
        if float(self.lrs) != 0.0:
            return ("0/1 Adam is between two exchanges of its local steps, and each rank's parameters differ; save "
                    "after a step that exchanged them (every local_step_interval steps after var_freeze_step)")
        return None


def _int(v: int) -> torch.Tensor:
    return torch.tensor(v, dtype=torch.int64)


def zero_one_adam(lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                  weight_decay: float = 0.0, var_freeze_step: int = 100000, var_update_scaler: int = 16,
                  local_step_scaler: int = 32678, local_step_clipper: int = 16, **deepspeed_keys: Any) -> Optimizer:
    """0/1 Adam; `deepspeed_keys` takes DeepSpeed's keys that change nothing here (bias_correction,
    eps_inside_sqrt, max_grad_norm, cuda_aware, comm_backend_name, amsgrad=False)."""
    # Long: three closures (init, update_, local_gradients) over the same checked hyper-parameters.
    name = "zero_one_adam"
    default_lr, beta1, beta2, eps, weight_decay = hyper(name, lr, betas, eps, weight_decay)
    var_freeze_step = steps(name, "var_freeze_step", var_freeze_step)
    var_update_scaler = steps(name, "var_update_scaler", var_update_scaler, lo=1)
    local_step_scaler = steps(name, "local_step_scaler", local_step_scaler, lo=1)
    local_step_clipper = steps(name, "local_step_clipper", local_step_clipper, lo=1)
    no_effect_kwargs(name, deepspeed_keys)

    def frozen(count: int) -> bool:
        # DeepSpeed freezes after a step t > var_freeze_step, never after its initialisation step.
        return count >= 2 and count > var_freeze_step

    def local_gradients(state: OptState) -> bool:
        count = int(state.count)
        if count == 0:
            return False
        return frozen(count) or (count + 1) % int(state.var_interval) != 0

    def init(params: Params) -> ZeroOneAdamState:
        with torch.no_grad():
            zeros = lambda: optree.tree_map(torch.zeros_like, params)  # noqa: E731
            return ZeroOneAdamState(zeros_count(), zeros(), zeros(), zeros(), optree.tree_map(empty_error, params),
                                    optree.tree_map(empty_error, params), _int(1), _int(0), _int(1), _int(0),
                                    torch.zeros((), dtype=torch.float64))

    @torch.no_grad()
    def update_(grads: Params, opt_state: OptState, params: Params, lr: float | None = None, *,
                momentum: float | None = None, **extras):
        is_frozen = frozen(int(opt_state.count))
        s = step_start(name, grads, opt_state, params, lr, momentum, default_lr, beta1)
        if s is None:
            return params, opt_state
        t, step_lr, b1, p, g, treedef = s.t, s.lr, s.b1, s.p, s.g, s.treedef
        m, v, acc, we, se = state_leaves(opt_state, treedef, "exp_avg", "exp_avg_sq", "momentum_accumulator",
                                         "worker_error", "server_error")
        var_interval, lrs = int(opt_state.var_interval), float(opt_state.lrs)

        def exchanged(tensors, we, se):  # the step's compressed all-reduce, asked for only where it runs
            return exchange(exchange_from(name, extras), tensors, we, se)

        we, se = _moments_(m, v, g, b1, beta2, is_frozen, t % var_interval == 0, exchanged, we, se)
        if is_frozen:
            lrs += step_lr
        for pi, mi, vi, ai in zip(p, m, v, acc):
            upd = mi / (vi.sqrt() + eps)
            if weight_decay > 0.0:
                upd += weight_decay * pi
            pi.add_(-step_lr * upd)
            if is_frozen:
                ai.add_(-step_lr * upd)
        if is_frozen and t % int(opt_state.local_step_interval) == 0:
            we, se = _exchange_local_steps(p, acc, m, v, eps, lrs, exchanged, we, se)
            lrs = 0.0
        state = _advance_counters(opt_state, is_frozen, t, var_update_scaler, local_step_scaler, local_step_clipper)
        if not is_frozen and frozen(t):  # freezing now: the errors start again from zero (DeepSpeed)
            we, se = [empty_error(e) for e in we], [empty_error(e) for e in se]
        state = state._replace(worker_error=optree.tree_unflatten(treedef, we),
                               server_error=optree.tree_unflatten(treedef, se),
                               lrs=torch.tensor(lrs, dtype=torch.float64))
        return params, state

    return Optimizer(init=init, update=pure(update_), update_=update_, elementwise=False,
                     local_gradients=local_gradients)


def _moments_(m, v, g, b1: float, beta2: float, is_frozen: bool, variance_step: bool, exchanged, we, se):
    """The moments of one step, in place (DeepSpeed's phases): before the freeze, both from the
    gradients on a variance step (they arrive averaged), else the momentum alone from the gradients
    averaged by the compressed all-reduce (`exchanged`); after it, the momentum from this rank's own
    gradients. Returns the compression errors."""
    if is_frozen:
        for mi, gi in zip(m, g):
            mi.mul_(b1).add_(gi, alpha=1 - b1)
    elif variance_step:
        for mi, vi, gi in zip(m, v, g):
            vi.mul_(beta2).addcmul_(gi, gi, value=1 - beta2)
            mi.mul_(b1).add_(gi, alpha=1 - b1)
    else:
        averaged, we, se = exchanged(g, we, se)
        for mi, ai in zip(m, averaged):
            mi.mul_(b1).add_(ai, alpha=1 - b1)
    return we, se


def _exchange_local_steps(p, acc, m, v, eps: float, lrs: float, exchanged, we, se):
    """Every `local_step_interval` steps after the freeze, in place: the local steps undone, their
    buffer (times `sqrt(v) + eps`) averaged by the compressed all-reduce and applied, and the
    momentum rebuilt from it (`m = -buffer / Σ lr`). Returns the compression errors."""
    for pi, ai, vi in zip(p, acc, v):
        pi.add_(-1 * ai)
        ai.mul_(vi.sqrt() + eps)
    averaged, we, se = exchanged(acc, we, se)
    for pi, ai, mi, vi, avg in zip(p, acc, m, v, averaged):
        ai.copy_(avg)
        mi.zero_().add_(ai / lrs, alpha=-1)
        pi.add_(ai / (vi.sqrt() + eps))
        ai.zero_()
    return we, se


def _advance_counters(state: ZeroOneAdamState, is_frozen: bool, t: int, var_update_scaler: int,
                      local_step_scaler: int, local_step_clipper: int) -> ZeroOneAdamState:
    """The variance policy before the freeze, the local-step policy after it (DeepSpeed's order)."""
    if not is_frozen:
        interval, counter = int(state.var_interval), int(state.var_counter)
        if t % interval == 0:
            counter += 1
            if counter == var_update_scaler:
                counter, interval = 0, interval * 2
        return state._replace(var_interval=_int(interval), var_counter=_int(counter))
    interval, counter = int(state.local_step_interval), int(state.local_step_counter) + 1
    if counter == local_step_scaler:
        counter, interval = 0, min(local_step_clipper, interval * 2)
    return state._replace(local_step_interval=_int(interval), local_step_counter=_int(counter))
