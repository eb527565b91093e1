"""The optimizer state inside DeepSpeed's optimizer-states files (`specs/checkpoint-format.md`
§DeepSpeed, "Resuming in fnzero"): where each ZeRO layout keeps Adam's moments and step count.

ZeRO-1/2 and BF16_Optimizer: `base_optimizer_state` is the torch optimizer's `state_dict()`
(rigid, the default: `{"state": {g: {"step", "exp_avg", "exp_avg_sq"}}}`, each moment this rank's
whole partition, padding included) or, with `elastic_checkpoint`, a list of per-group dicts without
padding and the step in `base_optimizer_state_step` (stage_1_and_2.py `state_dict`). ZeRO-3:
`optimizer_state_dict["state"][i]`, laid out as `fp32_flat_groups[i]` (stage3.py `_rigid_state_dict`).
"""

from __future__ import annotations

import torch

from .._errors import CheckpointError

__all__ = ["MOMENTS", "flat_moment", "zero3_moments", "adam_step", "states_step", "as_count"]

MOMENTS = ("exp_avg", "exp_avg_sq")  # what Adam and AdamW keep per parameter (torch's names)


def _states(osd: dict, n: int, where: str) -> list[dict]:
    """Each group's torch optimizer state, rigid or elastic."""
    base = osd.get("base_optimizer_state")
    if isinstance(base, dict) and isinstance(base.get("state"), dict):
        states = [base["state"].get(g) for g in range(n)]
    elif isinstance(base, list):
        states = base
    else:
        raise CheckpointError(f"{where}: no 'base_optimizer_state' (the optimizer's moments) of a known layout")
    if len(states) != n or not all(isinstance(s, dict) for s in states):
        raise CheckpointError(f"{where}: 'base_optimizer_state' should hold one state per group ({n})")
    return states


def _moment(state: dict, tensor: str, where: str, what: str) -> torch.Tensor:
    m = state.get(tensor)
    if not isinstance(m, torch.Tensor) or m.dim() != 1:
        raise CheckpointError(f"{where}: {what} has no flat {tensor!r} (keys: {sorted(map(str, state))[:6]}); only "
                              "Adam and AdamW optimizer state is read")
    return m


def flat_moment(osd: dict, g: int, n: int, tensor: str, content: torch.Tensor, pad: int, where: str) -> torch.Tensor:
    """Group `g`'s moment `tensor` on this rank, cut to the elements `content` (its fp32 partition
    less the padding) holds: the moment keeps the padding (rigid) or not (elastic)."""
    m = _moment(_states(osd, n, where)[g], tensor, where, f"optimizer state of group {g}")
    if m.numel() not in (content.numel(), content.numel() + pad):
        raise CheckpointError(f"{where}: group {g}'s {tensor!r} holds {m.numel()} elements, its fp32 partition "
                              f"{content.numel()} (+{pad} padding)")
    return m[: content.numel()]


def zero3_moments(osd: dict, n: int, tensor: str, where: str) -> list[torch.Tensor]:
    inner = osd.get("optimizer_state_dict")
    state = inner.get("state") if isinstance(inner, dict) else None
    if not isinstance(state, dict) or any(not isinstance(state.get(i), dict) for i in range(n)):
        raise CheckpointError(f"{where}: 'optimizer_state_dict' holds no optimizer state for each of the {n} "
                              "sub-groups")
    return [_moment(state[i], tensor, where, f"optimizer state of sub-group {i}") for i in range(n)]


def as_count(v, where: str, what: str) -> int:
    if isinstance(v, torch.Tensor) and v.numel() == 1:
        v = v.item()
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    if type(v) is not int or v < 0:
        raise CheckpointError(f"{where}: {what} should be a step count, got {v!r}")
    return v


def adam_step(osd: dict, n: int, zero3: bool, where: str) -> int:
    """The Adam step count of this rank's optimizer state: every group's must agree."""
    if not zero3 and isinstance(osd.get("base_optimizer_state"), list):
        return as_count(osd.get("base_optimizer_state_step"), where, "'base_optimizer_state_step'")
    if zero3:
        states = [osd["optimizer_state_dict"]["state"][i] for i in range(n)]
    else:
        states = _states(osd, n, where)
    return states_step(dict(enumerate(states)), where, "group")


def states_step(states: dict, where: str, what: str) -> int:
    """The one step count of torch optimizer states `states` (index -> state): all must agree."""
    steps = {as_count(s.get("step"), where, f"{what} {i}'s 'step'") for i, s in states.items()}
    if len(steps) != 1:
        raise CheckpointError(f"{where}: the optimizer's {what}s are at different steps {sorted(steps)}")
    return steps.pop()
