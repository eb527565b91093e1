"""The update half of a step: the optimizer on this rank's slice, wherever its state is (device,
host, NVMe), then the new parameters published by placement (`specs/sharding.md` §Step,
`specs/offload.md`). The phases take the state's tensors, not a `TrainState`, so the whole-step
graph runs them too."""

from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple

import torch

from ..sharding import (
    compressed_all_reduce, optimizer_view, ShardPlan, comm_for, unit_views, ShardSource, is_placeholder,
)
from ..state import owner_layout, owner_update

__all__ = ["OptimizerScalars", "optimizer_exchange", "optimizer_update", "publish_params"]


class OptimizerScalars(NamedTuple):
    """One optimizer step's numbers: Python floats eagerly, 0-dim tensors inside a graph."""

    factor: Any  # unscale x clip: multiplies the reduced gradients first
    lr: Any  # the schedule's; None: the optimizer's own
    momentum: Any  # OneCycle's; None: the optimizer's own
    global_norm: Any  # the norm of the factored gradients over every rank, for chains that read it


def optimizer_exchange(opt, comm) -> Callable | None:
    """The compressed all-reduce over the dp collectives `comm`, for an optimizer that exchanges
    what it needs itself (`Optimizer.exchanges_gradients`); None for the others."""
    if not opt.exchanges_gradients:
        return None
    return functools.partial(compressed_all_reduce, comm)


def optimizer_update(plan: ShardPlan, rank: int, params: dict[str, torch.Tensor], master, opt_state,
                     grads: dict[str, torch.Tensor], scalars: OptimizerScalars, opt, update: Callable,
                     param_dtype: torch.dtype, donate: bool, comm=None, param_source: ShardSource | None = None):
    """`update` (the optimizer's `update`, `update_` when donated, `graph_update` in a graph) of
    this rank's slice; returns (new slices in the compute dtype on the parameters' device, new
    master or None, new optimizer state).

    The gradients are multiplied by `scalars.factor` first (in place: they are this step's own) and
    moved to where the optimizer's target is; a non-elementwise optimizer at stages 1-3 runs through
    the whole-tensor partition over `comm` (`state/_owner_update.py`); a placeholder parameter
    (`offload_param: nvme`) has its new value written into `param_source` (`_copy_out`)."""
    factor = scalars.factor
    if isinstance(factor, torch.Tensor) or factor != 1.0:
        for g in grads.values():
            g.mul_(factor)
    where = master if master is not None else params
    grads = {k: g if g.device == where[k].device else g.to(where[k].device) for k, g in grads.items()}
    target = master if master is not None else optimizer_view(plan, rank, params, opt.elementwise)
    exchange = optimizer_exchange(opt, comm)
    extras = {} if exchange is None else {"compressed_all_reduce": exchange}
    if not opt.elementwise and plan.placement.optimizer:
        new_target, new_opt_state = owner_update(plan, owner_layout(plan, opt), comm, grads, target, opt_state, scalars)
    elif not opt.elementwise:
        grads = _per_param(plan, grads)
        if master is not None:
            target = _per_param(plan, target)
        new_target, new_opt_state = update(grads, opt_state, target, scalars.lr, momentum=scalars.momentum,
                                           global_norm=scalars.global_norm, **extras)
        new_target = _per_unit(plan, new_target, like=master if master is not None else params)
    else:
        new_target, new_opt_state = update(grads, opt_state, target, scalars.lr, momentum=scalars.momentum,
                                           global_norm=scalars.global_norm, **extras)
    if master is None:
        return new_target, None, new_opt_state
    return _copy_out(new_target, params, param_dtype, donate, param_source), new_target, new_opt_state


def _copy_out(master: dict[str, torch.Tensor], params: dict[str, torch.Tensor], param_dtype: torch.dtype, donate: bool,
              source: ShardSource | None) -> dict[str, torch.Tensor]:
    """The new master in the compute dtype (`_compute_copy`). Into a store, all the units' writes
    and the step they are of (`set_step`) are one update of it (`updating`): one that fails part-way
    (disk full, an I/O error) leaves it refusing every later use, where a retry of this state
    would otherwise read some units' new shards with the others' old ones."""
    def copy() -> dict[str, torch.Tensor]:
        return {k: _compute_copy(t, params[k], param_dtype, donate, k, source) for k, t in master.items()}

    if source is None:
        return copy()
    step = source.store.last_step + 1  # `stepped_in_place` checked it holds this state's step
    with source.store.updating("step", step):
        new_params = copy()
        source.store.set_step(step)
    return new_params


def _compute_copy(master: torch.Tensor, param: torch.Tensor, param_dtype: torch.dtype, donate: bool, unit: str,
                  source: ShardSource | None) -> torch.Tensor:
    """The new master in the compute dtype on the parameters' device: into the donated parameter
    buffer when it is this slice's size (stage 0's whole units, stage 3's shards), else new (stages
    1-2 all-gather it into the buffer next); for a placeholder, into its store (the same rounding)."""
    if is_placeholder(param):
        assert source is not None, f"placeholder parameter {unit!r} without a store to write it to"
        source.write(unit, master.to(param.dtype))
        return source.renew(unit, param)  # the older state's placeholder is refused from now on
    if donate and param.numel() == master.numel() and param.dtype == param_dtype:
        return param.copy_(master)
    return master.to(device=param.device, dtype=param_dtype)


def publish_params(plan: ShardPlan, comm, params: dict[str, torch.Tensor], new_slices: dict[str, torch.Tensor],
                   donate: bool, expert_comm=None) -> dict[str, torch.Tensor]:
    """The next state's parameters from each unit's updated slice (compute dtype): kept as they are
    where the optimizer updated the whole unit or parameters are held as shards; all-gathered into
    the replicated buffer where only the optimizer state is sharded (into the input state's own
    buffer, `params`, when donated). Expert units gather over `expert_comm` (`comm_for`)."""
    new_params: dict[str, torch.Tensor] = {}
    pending = {}
    for u in plan.units:  # start every gather first: the backend runs them back to back
        t = new_slices[u.name]
        if not u.placement.optimizer or u.placement.params:
            new_params[u.name] = t
        elif donate:
            # Into the input state's own buffer; the shard is copied first since it may be a
            # view of that very buffer (fp32 training updates the parameters' slice in place).
            pending[u.name] = comm_for(u, comm, expert_comm).all_gather_async(t.clone(), out=params[u.name], label=u.name)
        else:
            pending[u.name] = comm_for(u, comm, expert_comm).all_gather_async(t, label=u.name)
    for name, p in pending.items():
        new_params[name] = p.wait()
    return {u.name: new_params[u.name] for u in plan.units}


def _per_param(plan: ShardPlan, by_unit: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {}
    for u in plan.units:
        views = unit_views(u, by_unit[u.name])
        out.update({s.name: views[s.name] for s in u.slots})
    return out


def _per_unit(plan: ShardPlan, by_param: dict[str, torch.Tensor], like: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {}
    for u in plan.units:
        parts = [by_param[s.name].reshape(-1) for s in u.slots]
        pad = u.padded_numel - u.numel
        if pad:
            parts.append(like[u.name].new_zeros(pad))
        out[u.name] = torch.cat(parts) if parts else like[u.name].new_zeros(0)
    return out
