"""Checkpoints of expert-parallel states, in the ordinary format (`specs/checkpoint-format.md`
§Expert parallelism): an expert unit is stored as the *whole layer's* unit, every ep rank's
experts under their names in the whole model, each rank writing its own elements straight to
their place (no gather); a load reads each rank's experts by name. Nothing records the ep size,
and any mesh loads it.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from .._errors import CheckpointError
from .._state import Sharding, StateMesh, TrainState
from ..sharding import ParamSlot, ShardPlan, UnitPlan, padded_size

__all__ = ["ExpertPlaces", "expert_places", "check_ep_supported", "ep_check_view", "stored_place"]

Run = tuple[int, int, int]  # (lo, hi) of a rank's unit -> starting at this element of the whole layer's unit


@dataclasses.dataclass(frozen=True)
class ExpertPlaces:
    """Where each expert unit's elements lie in the whole layer's unit, for every ep rank.

    `whole`: the plan with every expert unit replaced by the whole layer's (the layout the
    checkpoint's index describes); `runs[unit][j]`: ep rank j's runs, in its unit's order."""

    whole: ShardPlan
    runs: dict[str, list[list[Run]]]
    ep_rank: int

    def places(self, unit: str, lo: int, hi: int, ep_rank: int | None = None) -> list[tuple[int, int, int]]:
        """Elements `[lo, hi)` of (ep rank `ep_rank`'s, default this rank's) unit `unit` as
        `(whole lo, whole hi, offset from lo)` pieces of the whole layer's unit; a dense unit is
        its own whole."""
        runs = self.runs.get(unit)
        if runs is None:
            return [(lo, hi, 0)] if lo < hi else []
        out = []
        for a, b, c in runs[self.ep_rank if ep_rank is None else ep_rank]:
            x, y = max(a, lo), min(b, hi)
            if x < y:
                out.append((c + x - a, c + y - a, x - lo))
        return out

    def consolidate(self, unit: UnitPlan, every: torch.Tensor) -> torch.Tensor:
        """The whole layer's padded unit from `every` ([ep, padded]: each ep rank's full unit)."""
        whole = self.whole.unit(unit.name)
        out = every.new_zeros(whole.padded_numel)
        for j, runs in enumerate(self.runs[unit.name]):
            for a, b, c in runs:
                out[c: c + b - a] = every[j, a:b]
        return out


def _whole_unit(u: UnitPlan, ep, world: int) -> tuple[UnitPlan, list[list[Run]]]:
    """The whole layer's unit of expert unit `u` (every ep rank's parameters, by the names they
    have there; stacked pieces whole, in rank order) and each ep rank's runs in it."""
    rename, prefix = ep.renames[u.module], u.module + "."
    there_of = lambda name, j: prefix + rename(name[len(prefix):], j)[0]  # noqa: E731
    shapes: dict[str, tuple] = {}  # insertion order: the whole unit's slot order
    placed = []
    for j in range(ep.size):
        mine = []
        for s in u.slots:
            name, stacked = there_of(s.name, j), rename(s.name[len(prefix):], j)[1]
            if name not in shapes:
                shape = (s.shape[0] * ep.size, *s.shape[1:]) if stacked else tuple(s.shape)
                shapes[name] = (shape, tuple(there_of(a, j) for a in s.aliases))
            mine.append((s, name, j * s.numel if stacked else 0))
        placed.append(mine)
    slots, offset = {}, 0
    for name, (shape, aliases) in shapes.items():
        slots[name] = ParamSlot(name, shape, offset, aliases)
        offset += math.prod(shape)
    padded = padded_size(offset, world)
    whole = dataclasses.replace(u, slots=tuple(slots.values()), numel=offset, padded_numel=padded,
                                shard_numel=padded // world, ep=1)
    runs = [[(s.offset, s.offset + s.numel, slots[name].offset + shift) for s, name, shift in mine] for mine in placed]
    return whole, runs


def expert_places(sharding: Sharding) -> ExpertPlaces | None:
    """The expert units' places for a state's sharding; None without expert parallelism."""
    ep, plan = sharding.ep, sharding.plan
    if ep is None:
        return None
    runs, units = {}, []
    for u in plan.units:
        if u.is_expert:
            whole, runs[u.name] = _whole_unit(u, ep, plan.world_size)
            units.append(whole)
        else:
            units.append(u)
    return ExpertPlaces(dataclasses.replace(plan, units=tuple(units)), runs, ep.rank)


def check_ep_supported(state: TrainState, node_local: bool = False, optimizer: bool = True) -> None:
    """What a checkpoint of an expert-parallel state does not cover yet: one `CheckpointError`.
    `optimizer=False`: the weights only (`export_live`), wherever the optimizer state is."""
    from ..offload import is_nvme

    sh = state.sharding
    if sh.ep is None:
        return
    if optimizer and is_nvme(state):
        raise CheckpointError("checkpoints of an expert-parallel state with its optimizer on NVMe (offload_optimizer: "
                              "nvme) are not implemented yet: offload it to the CPU instead")
    if node_local:
        raise CheckpointError("a node-local save (checkpoint.use_node_local_storage) of an expert-parallel state is not "
                              "implemented yet: save to a directory every rank sees")
    prefixes = tuple(m + "." for m in sh.ep.modules)
    frozen = [n for n in sh.plan.frozen if n.startswith(prefixes)]
    frozen += [u.name for u in sh.plan.frozen_units if u.is_expert]
    if frozen:
        raise CheckpointError(f"checkpoints of frozen expert parameters under expert parallelism are not implemented "
                              f"yet ({frozen[:3]}): train the experts, or run at ep 1")


def ep_check_view(like: TrainState, places: ExpertPlaces) -> TrainState:
    """`like` as `check_model` compares it with a checkpoint: every expert of every layer, by the
    names and shapes of the whole model."""
    sh = like.sharding
    return like.replace(sharding=Sharding(places.whole, StateMesh(sh.comm), sh.device))


def stored_place(unit: UnitPlan, slot: ParamSlot, ep) -> tuple[tuple, int]:
    """(the stored shape of `slot`'s name, where this rank's elements start in it): an expert
    stacked with the other ep ranks' along dim 0 is this rank's rows of the whole tensor."""
    if ep is None or not unit.is_expert:
        return tuple(slot.shape), 0
    _, stacked = ep.renames[unit.module](slot.name[len(unit.module) + 1:], ep.rank)
    if not stacked:
        return tuple(slot.shape), 0
    return (slot.shape[0] * ep.size, *slot.shape[1:]), ep.rank * slot.numel
