"""The update half of a step: the optimizer on this rank's slice (on the device, on the host with
ZeRO-Offload, or streamed through NVMe files with ZeRO-Infinity), then publishing the new
parameters by each unit's placement (`specs/sharding.md` §Step, `specs/offload.md`).

`update_on_device` and `publish_params` take the state's tensors rather than a `TrainState`, so
the eager step and the whole-step graph (whose inputs are those tensors) run the same phases."""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import torch

from .._state import TrainState
from ..offload._state import NvmeOptState
from ..sharding._module import optimizer_view
from ..sharding._plan import ShardPlan
from ..sharding._gather import unit_views
from ._phases import next_state

__all__ = ["OptimizerScalars", "update_on_device", "host_update", "publish_params"]


class OptimizerScalars(NamedTuple):
    """One optimizer step's numbers: Python floats eagerly, 0-dim tensors inside a graph."""

    factor: Any  # unscale x clip: multiplies the reduced gradients first
    lr: Any  # the schedule's; None: the optimizer's own
    momentum: Any  # OneCycle's; None: the optimizer's own
    global_norm: Any  # the norm of the factored gradients over every rank, for chains that read it


def update_on_device(plan: ShardPlan, rank: int, params: dict[str, torch.Tensor], master, opt_state,
                     grads: dict[str, torch.Tensor], scalars: OptimizerScalars, opt, update: Callable,
                     param_dtype: torch.dtype):
    """`update` (the optimizer's `update`, `update_` when donated, `graph_update` in a graph) of
    this rank's slice, gradients scaled by `scalars.factor` first (in place: they are this step's
    own); returns (new slices in the compute dtype, new master or None, new optimizer state)."""
    factor = scalars.factor
    if isinstance(factor, torch.Tensor) or factor != 1.0:
        for g in grads.values():
            g.mul_(factor)
    target = master if master is not None else optimizer_view(plan, rank, params, opt.elementwise)
    if not opt.elementwise:
        grads = _per_param(plan, grads)
        if master is not None:
            target = _per_param(plan, target)
    extras = {"global_norm": scalars.global_norm} if opt.takes_extras else {}
    new_target, new_opt_state = update(grads, opt_state, target, scalars.lr, momentum=scalars.momentum, **extras)
    if not opt.elementwise:
        new_target = _per_unit(plan, new_target, like=master if master is not None else params)
    if master is None:
        return new_target, None, new_opt_state
    return {k: t.to(param_dtype) for k, t in new_target.items()}, new_target, new_opt_state


def publish_params(plan: ShardPlan, comm, params: dict[str, torch.Tensor], new_slices: dict[str, torch.Tensor],
                   donate: bool) -> dict[str, torch.Tensor]:
    """The next state's parameters from each unit's updated slice (compute dtype): kept as they are
    where the optimizer updated the whole unit or parameters are held as shards; all-gathered into
    the replicated buffer where only the optimizer state is sharded (into the input state's own
    buffer, `params`, when donated)."""
    new_params: dict[str, torch.Tensor] = {}
    pending = {}
    for u in plan.units:  # start every gather first: the backend runs them back to back
        t = new_slices[u.name]
        if not u.placement.optimizer or u.placement.params:
            new_params[u.name] = t
        elif donate:
            # Into the input state's own buffer; the shard is copied first since it may be a
            # view of that very buffer (fp32 training updates the parameters' slice in place).
            pending[u.name] = comm.all_gather_async(t.clone(), out=params[u.name], label=u.name)
        else:
            pending[u.name] = comm.all_gather_async(t, label=u.name)
    for name, p in pending.items():
        new_params[name] = p.wait()
    return {u.name: new_params[u.name] for u in plan.units}


def host_update(state: TrainState, grads, factor: float, lr: float, momentum, opt, donate: bool, new_ls):
    """ZeRO-Offload and ZeRO-Infinity: the host implementation `opt` (C kernels, in memory or
    streamed through the NVMe store's files) updates the fp32 master shard, with the gradient
    factor and the 16-bit (or device) copy of the new parameters fused into its pass."""
    sh = state.sharding
    plan, rank = sh.plan, sh.rank
    if state.master is not None:
        master = state.master
    else:
        master = optimizer_view(plan, rank, state.params, True)
    # Where each unit's new parameters go: the kernel writes them straight into the next
    # state's buffers (parameter shards, or whole units where the optimizer is replicated), else into a staging shard.
    out = {}
    nvme = isinstance(state.opt_state, NvmeOptState)  # the master is on disk
    # `offload_param: nvme`: these units' parameters are the master file itself (placeholders here).
    in_store = {u.name for u in plan.units if nvme and state.opt_state.holds_params and u.placement.params}
    for u in plan.units:
        p = state.params[u.name]
        if u.name in in_store:
            out[u.name] = None
        elif state.master is None and not nvme:
            out[u.name] = None  # fp32 on the host: the master *is* the parameter slice
        else:
            numel = master[u.name].numel()
            out[u.name] = p.new_empty(numel) if not donate or p.numel() != numel else p
    update = opt.update_ if donate else opt.update
    new_master, new_opt = update(grads, state.opt_state, None if nvme else master, lr, momentum=momentum,
                                 grad_scale=factor, out={k: v for k, v in out.items() if v is not None})
    new_slices = {
        u.name: state.params[u.name] if u.name in in_store else out[u.name] if out[u.name] is not None else new_master[u.name]
        for u in plan.units
    }
    new_params = publish_params(plan, sh.comm, state.params, new_slices, donate)
    return next_state(state, new_params, new_master if state.master is not None else None, new_opt, new_ls)


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
