"""Loading by parameter name (`specs/checkpoint-format.md` §Loading by name): each parameter's
elements are found through its name in the checkpoint's units, the same range of every per-unit
tensor; no collective, and with tensor parallelism each parameter is read whole and cut.
"""

from __future__ import annotations

import math

import torch

from .._errors import CheckpointError
from .._state import TrainState
from . import _format as F
from ._ep import stored_place
from ._same_model import mismatch
from ._tree import Leaf

__all__ = ["saved_slots", "same_units", "fill_by_name", "stored_key"]


def saved_slots(ix: dict) -> dict[str, tuple[str, int, tuple]]:
    """Every stored parameter name (aliases too) -> (its unit, its offset there, its shape)."""
    out = {}
    for u in ix["units"]:
        for s in u["slots"]:
            for n in (s["name"], *s["aliases"]):
                out[n] = (u["name"], int(s["offset"]), tuple(s["shape"]))
    return out


def same_units(ix: dict, units: list[dict]) -> bool:
    """Whether the checkpoint groups the parameters into `units` (unit_meta) exactly."""
    key = lambda us: [(u["name"], u["numel"], [s["name"] for s in u["slots"]]) for u in us]  # noqa: E731
    return key(ix["units"]) == key(units)


def stored_key(keys: dict, key: str, dtype: torch.dtype) -> str:
    """The stored tensor that fills `key` (a unit's params, master or optimizer field) of a state
    in `dtype`: master weights and params stand in for each other across precisions
    (`specs/checkpoint-format.md` §Loading). `key` itself when no stand-in applies, stored or not."""
    top, _, rest = key.partition("/")
    if top == "params":
        if key in keys and F.DTYPES[keys[key]["dtype"]] == dtype:
            return key
        if f"master/{rest}" in keys:
            return f"master/{rest}"
    if top == "master" and key not in keys and f"params/{rest}" in keys:
        return f"params/{rest}"
    return key


def fill_by_name(leaf: Leaf, like: TrainState, reader, slots: dict, out: torch.Tensor, tp=None, fplan=None,
                 ep=None) -> torch.Tensor:
    """Fill `out` (flat: `leaf`'s elements of its unit) slot by slot from the stored units that
    hold each parameter's name. With `tp` (a TPLayout, `fplan` its whole-shape plan), each
    parameter is read whole and cut to this rank's slice. With `ep` (an EPLayout), an expert
    tensor stacked over the ep ranks is read at this rank's rows (`_ep.stored_place`)."""
    u = like.sharding.plan.unit(leaf.unit)
    fu = fplan.unit(leaf.unit) if fplan is not None else u
    top, _, rest = leaf.key.partition("/")
    field = rest[: len(rest) - len(leaf.unit)]  # "exp_avg/" of "opt_state/exp_avg/U"
    per_param = leaf.path.rpartition("/")[2] != leaf.unit
    out.zero_()  # padding stays zero
    for s, fs in zip(u.slots, fu.slots):
        a, b = max(leaf.lo, s.offset), min(leaf.hi, s.offset + s.numel)
        if a >= b or (per_param and s.offset != leaf.lo):
            continue
        hit = next((slots[n] for n in (s.name, *s.aliases) if n in slots), None)
        whole_shape, rows = stored_place(u, fs, ep)
        if hit is None or hit[2] != whole_shape:
            raise mismatch(s.name, whole_shape, None if hit is None else hit[2])
        unit, offset, shape = hit
        offset += rows
        key = stored_key(reader.tensors, f"{top}/{field}{unit}", out.dtype)
        if key not in reader.tensors:
            raise CheckpointError(f"the checkpoint has no {key!r} (was it saved with another optimizer? checkpoint: "
                                  f"{reader.index.get('optimizer')})")
        split = tp.split_of(s.name, *s.aliases) if tp is not None else None
        if split is None:
            reader.read(key, offset + a - s.offset, offset + b - s.offset, out[a - leaf.lo: b - leaf.lo])
            continue
        full = torch.empty(math.prod(shape), dtype=out.dtype)
        reader.read(key, offset, offset + full.numel(), full)
        piece = split.local(full.view(shape), tp.rank).reshape(-1)
        out[a - leaf.lo: b - leaf.lo] = piece[a - s.offset: b - s.offset]
    return out
