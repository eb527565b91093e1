"""Host implementations of the Adam, AdamW, Adagrad and Lion chains: fnzero's C kernels over flat
fp32 shards in host memory (ZeRO-Offload, `specs/offload.md`), with the device ones' calling
convention and state layout, so checkpoints and resharding do not care where the step ran."""

from __future__ import annotations

from typing import Any

import torch

from .._ext import adagrad_step_, adam_step_, lion_step_
from .._errors import ConfigError
from ._adagrad import AdagradState
from ._adam import AdamState
from ._base import Optimizer, pure, zeros_count
from ._lion import LionState

__all__ = ["HOST_KERNELS", "host_optimizer", "kernel_kwargs"]

# DeepSpeed optimizer type (lower case) -> the C kernel family that computes its chain.
HOST_KERNELS = {"adam": "adam", "adamw": "adam", "adagrad": "adagrad", "lion": "lion"}

# Each family's hyper-parameters and their defaults (those of fnzero.optim's device factories).
_DEFAULTS = {
    "adam": dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, adam_w_mode=True, bias_correction=True),
    "adagrad": dict(lr=1e-2, eps=1e-10, weight_decay=0.0, lr_decay=0.0, initial_accumulator_value=0.0),
    "lion": dict(lr=1e-4, betas=(0.9, 0.99), weight_decay=0.0),
}


def kernel_kwargs(kind: str, hyper: dict, lr: float, momentum: float | None = None) -> dict:
    """The C kernel's hyper-parameter keywords for one step of family `kind` (`momentum`, a
    OneCycle schedule's value, replaces beta1)."""
    h = hyper
    if kind == "adam":
        return dict(lr=lr, beta1=h["betas"][0] if momentum is None else momentum, beta2=h["betas"][1],
                    eps=h["eps"], weight_decay=h["weight_decay"], adamw=h["adam_w_mode"],
                    bias_correction=h["bias_correction"])  # fmt: skip
    if kind == "adagrad":
        return dict(lr=lr, lr_decay=h["lr_decay"], eps=h["eps"], weight_decay=h["weight_decay"])
    return dict(lr=lr, beta1=h["betas"][0] if momentum is None else momentum, beta2=h["betas"][1],
                weight_decay=h["weight_decay"])  # fmt: skip


def host_hyper(name: str, params: dict) -> tuple[str, dict]:
    """(kernel family, hyper-parameters with defaults filled) for DeepSpeed optimizer type `name`;
    a ConfigError for a type no host kernel computes."""
    kind = HOST_KERNELS.get(name.lower())
    if kind is None:
        raise ConfigError(
            f"zero_optimization.offload_optimizer runs the step through fnzero's CPU kernels, which implement "
            f"Adam, AdamW, Adagrad and Lion; optimizer.type is {name!r}. Use one of those or remove the offload"
        )
    hyper = dict(_DEFAULTS[kind])
    hyper.update({k: v for k, v in params.items() if k in hyper and v is not None})
    if name.lower() == "adamw":
        hyper["adam_w_mode"] = True  # DeepSpeed's AdamW type is decoupled whatever the flag says
    return kind, hyper


def host_optimizer(name: str, **params: Any) -> Optimizer:
    """The host implementation of optimizer type `name` (Adam, AdamW, Adagrad, Lion; any case)
    with `params` as in the config's `params` block.

    >>> import torch
    >>> opt = host_optimizer("AdamW", lr=0.1)
    >>> p, s = opt.update({"u": torch.ones(3)}, opt.init({"u": torch.ones(3)}), {"u": torch.ones(3)})
    >>> [round(x, 4) for x in p["u"].tolist()], int(s.count)
    ([0.9, 0.9, 0.9], 1)
    """
    kind, hyper = host_hyper(name, params)

    def init(master):
        zeros = lambda: {k: torch.zeros_like(v) for k, v in master.items()}  # noqa: E731
        if kind == "adam":
            return AdamState(zeros_count(), zeros(), zeros())
        if kind == "adagrad":
            acc = hyper["initial_accumulator_value"]
            return AdagradState(zeros_count(), {k: torch.full_like(v, acc) for k, v in master.items()})
        return LionState(zeros_count(), zeros())

    def update_(grads, opt_state, master, lr=None, *, momentum=None, **extras):
        step = int(opt_state.count) + 1
        kw = kernel_kwargs(kind, hyper, hyper["lr"] if lr is None else lr, momentum)
        for unit, p in master.items():
            g = grads[unit]
            if g.device != p.device or g.dtype != torch.float32:
                g = g.to(device=p.device, dtype=torch.float32)
            if kind == "adam":
                adam_step_(p, g, opt_state.exp_avg[unit], opt_state.exp_avg_sq[unit], step=step, **kw)
            elif kind == "adagrad":
                adagrad_step_(p, g, opt_state.sum[unit], step=step, **kw)
            else:
                lion_step_(p, g, opt_state.exp_avg[unit], **kw)
        opt_state.count.fill_(step)
        return master, opt_state

    return Optimizer(init=init, update=pure(update_), update_=update_, elementwise=True)
