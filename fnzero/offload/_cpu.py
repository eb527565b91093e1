"""ZeRO-Offload: the optimizer step on the host, over this rank's fp32 master shard, through the C
kernels (`fnzero._ext`), with gradient unscaling, the clipping coefficient and the 16-bit copy-out
of the new parameters fused into the same pass (`specs/offload.md`).

The state layout is the one `fnzero.optim` uses (AdamState / AdagradState / LionState), so
checkpoints and resharding do not care whether a run offloaded.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from .. import _ext
from .._errors import ConfigError

__all__ = ["HostOptimizer", "host_optimizer_from_config"]

_KINDS = {"adam": "adam", "adamw": "adam", "adagrad": "adagrad", "lion": "lion"}


@dataclasses.dataclass(frozen=True)
class HostOptimizer:
    """A host (CPU) optimizer step over flat fp32 shards. `kind`: adam | adagrad | lion."""

    kind: str
    hyper: dict

    def kernel_kwargs(self, lr: float, momentum: float | None = None) -> dict:
        """The C kernel's hyper-parameter keywords for this step (the NVMe store takes the same)."""
        h = self.hyper
        if self.kind == "adam":
            return dict(lr=lr, beta1=h["betas"][0] if momentum is None else momentum, beta2=h["betas"][1],
                        eps=h["eps"], weight_decay=h["weight_decay"], adamw=h["adam_w_mode"],
                        bias_correction=h["bias_correction"])  # fmt: skip
        if self.kind == "adagrad":
            return dict(lr=lr, lr_decay=h["lr_decay"], eps=h["eps"], weight_decay=h["weight_decay"])
        return dict(lr=lr, beta1=h["betas"][0] if momentum is None else momentum, beta2=h["betas"][1],
                    weight_decay=h["weight_decay"])  # fmt: skip

    def update(self, grads: dict[str, torch.Tensor], opt_state: Any, master: dict[str, torch.Tensor], lr: float, *,
               momentum: float | None = None, grad_scale: float = 1.0, out: dict[str, torch.Tensor] | None = None,
               inplace: bool = False):
        """(new_master, new_opt_state). Pure unless `inplace`; `out[unit]` (16-bit or fp32, may live
        on another device) receives the new parameters."""
        if not inplace:
            master = {k: v.clone() for k, v in master.items()}
            opt_state = type(opt_state)(*(_clone_tree(x) for x in opt_state))
        step = int(opt_state.count) + 1
        h = self.hyper
        for unit, p in master.items():
            g = grads[unit]
            if g.device != p.device or g.dtype != torch.float32:
                g = g.to(device=p.device, dtype=torch.float32)
            dst = out.get(unit) if out is not None else None
            staged = None
            if dst is not None and (dst.device != p.device or dst.dtype == torch.float32):
                # The kernel writes 16-bit copies on the host; other targets are filled after.
                staged, dst = dst, None
            o16 = dst if dst is not None and dst.dtype in (torch.bfloat16, torch.float16) else None
            if self.kind == "adam":
                b1 = h["betas"][0] if momentum is None else momentum
                _ext.adam_step_(p, g, opt_state.exp_avg[unit], opt_state.exp_avg_sq[unit], step=step, lr=lr, beta1=b1,
                                beta2=h["betas"][1], eps=h["eps"], weight_decay=h["weight_decay"],
                                adamw=h["adam_w_mode"], bias_correction=h["bias_correction"], grad_scale=grad_scale,
                                out16=o16)  # fmt: skip
            elif self.kind == "adagrad":
                _ext.adagrad_step_(p, g, opt_state.sum[unit], step=step, lr=lr, lr_decay=h["lr_decay"], eps=h["eps"],
                                   weight_decay=h["weight_decay"], grad_scale=grad_scale, out16=o16)  # fmt: skip
            else:
                b1 = h["betas"][0] if momentum is None else momentum
                _ext.lion_step_(p, g, opt_state.exp_avg[unit], lr=lr, beta1=b1, beta2=h["betas"][1],
                                weight_decay=h["weight_decay"], grad_scale=grad_scale, out16=o16)  # fmt: skip
            if staged is not None:
                staged.copy_(p.to(staged.dtype), non_blocking=True)
        new_count = torch.tensor(step, dtype=torch.int64)
        return master, opt_state._replace(count=new_count)


def _clone_tree(x):
    if isinstance(x, torch.Tensor):
        return x.clone()
    if isinstance(x, dict):
        return {k: v.clone() for k, v in x.items()}
    return x


def host_optimizer_from_config(cfg) -> HostOptimizer:
    """The host optimizer for `cfg.optimizer` (Adam, AdamW, Adagrad, Lion); anything else is a
    ConfigError, since offloaded steps run through the fused C kernels."""
    opt = cfg.optimizer
    kind = _KINDS.get(opt.type.lower())
    if kind is None:
        raise ConfigError(
            f"zero_optimization.offload_optimizer runs the step through fnzero's CPU kernels, which implement "
            f"Adam, AdamW, Adagrad and Lion; optimizer.type is {opt.type!r}. Use one of those or remove the offload"
        )
    hyper = opt.params.model_dump()
    if opt.type.lower() == "adamw":
        hyper["adam_w_mode"] = True
    return HostOptimizer(kind, hyper)

