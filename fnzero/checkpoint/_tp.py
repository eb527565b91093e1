"""Checkpoints of tensor-parallel states, in the ordinary format (`specs/checkpoint-format.md`
§Tensor parallelism, `specs/mesh.md`): a save consolidates each unit over the tensor-parallel
ranks first; a load reads each parameter whole and keeps this rank's slice, with no collectives.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from .._errors import CheckpointError
from .._state import Sharding, StateMesh, TrainState
from ..sharding import ParamSlot, ShardPlan, padded_size
from ._tree import Leaf, rebuild_state

__all__ = ["full_plan", "consolidated", "tp_check_view", "fill_tp_leaf"]


def _per_param(leaf: Leaf) -> bool:
    """A leaf of one parameter's own state (stored under its unit's key, named by the parameter),
    told apart by name, never by size: the same on every rank whatever its slice holds."""
    return leaf.path.rpartition("/")[2] != leaf.unit


def full_plan(plan: ShardPlan, tp) -> ShardPlan:
    """`plan` with every split parameter at its full shape (offsets and padding recomputed as
    `make_plan` lays them out): the plan of the same model without tensor parallelism."""
    units, n = [], plan.world_size
    for u in plan.units:
        offset, slots = 0, []
        for s in u.slots:
            split = tp.split_of(s.name, *s.aliases)
            shape = split.full_shape if split is not None else s.shape
            slots.append(ParamSlot(s.name, tuple(shape), offset, s.aliases))
            offset += math.prod(shape)
        sharing = n // u.ep  # an expert unit is shared by its expert-data-parallel ranks only
        padded = padded_size(offset, sharing)
        units.append(dataclasses.replace(u, slots=tuple(slots), numel=offset, padded_numel=padded,
                                         shard_numel=padded // sharing))
    return dataclasses.replace(plan, units=tuple(units))


def consolidated(state: TrainState) -> TrainState:
    """`state` as the same run without tensor parallelism would hold it on this data-parallel
    rank: every unit leaf (parameters, master, optimizer moments) whole where it was whole, this
    rank's dp shard of the whole unit where it was a shard. Collective over both axes: every rank
    calls it; the unit buffers are gathered one leaf at a time."""
    sh = state.sharding
    plan, comm, tp = sh.plan, sh.comm, sh.tp
    fplan = full_plan(plan, tp)
    units, full_units = {u.name: u for u in plan.units}, {u.name: u for u in fplan.units}

    def convert(leaf: Leaf) -> torch.Tensor:
        t = leaf.tensor.detach()
        if leaf.unit is None:
            top, _, name = leaf.path.partition("/")
            split = tp.split_of(name) if top == "frozen" else None
            return tp.gather_full(name, t) if split is not None else t
        u, fu = units[leaf.unit], full_units[leaf.unit]
        if u.is_expert:  # experts are whole on every tensor-parallel rank (no slot of theirs is split)
            return t
        if _per_param(leaf):  # one parameter's own state (Lamb)
            slot = next(s for s in u.slots if s.offset == leaf.lo)
            return tp.gather_full(slot.name, t) if tp.split_of(slot.name, *slot.aliases) is not None else t
        whole = t.reshape(-1) if leaf.hi - leaf.lo == u.padded_numel else comm.all_gather(t.reshape(-1))
        parts = []
        for s, fs in zip(u.slots, fu.slots):
            local = whole[s.offset: s.offset + s.numel].view(s.shape)
            parts.append((tp.gather_full(s.name, local) if tp.split_of(s.name, *s.aliases) is not None else local).reshape(-1))
        parts.append(whole.new_zeros(fu.padded_numel - fu.numel))
        full = torch.cat(parts)
        if leaf.hi - leaf.lo == u.padded_numel:
            return full
        lo, hi = fu.shard_range(comm.rank)
        return full[lo:hi].clone()

    new = rebuild_state(state, convert)
    return new.replace(sharding=Sharding(fplan, StateMesh(comm, ep=sh.ep), sh.device))


def tp_check_view(like: TrainState) -> TrainState:
    """`like` as `check_model` compares it with a checkpoint: whole shapes (meta tensors)."""
    tp = like.sharding.tp
    frozen = {n: torch.empty(tp.split_of(n).full_shape, device="meta") if tp.split_of(n) is not None else t
              for n, t in like.frozen.items()}  # fmt: skip
    sh = like.sharding
    whole = Sharding(full_plan(sh.plan, sh.tp), StateMesh(sh.comm, ep=sh.ep), sh.device)
    return like.replace(frozen=frozen, sharding=whole)


def fill_tp_leaf(leaf: Leaf, like: TrainState, fplan: ShardPlan, read, key: str, out: torch.Tensor) -> torch.Tensor:
    """Fill `out` (flat, `leaf`'s elements) from the checkpoint's whole-model tensor `key` (`fplan`:
    `full_plan` of like's plan):
    `read(key, lo, hi, buf)` reads elements of a whole unit (or a replicated tensor). Each
    parameter is read whole and cut to this rank's slice."""
    sh = like.sharding
    tp = sh.tp
    if leaf.unit is None:
        top, _, name = leaf.path.partition("/")
        split = tp.split_of(name) if top == "frozen" else None
        if split is None:
            return read(key, 0, out.numel(), out)
        full = torch.empty(math.prod(split.full_shape), dtype=out.dtype)
        read(key, 0, full.numel(), full)
        return out.copy_(split.local(full.view(split.full_shape), tp.rank).reshape(-1))
    u = sh.plan.unit(leaf.unit)
    fu = fplan.unit(leaf.unit)
    per_param = _per_param(leaf)
    out.zero_()  # padding stays zero
    for s, fs in zip(u.slots, fu.slots):
        a, b = max(leaf.lo, s.offset), min(leaf.hi, s.offset + s.numel)
        if per_param and s.offset != leaf.lo:
            continue
        if a >= b:
            continue
        full = torch.empty(fs.numel, dtype=out.dtype)
        read(key, fs.offset, fs.offset + fs.numel, full)
        split = tp.split_of(s.name, *s.aliases)
        piece = split.local(full.view(fs.shape), tp.rank).reshape(-1) if split is not None else full
        out[a - leaf.lo: b - leaf.lo] = piece[a - s.offset: b - s.offset]
    return out


def check_supported(state: TrainState) -> None:
    """What a tensor-parallel checkpoint does not cover yet."""
    from ..offload import NvmeOptState

    if isinstance(state.opt_state, NvmeOptState):
        raise CheckpointError("checkpoints of a tensor-parallel state with its optimizer on NVMe are not implemented yet")
