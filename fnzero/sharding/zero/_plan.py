"""ShardPlan: which parameters form a unit, where each lives in the unit's flat buffer, which slice
each rank owns. Pure data, the same on every rank (`specs/sharding.md`)."""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Callable, Iterable

import torch
from torch import nn

from ..._errors import ShardingError
from ._placement import Placement, placement_for_stage
from ._saved_names import SavedNames, saved_names
from ._wrap import default_unit_modules, no_split_classes

__all__ = ["ParamSlot", "UnitPlan", "ShardPlan", "make_plan", "comm_for", "ROOT_UNIT", "default_unit_modules", "no_split_classes"]

ROOT_UNIT = "<root>"
"""Name of the unit that holds parameters owned by no unit module (and tied parameters shared by two)."""


@dataclasses.dataclass(frozen=True)
class ParamSlot:
    """One parameter inside a unit's flat buffer: elements `[offset, offset + numel)`."""

    name: str  # its state_dict name (the first one, for tied parameters)
    shape: tuple[int, ...]
    offset: int
    aliases: tuple[str, ...] = ()  # other state_dict names of the same tensor (tied weights)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclasses.dataclass(frozen=True)
class UnitPlan:
    """Parameters gathered and reduced together as one flat buffer (`specs/sharding.md` §Plan). An
    expert unit (`ep` > 1) is shared by the expert-data-parallel ranks only; every method takes the dp rank."""

    name: str
    module: str  # module path ('' for the root)
    slots: tuple[ParamSlot, ...]
    numel: int
    padded_numel: int
    shard_numel: int
    placement: Placement  # what of this unit is sharded: the plan's, less parameters when persistent
    ep: int = 1  # expert-parallel ranks splitting this unit's experts (1: a dense unit)

    @property
    def is_expert(self) -> bool:
        return self.ep > 1

    @property
    def persistent(self) -> bool:
        """Kept gathered though the plan shards parameters (numel below the persistence threshold)."""
        return not self.placement.params

    def shard_range(self, rank: int) -> tuple[int, int]:
        """Dp rank `rank`'s part of the buffer."""
        lo = (rank // self.ep) * self.shard_numel
        return lo, lo + self.shard_numel

    def real_range(self, rank: int) -> tuple[int, int]:
        """The part of rank's shard that holds real (not padding) elements, as buffer offsets."""
        lo, hi = self.shard_range(rank)
        return min(lo, self.numel), min(hi, self.numel)

    @property
    def split_sizes(self) -> list[int]:
        sizes = [s.numel for s in self.slots]
        pad = self.padded_numel - self.numel
        return sizes + [pad] if pad else sizes


@dataclasses.dataclass(frozen=True)
class ShardPlan:
    """The sharding of a model's parameters for one world size and placement. Frozen parameters are
    in `frozen_units` where the placement shards parameters, else whole by name in `frozen`
    (`specs/sharding.md` §Frozen parameters).
    """

    @property
    def not_traceable(self) -> str | None:
        """Why a step over this plan cannot run as one graph (`fnzero.jit(scope="step")`), or None."""
        return "stage 3 gathers parameter shards inside the forward" if self.any_sharded_params else None

    units: tuple[UnitPlan, ...]
    world_size: int
    placement: Placement  # the preset every unit starts from (`UnitPlan.placement` may drop params)
    frozen: tuple[str, ...]  # frozen parameters held whole by name (all of them unless `frozen_units`)
    param_dtype: torch.dtype
    frozen_units: tuple[UnitPlan, ...] = ()  # stage 3: frozen parameters laid out per unit module
    # (alias, name) for each other name of a tied frozen parameter held whole (GPT-2's frozen
    # `lm_head.weight` is `transformer.wte.weight`): bound and exported under both names.
    frozen_aliases: tuple[tuple[str, str], ...] = ()
    # What the model's own save writes (`_saved_names.py`): its non-persistent buffers, and a
    # transformers model's save_pretrained names; checkpoints record it and exports write by it.
    saved: SavedNames = SavedNames()

    # Units by name, made once per plan: the runtime looks units up on every gather (a scan per
    # lookup was O(units) Python work per unit per forward). Not fields: not compared, not copied.
    @functools.cached_property
    def _units_by_name(self) -> dict[str, UnitPlan]:
        return {u.name: u for u in self.units}

    @functools.cached_property
    def _frozen_units_by_name(self) -> dict[str, UnitPlan]:
        return {u.name: u for u in self.frozen_units}

    def frozen_unit(self, name: str) -> UnitPlan | None:
        """The frozen unit of that name (the module's trainable unit's name), or None."""
        return self._frozen_units_by_name.get(name)

    def trainable_unit(self, name: str) -> UnitPlan | None:
        """The trainable unit of that name, or None (a module may hold frozen parameters only)."""
        return self._units_by_name.get(name)

    @property
    def num_frozen(self) -> int:
        """Elements of the frozen parameters laid out in units (tied ones once, padding excluded)."""
        return sum(u.numel for u in self.frozen_units)

    @property
    def unit_names(self) -> tuple[str, ...]:
        return tuple(u.name for u in self.units)

    def unit(self, name: str) -> UnitPlan:
        return self._units_by_name[name]

    @property
    def stage(self) -> int:
        """The ZeRO stage the plan's placement is the preset of (reports and checkpoint index only)."""
        return self.placement.stage

    def params_sharded(self, unit: UnitPlan) -> bool:
        """Whether this unit's parameters are held as a shard and gathered in forward."""
        return unit.placement.params

    @property
    def any_sharded_params(self) -> bool:
        """Whether some unit's parameters (trainable or frozen) are held as a shard and gathered in forward."""
        return any(self.params_sharded(u) for u in (*self.units, *self.frozen_units))

    def held_numel(self, unit: UnitPlan) -> int:
        """Elements of the unit's entry in `TrainState.params`: its shard, or its padded buffer if unsharded."""
        return unit.shard_numel if self.params_sharded(unit) else unit.padded_numel

    def check_params(self, params: dict, what: str) -> None:
        """Raise one `ShardingError` unless `params` (unit name -> flat tensor) is what this plan holds:
        a state of another plan fails here, not deep in a collective."""
        if not isinstance(params, dict):
            raise ShardingError(f"{what} must be a dict of unit name -> flat tensor (state.params), "
                                f"got {type(params).__name__}")
        missing = [u.name for u in self.units if u.name not in params]
        extra = [k for k in params if k not in self.unit_names]
        wrong = []
        for u in self.units:
            t = params.get(u.name)
            if t is not None and (not isinstance(t, torch.Tensor) or t.dim() != 1 or t.numel() != self.held_numel(u)):
                got = f"shape {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
                wrong.append(f"{u.name!r}: {got}, expected ({self.held_numel(u)},)")
        if not (missing or extra or wrong):
            return
        parts = ([f"lack units {missing[:5]}{' ...' if len(missing) > 5 else ''}"] if missing else []) + (
            [f"have units this plan does not {extra[:5]}{' ...' if len(extra) > 5 else ''}"] if extra else []) + (
            ["hold " + "; ".join(wrong[:3]) + (f"; and {len(wrong) - 3} more" if len(wrong) > 3 else "")]
            if wrong else [])
        raise ShardingError(
            f"{what} do not fit this plan: they {' and '.join(parts)}. They were made by another plan than this one (stage {self.stage}, "
            f"world size {self.world_size}, {len(self.units)} units, {self.num_params} parameters). A state of "
            "another stage, world size or model? Build it with this module's init_state, or load a checkpoint, "
            "which reshards"
        )

    @property
    def num_params(self) -> int:
        """Ψ: trainable parameters, tied ones counted once, padding excluded."""
        return sum(u.numel for u in self.units)

    @property
    def num_padded(self) -> int:
        return sum(u.padded_numel for u in self.units)


def comm_for(unit: UnitPlan, comm, expert_comm):
    """The collectives a unit is sharded over: `comm`, or `expert_comm` for an expert unit."""
    return expert_comm if unit.ep > 1 else comm


def owner_module(name: str, unit_modules: list[str]) -> str:
    """The innermost unit module (path) that encloses parameter `name`; "" for the root unit."""
    best = ""
    for m in unit_modules:
        if name.startswith(m + ".") and len(m) > len(best):
            best = m
    return best


def unit_predicate(wrap: Callable[[str, nn.Module], bool] | Iterable[type]) -> Callable[[str, nn.Module], bool]:
    """A wrap policy as a predicate `(module_path, module) -> bool`: a predicate as given, module
    classes (one or several) as an isinstance test."""
    if not callable(wrap) or isinstance(wrap, type):
        classes = tuple([wrap] if isinstance(wrap, type) else wrap)
        return lambda path, m: isinstance(m, classes)
    return wrap


def padded_size(numel: int, world_size: int) -> int:
    """`numel` rounded up to a multiple of the world size, at least one element per rank."""
    return max(world_size, -(-numel // world_size) * world_size)


def _lay_out(members: dict[str, list[tuple[str, tuple[str, ...], tuple[int, ...]]]], unit_modules: list[str],
             world_size: int, placement: Placement, persistence_threshold: int,
             expert_modules: frozenset[str] = frozenset(), ep: int = 1) -> tuple[UnitPlan, ...]:
    """One unit per module in `members` (module path -> its parameters: name, aliases, shape), the
    root first, then in `unit_modules` order; each a flat buffer padded to the ranks sharing it:
    `world_size`, or `world_size / ep` for the units of `expert_modules`."""
    order = [m for m in unit_modules if m in members]
    if "" in members:
        order = [""] + order
    units = []
    for module in order:
        offset = 0
        slots = []
        for name, aliases, shape in members[module]:
            slot = ParamSlot(name=name, shape=shape, offset=offset, aliases=aliases)
            slots.append(slot)
            offset += slot.numel
        unit_ep = ep if module in expert_modules else 1
        sharing = world_size // unit_ep
        padded = padded_size(offset, sharing)
        units.append(UnitPlan(
            name=module or ROOT_UNIT, module=module, slots=tuple(slots), numel=offset, padded_numel=padded,
            shard_numel=padded // sharing,
            placement=placement.without_params() if offset < persistence_threshold else placement, ep=unit_ep,
        ))
    return tuple(units)


def make_plan(
    model: nn.Module,
    world_size: int,
    placement: "Placement | int",
    wrap: Callable[[str, nn.Module], bool] | Iterable[type] | None = None,
    persistence_threshold: int = 0,
    shard_frozen: bool = True,
    expert_modules: Iterable[str] = (),
    ep: int = 1,
) -> ShardPlan:
    """Group `model`'s parameters into units and lay each out in a flat buffer padded to `world_size`
    (`specs/sharding.md` §Plan).

    `placement`: what is sharded (or a ZeRO stage number). `persistence_threshold`: sharded units
    under it keep their parameters gathered. `wrap`: a predicate `(module_path, module) -> bool` or
    module classes choosing unit modules (default `default_unit_modules`). `shard_frozen`: frozen
    parameters in frozen units where parameters are sharded, else whole. `expert_modules`: paths of
    the experts this rank keeps of `ep` expert-parallel ranks, each a unit of its own.
    """
    if world_size < 1:
        raise ShardingError(f"world_size must be >= 1, got {world_size}")
    placement = placement_for_stage(placement)
    if wrap is None:
        unit_modules = default_unit_modules(model)
    else:
        pred = unit_predicate(wrap)
        unit_modules = [p for p, m in model.named_modules() if p and pred(p, m)]
    experts = frozenset(expert_modules)
    if experts:
        if ep < 1 or world_size % ep:
            raise ShardingError(f"expert-parallel size {ep} must divide the data-parallel world size {world_size}")
        order = {p: i for i, (p, _) in enumerate(model.named_modules())}
        unit_modules = sorted(set(unit_modules) | experts, key=order.__getitem__)

    # Tied parameters: one tensor, several names. Keep the first name, remember the others.
    names_of: dict[int, list[str]] = {}
    tensors: dict[int, nn.Parameter] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names_of.setdefault(id(p), []).append(name)
        tensors[id(p)] = p

    dtypes = {p.dtype for p in tensors.values()}
    if len(dtypes) > 1:
        raise ShardingError(
            f"all parameters must share one dtype before sharding, found {sorted(map(str, dtypes))}; "
            "cast the model (model.to(dtype)) first"
        )
    param_dtype = dtypes.pop() if dtypes else torch.float32

    members: dict[str, list[tuple[str, tuple[str, ...], tuple[int, ...]]]] = {}
    frozen_members: dict[str, list[tuple[str, tuple[str, ...], tuple[int, ...]]]] = {}
    for pid, names in names_of.items():
        p = tensors[pid]
        owners = {owner_module(n, unit_modules) for n in names}
        owner = owners.pop() if len(owners) == 1 else ""
        group = members if p.requires_grad else frozen_members
        group.setdefault(owner, []).append((names[0], tuple(names[1:]), tuple(p.shape)))
    units = _lay_out(members, unit_modules, world_size, placement, persistence_threshold, experts, ep)
    frozen: tuple[str, ...] = ()
    frozen_units: tuple[UnitPlan, ...] = ()
    if placement.params and shard_frozen:
        frozen_units = _lay_out(frozen_members, unit_modules, world_size, placement, persistence_threshold, experts, ep)
    else:
        frozen = tuple(name for group in frozen_members.values() for name, _, _ in group)
        order = {n: i for i, n in enumerate(n for names in names_of.values() for n in names[:1])}
        frozen = tuple(sorted(frozen, key=order.__getitem__))  # model order, as before
    aliases = tuple((alias, name) for group in frozen_members.values() for name, more, _ in group for alias in more
                    if not frozen_units)
    return ShardPlan(units=units, world_size=world_size, placement=placement, frozen=frozen,
                     param_dtype=param_dtype, frozen_units=frozen_units, frozen_aliases=aliases,
                     saved=saved_names(model))
