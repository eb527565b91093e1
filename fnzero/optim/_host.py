"""Host implementations of the Adam, AdamW, Adagrad and Lion chains: fnzero's C kernels over flat
fp32 shards in host memory (ZeRO-Offload, `specs/offload.md`).

Each is an `Optimizer` like the device ones, with the same state layout (AdamState, AdagradState,
LionState), so checkpoints and resharding do not care where the step ran. Two step-level extras
are fused into the kernel's single pass over memory, passed as keywords like the chains' extras:

  grad_scale  multiplies the gradients first (the step's unscale x clip factor);
  out         {unit: tensor} receiving the new parameters (bf16/fp16 written by the kernel
              itself; fp32 or another device copied from the result).

The NVMe store (`fnzero.offload`) streams the same kernels through files with the same keywords
(`kernel_kwargs`). Checked against the chains by `tests/test_optim_chains.py`.
"""

from __future__ import annotations

from typing import Any

import torch

from .. import _ext
from .._errors import ConfigError
from ._adagrad import AdagradState
from ._adam import AdamState
from ._base import Optimizer, zeros_count
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
    >>> p, s = opt.update({"u": torch.ones(3)}, opt.init({"u": torch.ones(3)}), {"u": torch.ones(3)}, None,
    ...                   grad_scale=0.5)
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

    def update_(grads, opt_state, master, lr=None, *, momentum=None, grad_scale=1.0, out=None, **extra):
        step = int(opt_state.count) + 1
        kw = kernel_kwargs(kind, hyper, hyper["lr"] if lr is None else lr, momentum)
        for unit, p in master.items():
            g = grads[unit]
            if g.device != p.device or g.dtype != torch.float32:
                g = g.to(device=p.device, dtype=torch.float32)
            dst = out.get(unit) if out is not None else None
            # The kernel writes 16-bit copies on the host; other targets are filled after.
            fused = dst is not None and dst.device == p.device and dst.dtype in (torch.bfloat16, torch.float16)
            o16 = dst if fused else None
            if kind == "adam":
                _ext.adam_step_(p, g, opt_state.exp_avg[unit], opt_state.exp_avg_sq[unit], step=step,
                                grad_scale=grad_scale, out16=o16, **kw)  # fmt: skip
            elif kind == "adagrad":
                _ext.adagrad_step_(p, g, opt_state.sum[unit], step=step, grad_scale=grad_scale, out16=o16, **kw)
            else:
                _ext.lion_step_(p, g, opt_state.exp_avg[unit], grad_scale=grad_scale, out16=o16, **kw)
            if dst is not None and not fused:
                dst.copy_(p.to(dst.dtype), non_blocking=True)
        return master, opt_state._replace(count=torch.tensor(step, dtype=torch.int64))

    def update(grads, opt_state, master, lr=None, *, momentum=None, grad_scale=1.0, out=None, **extra):
        master = {k: v.clone() for k, v in master.items()}
        opt_state = type(opt_state)(*(_clone(x) for x in opt_state))
        return update_(grads, opt_state, master, lr, momentum=momentum, grad_scale=grad_scale, out=out)

    return Optimizer(init=init, update=update, update_=update_, elementwise=True, takes_extras=True)


def _clone(x):
    if isinstance(x, torch.Tensor):
        return x.clone()
    if isinstance(x, dict):
        return {k: v.clone() for k, v in x.items()}
    return x
