"""A TrainState as named leaves in unit coordinates: the vocabulary shared by save, load and export
(`specs/checkpoint-format.md` §Coordinates: unit, replicated and per-rank leaves, keys). A frozen
unit's buffer (stage 3) is a unit leaf of unit `frozen/NAME`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterator

import torch

from .._errors import CheckpointError
from ..sharding import ShardPlan
from .._state import TrainState

__all__ = ["Leaf", "state_leaves", "rebuild_state", "unit_meta", "units_by_key", "FROZEN", "per_rank_key",
           "slots_by_name"]

FROZEN = "frozen/"  # a frozen unit's name on disk and in `Leaf.unit`: FROZEN + its name


@dataclasses.dataclass
class Leaf:
    path: str
    key: str
    tensor: torch.Tensor
    unit: str | None = None  # None: replicated
    lo: int = 0  # unit leaves: tensor element i is unit element lo + i
    hi: int = 0
    # A leaf of one parameter (per-parameter optimizer state): that parameter's slot, which the
    # key covers whoever holds its elements; None: the key covers the whole unit.
    slot: tuple[int, int] | None = None
    held_alone: bool = False  # one rank holds these elements (the whole-tensor partition): it writes them all
    per_rank: bool = False  # this rank's own (key: path@rank<r>)


def per_rank_key(path: str, rank: int) -> str:
    return f"{path}@rank{rank}"


def _walk(obj: Any, path: str, per_rank: bool = False) -> Iterator[tuple[str, torch.Tensor, bool]]:
    if isinstance(obj, torch.Tensor):
        yield path, obj, per_rank
    elif obj is None:
        return
    elif isinstance(obj, tuple) and hasattr(obj, "_fields"):  # NamedTuple: field names are stable
        own = getattr(type(obj), "PER_RANK_FIELDS", ())
        for f in obj._fields:
            yield from _walk(getattr(obj, f), f"{path}/{f}", per_rank or f in own)
    elif isinstance(obj, dict):
        for k, v in obj.items():
            if not isinstance(k, str) or "/" in k:
                raise CheckpointError(f"{path}: dict key {k!r} must be a str without '/' to be checkpointed")
            yield from _walk(v, f"{path}/{k}", per_rank)
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from _walk(v, f"{path}/{i}", per_rank)
    else:
        raise CheckpointError(f"{path}: cannot checkpoint a {type(obj).__name__} inside the state")


def _rebuild(obj: Any, path: str, fn: Callable[[str, torch.Tensor, bool], torch.Tensor], per_rank: bool = False) -> Any:
    if isinstance(obj, torch.Tensor):
        return fn(path, obj, per_rank)
    if obj is None:
        return None
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        own = getattr(type(obj), "PER_RANK_FIELDS", ())
        return type(obj)(*[_rebuild(getattr(obj, f), f"{path}/{f}", fn, per_rank or f in own) for f in obj._fields])
    if isinstance(obj, dict):
        return type(obj)((k, _rebuild(v, f"{path}/{k}", fn, per_rank)) for k, v in obj.items())
    if isinstance(obj, (list, tuple)):
        return type(obj)(_rebuild(v, f"{path}/{i}", fn, per_rank) for i, v in enumerate(obj))
    raise CheckpointError(f"{path}: cannot checkpoint a {type(obj).__name__} inside the state")


_FIELDS = ("params", "master", "opt_state", "frozen", "buffers")


def units_by_key(plan: ShardPlan) -> dict:
    """Every unit by its name in `Leaf.unit` and on disk: trainable units by name, frozen ones as
    FROZEN + name."""
    return {**{u.name: u for u in plan.units}, **{FROZEN + u.name: u for u in plan.frozen_units}}


def _classify(plan: ShardPlan, rank: int, path: str, t: torch.Tensor, slots, per_rank: bool = False) -> Leaf:
    if per_rank:
        return Leaf(path, per_rank_key(path, rank), t, per_rank=True)
    top = path.split("/", 1)[0]
    prefix, _, last = path.rpartition("/")
    frozen_unit = plan.frozen_unit(last) if prefix == "frozen" else None
    if (top in ("frozen", "buffers") and frozen_unit is None) or not prefix:
        return Leaf(path, path, t)
    u = frozen_unit if frozen_unit is not None else plan.trainable_unit(last)
    name = FROZEN + last if frozen_unit is not None else last
    if u is not None and t.dim() == 1:
        if t.numel() == u.padded_numel:
            lo = 0
        elif t.numel() == u.shard_numel:
            lo = u.shard_range(rank)[0]  # (an expert unit's shards are its expert-data-parallel ranks')
        else:
            raise CheckpointError(
                f"{path}: {t.numel()} elements is neither unit {u.name!r}'s full buffer ({u.padded_numel}) "
                f"nor its shard ({u.shard_numel}); the state does not match its own plan"
            )
        return Leaf(path, path, t, name, lo, lo + t.numel())
    hit = slots.get(last)
    if hit is None:
        return Leaf(path, path, t)
    u, slot = hit
    whole = (slot.offset, slot.offset + slot.numel)
    sharded = u.placement.optimizer and top == "opt_state"
    if tuple(t.shape) == slot.shape:  # the parameter whole: replicated (stage 0), or its owner's (stages 1-3)
        return Leaf(path, f"{prefix}/{u.name}", t, u.name, *whole, slot=whole, held_alone=sharded)
    lo, hi = u.real_range(rank)
    a, b = max(lo, slot.offset), min(hi, whole[1])
    if sharded and t.dim() == 1 and t.numel() == max(0, b - a):  # this rank's piece of it (stages 1-3)
        a = a if a < b else slot.offset
        return Leaf(path, f"{prefix}/{u.name}", t, u.name, a, a + t.numel(), slot=whole, held_alone=True)
    return Leaf(path, path, t)


def slots_by_name(plan: ShardPlan) -> dict[str, tuple]:
    """Every trainable parameter's name (aliases too) -> (its unit, its slot)."""
    return {n: (u, s) for u in plan.units for s in u.slots for n in (s.name, *s.aliases)}


def state_leaves(state: TrainState) -> list[Leaf]:
    """Every tensor of `state` with its path, disk key and unit coordinates."""
    plan, rank = state.sharding.plan, state.sharding.rank
    slots = slots_by_name(plan)
    out = []
    for f in _FIELDS:
        for path, t, per_rank in _walk(getattr(state, f), f):
            out.append(_classify(plan, rank, path, t, slots, per_rank))
    return out


def rebuild_state(like: TrainState, fn: Callable[[Leaf], torch.Tensor], **changes) -> TrainState:
    """`like` with every tensor replaced by `fn(leaf)` (same structure, same sharding)."""
    plan, rank = like.sharding.plan, like.sharding.rank
    slots = slots_by_name(plan)
    new = {f: _rebuild(getattr(like, f), f, lambda p, t, per: fn(_classify(plan, rank, p, t, slots, per)))
           for f in _FIELDS}
    return like.replace(**new, **changes)


def unit_meta(plan: ShardPlan, frozen: bool = False) -> list[dict]:
    """The model's trainable-parameter layout as stored in the index (and compared at load); with
    `frozen`, its frozen units' (the index's `frozen_units`)."""
    return [
        {
            "name": u.name,
            "numel": u.numel,
            "slots": [{"name": s.name, "shape": list(s.shape), "offset": s.offset, "aliases": list(s.aliases)} for s in u.slots],
        }
        for u in (plan.frozen_units if frozen else plan.units)
    ]
