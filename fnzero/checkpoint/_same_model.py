"""Whether a checkpoint holds the model a state is loaded into (`specs/checkpoint-format.md`
§Loading): names and shapes compared, every difference told at once, in the user's words.
"""

from __future__ import annotations

from .._errors import CheckpointError
from .._state import TrainState
from ._frozen import check_frozen
from ._tree import unit_meta

__all__ = ["check_model", "mismatch", "shape_of"]

_SHOWN = 4  # names quoted per kind of difference; the rest are counted


def shape_of(s) -> tuple | None:
    """A stored shape (a list, or None where none is stored) as a tuple to compare with a tensor's."""
    return tuple(s) if s is not None else None


def _slot_shapes(units) -> dict[str, tuple]:
    return {n: shape_of(s["shape"]) for u in units for s in u["slots"] for n in (s["name"], *s["aliases"])}


def check_model(ix: dict, like: TrainState, subset: bool = False, keep_frozen: bool = False) -> None:
    """Same trainable parameters (names, shapes), same frozen parameters (unless kept from
    `like`, or left out of the checkpoint) and buffers (but those registered `persistent=False`,
    which a checkpoint converted from DeepSpeed's does not hold), else one `CheckpointError` listing the
    differences. `subset`: the state may hold fewer parameters (a pipeline stage), none of
    another shape."""
    saved, mine = _slot_shapes(ix["units"]), _slot_shapes(unit_meta(like.sharding.plan))
    only_mine = [n for n in mine if n not in saved]
    only_saved = [] if subset else [n for n in saved if n not in mine]
    reshaped = [(n, mine[n], saved[n]) for n in mine if n in saved and saved[n] != mine[n]]
    frozen_missing, frozen_reshaped = check_frozen(ix, like, keep_frozen)
    only_mine += frozen_missing
    reshaped += frozen_reshaped
    transient = set(like.sharding.plan.saved.non_persistent)
    for n, t in like.buffers.items():
        e = ix["tensors"].get(f"buffers/{n}")
        if e is None and n not in transient:  # (a persistent=False buffer the checkpoint lacks keeps `like`'s)
            only_mine.append(f"{n} (buffer)")
        elif e is None:
            continue
        elif shape_of(e.get("shape")) != tuple(t.shape):
            reshaped.append((f"{n} (buffer)", tuple(t.shape), shape_of(e.get("shape"))))
    if only_mine or only_saved or reshaped:
        raise CheckpointError(describe(only_mine, only_saved, reshaped))


def _some(names: list[str]) -> str:
    quoted = ", ".join(repr(n) for n in names[:_SHOWN])
    return quoted + (f" and {len(names) - _SHOWN} more" if len(names) > _SHOWN else "")


def describe(only_mine: list[str], only_saved: list[str], reshaped: list[tuple]) -> str:
    """The message: what only the model has, what only the checkpoint has, what differs in shape."""
    parts = []
    if only_mine:
        parts.append(f"the model you are loading into has {len(only_mine)} tensor(s) the checkpoint does not: "
                     f"{_some(only_mine)}")
    if only_saved:
        parts.append(f"the checkpoint has {len(only_saved)} the model does not: {_some(only_saved)}")
    if reshaped:
        shown = "; ".join(f"{n!r} is {list(a)} in the model, {list(b)} in the checkpoint" for n, a, b in reshaped[:_SHOWN])
        more = f"; and {len(reshaped) - _SHOWN} more" if len(reshaped) > _SHOWN else ""
        parts.append(f"{len(reshaped)} differ in shape: {shown}{more}")
    hint = (" (the same model named otherwise? a pipeline's layers keep the model's names with "
            "PipelineModule(..., names_from=model))" if only_mine and only_saved else "")
    return "the checkpoint is of another model: " + "; ".join(parts) + hint


def mismatch(name: str, mine, saved) -> CheckpointError:
    """One tensor that differs (found while reading): absent (None) or of another shape."""
    if saved is None:
        return CheckpointError(describe([name], [], []))
    if mine is None:
        return CheckpointError(describe([], [name], []))
    return CheckpointError(describe([], [], [(name, tuple(mine), tuple(saved))]))
