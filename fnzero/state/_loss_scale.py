"""fp16 dynamic loss scaling as a pure state machine, with DeepSpeed's DynamicLossScaler rules
(`specs/loss-scaling.md`)."""

from __future__ import annotations

import torch

from ._policy import LossScalePolicy
from .._state import LossScaleState

__all__ = ["init_loss_scale", "update_loss_scale"]


def _scalar(v, dtype):
    return torch.tensor(v, dtype=dtype)


def init_loss_scale(policy: LossScalePolicy | None) -> LossScaleState | None:
    if policy is None:
        return None
    scale = policy.static_scale if not policy.dynamic else 2.0 ** policy.initial_scale_power
    return LossScaleState(
        scale=_scalar(float(scale), torch.float64),
        good_steps=_scalar(0, torch.int64),
        hysteresis=_scalar(policy.hysteresis, torch.int64),
    )


def update_loss_scale(state: LossScaleState, overflow: bool, policy: LossScalePolicy) -> LossScaleState:
    """The loss-scale state after a step that did (`overflow=True`) or did not overflow."""
    if not policy.dynamic:
        return state
    scale = float(state.scale)
    good = int(state.good_steps)
    hyst = int(state.hysteresis)
    if overflow:
        if policy.hysteresis == 1 or hyst == 1:
            scale = max(scale / 2.0, policy.min_scale)
        else:
            hyst -= 1
        good = 0
    else:
        if policy.consecutive_hysteresis:
            hyst = policy.hysteresis
        # DeepSpeed 0.19.8's `stable_interval`: the clean steps before this one since the last
        # overflow (or the start); a positive multiple of the window raises the scale.
        if good > 0 and good % policy.window == 0:
            if not policy.consecutive_hysteresis:
                hyst = policy.hysteresis
            scale *= 2.0
        good += 1
    return LossScaleState(
        scale=_scalar(scale, torch.float64), good_steps=_scalar(good, torch.int64), hysteresis=_scalar(hyst, torch.int64)
    )
