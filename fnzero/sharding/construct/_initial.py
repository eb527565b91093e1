"""The initial flat buffers of a sharded model: from a built model's own storage, released unit by
unit, or from a meta model initialised region by region, each rank computing what it keeps
(`_materialize.py`, `_replay.py`)."""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from ..._errors import ShardingError
from ._materialize import MetaInitializer
from ..comm import checksum
from ..zero import ShardPlan, UnitPlan

__all__ = ["Initial", "InitialValues", "checksum", "initial_from_model", "initial_from_meta", "placeholder_param", "is_released"]

# (unit name -> flat buffer or this rank's shard, frozen parameters by name, buffers by name,
#  names of the tensors a meta model's init code left uninitialised)
Initial = tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], dict[str, torch.Tensor], list[str]]


@dataclasses.dataclass
class InitialValues:
    """What the first TrainState's parameters are built from (held by the ShardedModule until
    `init_state`): each unit's flat buffer or shard, and the names a meta model's init left unset."""

    params: dict[str, torch.Tensor]
    uninitialised: list[str]
    # unit name -> a checksum of the unit's whole initial buffer, when each rank built its own
    # copy of the model (`init_state` compares them across ranks: `checksum`).
    checksums: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)


class PretrainedWarning(UserWarning):
    """`init_state(pretrained=...)`: some of the model's tensors are not in the files."""


def placeholder_param(p: torch.Tensor) -> nn.Parameter:
    """What a sharded model holds in place of a parameter: a meta tensor marked as released."""
    ph = nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device="meta"), requires_grad=p.requires_grad)
    ph._fnzero_released = True  # type: ignore[attr-defined]
    return ph


def is_released(model: nn.Module) -> bool:
    """Whether `model` was given to `fnzero.shard` already (its parameters are placeholders)."""
    return any(getattr(p, "_fnzero_released", False) for p in model.parameters())


def _flat(unit: UnitPlan, plan: ShardPlan, rank: int, fill, device: torch.device,
          checksums: dict[str, torch.Tensor] | None = None, key: str | None = None) -> torch.Tensor:
    """This rank's part of `unit`'s flat buffer, filled by `fill(name, lo, hi, out)` (elements [lo, hi)
    of `name`); the whole buffer is filled only when its checksum is asked (under `key` or the unit's name)."""
    lo, hi = (0, unit.padded_numel) if checksums is not None or not plan.params_sharded(unit) else unit.shard_range(rank)
    flat = torch.empty(hi - lo, dtype=plan.param_dtype, device=device)
    flat[max(0, unit.numel - lo) :].zero_()  # the padding: the slots lie back to back from 0 to numel
    for slot in unit.slots:
        a, b = max(lo, slot.offset), min(hi, slot.offset + slot.numel)
        if a < b:
            fill(slot.name, a - slot.offset, b - slot.offset, flat[a - lo : b - lo])
    if checksums is not None:
        checksums[key or unit.name] = checksum(flat)
        if plan.params_sharded(unit):
            lo, hi = unit.shard_range(rank)
            flat = flat[lo:hi].clone()
    return flat


class Cuts:
    """How a model's whole tensors are cut to what this rank holds: tensor-parallel slices (`tp`,
    a TPLayout) and rows of stacked experts (`ep`, an EPLayout); either may be None."""

    def __init__(self, tp=None, ep=None):
        self.tp, self.ep = tp, ep

    def split_of(self, name: str, *aliases: str):
        """(the split, this rank's index along its axis), or None for a tensor held whole."""
        split = self.tp.split_of(name, *aliases) if self.tp is not None else None
        if split is not None:
            return split, self.tp.rank
        split = self.ep.split_of(name) if self.ep is not None else None
        return (split, self.ep.rank) if split is not None else None


def _cut(cuts: Cuts | None, name: str, t: torch.Tensor) -> torch.Tensor:
    """This rank's slice of parameter `name` (whole when it is not split)."""
    found = cuts.split_of(name) if cuts is not None else None
    return found[0].local(t, found[1]) if found is not None else t


def _owners(model: nn.Module) -> dict[int, list[tuple[nn.Module, str]]]:
    """Where each parameter is registered (tied ones in several places)."""
    owners: dict[int, list[tuple[nn.Module, str]]] = {}
    for mod in model.modules():
        for leaf, p in mod._parameters.items():
            if p is not None:
                owners.setdefault(id(p), []).append((mod, leaf))
    return owners


def _release(owners, p: torch.Tensor) -> None:
    # Construction: the entry of each owner's own table, not the table (`zero/_backward.py`'s `bind`,
    # FSDP2's `unsafe_setattr_param`), so that later bindings find and restore the same dict.
    ph = placeholder_param(p)
    for mod, leaf in owners.get(id(p), ()):
        mod._parameters[leaf] = ph


def frozen_checksum_key(unit: UnitPlan) -> str:
    """Where a frozen unit's checksum is kept beside the trainable units' (same names)."""
    return f"{unit.name} (frozen)"


def _frozen_dtype(plan: ShardPlan, compute_dtype: torch.dtype | None) -> torch.dtype:
    # Frozen parameters take part in the 16-bit forward like the trainable ones.
    return compute_dtype or plan.param_dtype


def initial_from_model(model: nn.Module, plan: ShardPlan, rank: int, device: torch.device,
                       compute_dtype: torch.dtype | None, checksums: dict[str, torch.Tensor] | None) -> Initial:
    """From a model built on a real device, its storage released unit by unit (never held twice); each
    unit's checksum goes into `checksums`, which `init_state` compares across ranks."""
    named = dict(model.named_parameters(remove_duplicate=False))
    # Frozen parameters take part in the 16-bit forward like the trainable ones.
    frozen = {n: named[n].detach().to(device=device, dtype=compute_dtype or named[n].dtype) for n in plan.frozen}
    buffers = {n: b.detach().to(device) for n, b in model.named_buffers()}
    owners = _owners(model)
    initial = {}

    def fill(n: str, lo: int, hi: int, out: torch.Tensor) -> None:
        out.copy_(named[n].detach().reshape(-1)[lo:hi])

    with torch.no_grad():
        # Each unit with its kind: a frozen unit's name is its module's trainable unit's (and `in`
        # over the units would compare whole plans of slots, units² times).
        for u, is_frozen in [*((u, False) for u in plan.units), *((u, True) for u in plan.frozen_units)]:
            if is_frozen:
                flat = _flat(u, plan, rank, fill, device, checksums, frozen_checksum_key(u))
                frozen[u.name] = flat.to(_frozen_dtype(plan, compute_dtype))
            else:
                initial[u.name] = _flat(u, plan, rank, fill, device, checksums)
            for slot in u.slots:
                _release(owners, named.pop(slot.name))
                for alias in slot.aliases:
                    named.pop(alias, None)
    for n in plan.frozen:
        _release(owners, named.pop(n))
    return initial, frozen, buffers, []


def _filler(values, named: dict[str, torch.Tensor], cuts: Cuts | None):
    """`_flat`'s fill for a meta model's region: the part asked of each tensor, or for a tensor `cuts`
    splits, the whole one cut to this rank's part."""
    def fill(n: str, lo: int, hi: int, out: torch.Tensor) -> None:
        key = id(named[n])
        if key not in values:  # a real tensor of a partly-meta model, outside the region
            out.copy_(_cut(cuts, n, named[n].detach()).reshape(-1)[lo:hi])
        elif cuts is not None and cuts.split_of(n) is not None:
            out.copy_(_cut(cuts, n, values.whole(key)).reshape(-1)[lo:hi])
        else:
            values.fill(key, lo, hi, out)

    return fill


def initial_from_meta(model: nn.Module, plan: ShardPlan, rank: int, device: torch.device,
                      compute_dtype: torch.dtype | None, seed: int, cuts: Cuts | None = None,
                      split_model: nn.Module | None = None) -> Initial:
    """From a model built on the meta device, region by region (`specs/sharding.md` §Meta construction).
    With tensor parallelism or stacked experts, `model` is the whole meta model and `split_model` the
    split one `plan` describes: each tensor is initialised whole and cut (`cuts`), whatever the mesh."""
    init = MetaInitializer(model, plan, seed)
    named = dict(model.named_parameters(remove_duplicate=False))
    names = init.names
    buffer_name = {id(b): n for n, b in model.named_buffers()}  # one name each, as `named_buffers()` gives
    frozen_ids = {id(named[n]): n for n in plan.frozen}
    unit_of_region = {u.module: u for u in plan.units}
    frozen_of_region = {u.module: u for u in plan.frozen_units}
    initial: dict[str, torch.Tensor] = {}
    frozen: dict[str, torch.Tensor] = {}
    buffers: dict[str, torch.Tensor] = {}
    uninitialised: list[str] = []
    for n, b in model.named_buffers():
        if not b.is_meta:
            buffers[n] = b.detach().to(device)
    for region in init.regions(list(dict.fromkeys([*unit_of_region, *frozen_of_region]))):
        unit, funit = unit_of_region.get(region), frozen_of_region.get(region)
        # A unit's parameters registered outside its region (tied across units, so in the root
        # unit) are initialised with it, by the modules that own them.
        extra = tuple(m for u in (unit, funit) if u is not None for slot in u.slots
                      for m, _, _ in init.owners.get(id(named[slot.name]), ()))
        with init.initialised(region, extra) as values, torch.no_grad():
            uninitialised += [names[k] for k in values.keys()
                              if k in names and values.untouched(k) and names[k] not in uninitialised]
            if unit is not None:
                initial[unit.name] = _flat(unit, plan, rank, _filler(values, named, cuts), device)
            if funit is not None:
                frozen[funit.name] = _flat(funit, plan, rank, _filler(values, named, cuts), device).to(
                    _frozen_dtype(plan, compute_dtype))
            for key in values.keys():
                if key in frozen_ids and frozen_ids[key] not in frozen:
                    v = _cut(cuts, frozen_ids[key], values.whole(key))
                    frozen[frozen_ids[key]] = v.to(device=device, dtype=compute_dtype or v.dtype)
                if key in buffer_name and buffer_name[key] not in buffers:
                    buffers[buffer_name[key]] = values.whole(key).to(device)
    missing = [n for n in plan.frozen if n not in frozen and named[n].is_meta]
    if missing:
        raise ShardingError(f"model built on the meta device: frozen parameters {missing} were never materialised")
    for n in plan.frozen:
        if n not in frozen:
            frozen[n] = _cut(cuts, n, named[n]).detach().to(device=device, dtype=compute_dtype or named[n].dtype)
    for m in (model, split_model) if split_model is not None else (model,):
        owners = _owners(m)
        for p in {id(p): p for p in m.parameters()}.values():  # marked as given to fnzero
            _release(owners, p)
    order = [n for n, _ in model.named_buffers()]
    return initial, frozen, {n: buffers[n] for n in order}, sorted(uninitialised)
