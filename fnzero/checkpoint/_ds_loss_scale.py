"""DeepSpeed's fp16 loss scaler as fnzero's `LossScaleState` (`specs/checkpoint-format.md`
§DeepSpeed, "Resuming in fnzero"; `specs/loss-scaling.md`).

A ZeRO optimizer's state dict holds its `loss_scaler` (`LossScaler`, static, or `DynamicLossScaler`,
read as `LossScalerState`). DeepSpeed resumes with the saved scaler whatever the new config says,
so fnzero maps it such that its next raise, cut and hysteresis are DeepSpeed's: `scale` is
`cur_scale`; `good_steps`, the clean steps since the last overflow (or the start), is DeepSpeed's
`cur_iter - last_overflow_iter - 1` (its `stable_interval` for the next step); `hysteresis` is
`cur_hysteresis`. fnzero's rules (window, hysteresis, floor) come from the config the step is
given, so a config passed to `load` is checked against the scaler's own and a difference refused.
"""

from __future__ import annotations

import torch

from .._errors import CheckpointError
from .._state import LossScaleState, TrainState
from ._ds_pickle import LossScalerState

__all__ = ["ds_loss_scale"]

# The scaler's field -> (the fp16 config key fnzero's step reads it from, DeepSpeed's name for it).
_DYNAMIC_RULES = (("scale_window", "loss_scale_window"), ("delayed_shift", "hysteresis"),
                  ("consecutive_hysteresis", "consecutive_hysteresis"), ("min_scale", "min_loss_scale"))


def ds_loss_scale(where: str, osd: dict, like: TrainState, config=None) -> LossScaleState | None:
    """The loss-scale state the fp16 checkpoint's optimizer state dict `osd` (read from `where`)
    resumes, laid out as `like.loss_scale`; None when `like` has no loss scale (an fp32 or bf16
    state: the fp32 master weights are read, the scale has no counterpart)."""
    if like.loss_scale is None:
        return None
    s = osd.get("loss_scaler")
    if not isinstance(s, LossScalerState):
        raise CheckpointError(f"{where}: an fp16 checkpoint without its 'loss_scaler' (DeepSpeed's LossScaler or "
                              f"DynamicLossScaler); found {type(s).__name__}")
    dynamic = _field(s, "dynamic", bool, where)
    scale = float(_field(s, "cur_scale", (int, float), where))
    if config is not None:
        _check_policy(s, dynamic, scale, config, where)
    like_ls = like.loss_scale
    if not dynamic:
        good, hyst = 0, int(like_ls.hysteresis)
    else:
        if float(_field(s, "scale_factor", (int, float), where)) != 2.0:
            raise CheckpointError(f"{where}: the loss scaler's scale_factor is {s.get('scale_factor')}; fnzero "
                                  "raises and cuts the scale by 2, as DeepSpeed's config does")
        cur_iter, last = _field(s, "cur_iter", int, where), _field(s, "last_overflow_iter", int, where)
        good, hyst = cur_iter - last - 1, _field(s, "cur_hysteresis", int, where)
        if good < 0 or hyst < 0:
            raise CheckpointError(f"{where}: the loss scaler's cur_iter {cur_iter}, last_overflow_iter {last} "
                                  f"and cur_hysteresis {hyst} are not a state DeepSpeed reaches")
    return LossScaleState(scale=torch.tensor(scale, dtype=like_ls.scale.dtype),
                          good_steps=torch.tensor(good, dtype=like_ls.good_steps.dtype),
                          hysteresis=torch.tensor(hyst, dtype=like_ls.hysteresis.dtype))


def _field(s: LossScalerState, name: str, types, where: str):
    v = s.get(name)
    if not (isinstance(v, bool) if types is bool else isinstance(v, types) and not isinstance(v, bool)):
        raise CheckpointError(f"{where}: the loss scaler's {name!r} is {v!r}; DeepSpeed writes a "
                              f"{getattr(types, '__name__', 'number')} there")
    return v


def _check_policy(s: LossScalerState, dynamic: bool, scale: float, config, where: str) -> None:
    """The config's fp16 block (which fnzero's step follows) is the scaler's own, else one error
    naming the key and both values: DeepSpeed would go on with the saved scaler's."""
    fp16 = getattr(config, "fp16", None)
    if fp16 is None or not fp16.enabled:
        raise CheckpointError(f"{where}: an fp16 checkpoint, and the config given has no fp16 block enabled")
    static = float(fp16.loss_scale) > 0
    if static == dynamic:
        saved = f"dynamic (DynamicLossScaler at {scale:g})" if dynamic else f"static (loss_scale {scale:g})"
        raise CheckpointError(f"{where}: the checkpoint's loss scale is {saved}, the config's fp16.loss_scale "
                              f"{fp16.loss_scale:g} is {'static' if static else 'dynamic'}; DeepSpeed resumes the "
                              "saved scaler's policy, so give a config whose fp16 block is the run's")
    if static:
        if float(fp16.loss_scale) != scale:
            raise CheckpointError(f"{where}: the checkpoint's static loss scale is {scale:g}, the config's "
                                  f"fp16.loss_scale {fp16.loss_scale:g}")
        return
    for field, key in _DYNAMIC_RULES:
        saved, mine = s.get(field), getattr(fp16, key)
        if saved is None or type(saved)(mine) != saved:
            raise CheckpointError(f"{where}: the checkpoint's loss scaler has {field} {saved!r}, the config's "
                                  f"fp16.{key} is {mine!r}; DeepSpeed resumes the saved scaler's, so give a "
                                  "config whose fp16 block is the run's")
