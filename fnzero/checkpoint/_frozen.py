"""Frozen parameters in a checkpoint (`specs/checkpoint-format.md` §Frozen parameters): stored
whole by name (stages 0-2) or in stage 3's frozen units, and loaded by parameter name from either.
"""

from __future__ import annotations

import torch

from .._errors import CheckpointError
from .._state import TrainState
from ..sharding import is_placeholder
from ._tree import FROZEN, Leaf

__all__ = ["saved_frozen", "check_frozen", "fill_frozen"]


def saved_frozen(ix: dict) -> dict[str, tuple[str, int, tuple]]:
    """Every stored frozen parameter name (aliases too) -> (its stored tensor, the offset of its
    elements there, its shape)."""
    out = {}
    for u in ix.get("frozen_units", []):
        for s in u["slots"]:
            for n in (s["name"], *s["aliases"]):
                out[n] = (FROZEN + u["name"], int(s["offset"]), tuple(s["shape"]))
    for key, t in ix["tensors"].items():
        if key.startswith(FROZEN) and "unit" not in t:
            out[key[len(FROZEN):]] = (key, 0, tuple(t["shape"]))
    return out


def _mine(like: TrainState) -> dict[str, tuple]:
    """The state's frozen parameters' names and (whole) shapes."""
    plan = like.sharding.plan
    out = {n: tuple(like.frozen[n].shape) for n in plan.frozen}
    out.update({s.name: tuple(s.shape) for u in plan.frozen_units for s in u.slots})
    return out


def check_frozen(ix: dict, like: TrainState, keep: bool) -> tuple[list[str], list[tuple]]:
    """(the state's frozen parameters the checkpoint lacks, those of another shape there); none
    to compare when they are kept or the checkpoint left them out."""
    if keep or ix.get("frozen_excluded"):
        return [], []
    saved = saved_frozen(ix)
    missing, reshaped = [], []
    for n, shape in _mine(like).items():
        hit = saved.get(n)
        if hit is None:
            missing.append(f"{n} (frozen parameter)")
        elif hit[2] != shape:
            reshaped.append((f"{n} (frozen parameter)", shape, hit[2]))
    return missing, reshaped


def fill_frozen(leaf: Leaf, like: TrainState, reader, out: torch.Tensor, keep: bool, tp=None, fplan=None) -> torch.Tensor:
    """`leaf` (a frozen parameter by name, or a frozen unit's shard) read from the checkpoint by
    parameter name into `out` (flat), or `like`'s own values when `keep`. With `tp` (a TPLayout,
    `fplan` its whole-shape plan) a parameter is read whole and cut to this rank's slice."""
    if keep:  # (a placeholder's values are in its store already: `_load.py` writes nothing back)
        return leaf.tensor if is_placeholder(leaf.tensor) else out.copy_(leaf.tensor.detach().reshape(-1))
    if reader.index.get("frozen_excluded"):
        raise CheckpointError(
            f"the checkpoint {reader.dir!r} was saved without its frozen parameters (exclude_frozen_parameters=True), "
            f"and the state you are loading into needs {leaf.path!r}: build that state with its frozen weights from "
            "the base model (sm.init_state(pretrained=base)) and keep them with load(..., keep_frozen=True)"
        )
    saved = saved_frozen(reader.index)
    if leaf.unit is None:
        key, offset, _ = saved[leaf.path.partition("/")[2]]  # present: `check_frozen` ran first

        def read(_key, a, b, buf):
            return reader.read(key, offset + a, offset + b, buf)

        if tp is not None:
            from ._tp import fill_tp_leaf

            return fill_tp_leaf(leaf, like, fplan, read, leaf.key, out)
        return read(None, 0, out.numel(), out)
    unit = like.sharding.plan.frozen_unit(leaf.unit[len(FROZEN):])
    out.zero_()  # padding stays zero
    for s in unit.slots:
        a, b = max(leaf.lo, s.offset), min(leaf.hi, s.offset + s.numel)
        if a < b:
            key, offset, _ = next(saved[n] for n in (s.name, *s.aliases) if n in saved)
            reader.read(key, offset + a - s.offset, offset + b - s.offset, out[a - leaf.lo: b - leaf.lo])
    return out
