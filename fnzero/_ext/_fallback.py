"""Pure-torch versions of the C kernels, with the same numbers.

Each follows the C loop operation by operation (fp32 multiplies and adds, no FMA, correctly
rounded sqrt and division) with the same float coefficients (`coefficients`), so it matches the
extension bit for bit in practice and always within the tested 1e-6. Used when the extension is
absent or disabled; it allocates temporaries, so it is slower, not different.
"""

from __future__ import annotations

import math
import struct

import torch

__all__ = ["f32", "adam_coefficients", "adam_step_", "adagrad_step_", "lion_step_"]


def f32(x: float) -> float:
    """Round a Python float to the nearest fp32 value (what the C side's (float) cast does)."""
    return struct.unpack("f", struct.pack("f", x))[0]


def adam_coefficients(step, lr, beta1, beta2, eps, weight_decay, adamw, bias_correction) -> dict:
    bc1 = 1.0 - math.pow(beta1, step) if bias_correction else 1.0
    bc2 = 1.0 - math.pow(beta2, step) if bias_correction else 1.0
    return {
        "l2": (not adamw) and weight_decay != 0.0,
        "wd": f32(weight_decay),
        "decay": f32(1.0 - lr * weight_decay) if adamw and weight_decay != 0.0 else 1.0,
        "omb1": f32(1.0 - beta1),
        "b2": f32(beta2),
        "omb2": f32(1.0 - beta2),
        "ibc": f32(1.0 / math.sqrt(bc2)),
        "eps": f32(eps),
        "nlr": f32(-lr / bc1),
    }


def _sqrt(t: torch.Tensor) -> torch.Tensor:
    """Correctly rounded fp32 sqrt, as the C kernels' sqrtf / vsqrtps. torch's own fp32 sqrt is
    not always (its vectorised CPU path was measured 1 ulp off on ~1/4 of the values), while a
    double sqrt rounded to fp32 is (53 >= 2*24 + 2 bits, so the double rounding is harmless)."""
    return t.double().sqrt_().float()


def _copy_out(p: torch.Tensor, out16: torch.Tensor | None) -> None:
    if out16 is not None:
        out16.copy_(p)  # torch's fp32 -> bf16/fp16 conversion rounds to nearest even


@torch.no_grad()
def adam_step_(p, g, m, v, *, step, lr, beta1, beta2, eps, weight_decay, adamw, bias_correction, grad_scale, out16):
    c = adam_coefficients(step, lr, beta1, beta2, eps, weight_decay, adamw, bias_correction)
    g = g * f32(grad_scale)
    if c["l2"]:
        g = g + p * c["wd"]
    p.mul_(c["decay"])
    m.add_((g - m).mul_(c["omb1"]))
    v.mul_(c["b2"]).add_((g * c["omb2"]).mul_(g))
    denom = _sqrt(v).mul_(c["ibc"]).add_(c["eps"])
    p.add_((m * c["nlr"]).div_(denom))
    _copy_out(p, out16)


@torch.no_grad()
def adagrad_step_(p, g, s, *, step, lr, lr_decay, eps, weight_decay, grad_scale, out16):
    nlr = f32(-lr / (1.0 + (step - 1) * lr_decay))
    g = g * f32(grad_scale)
    if weight_decay != 0.0:
        g = g + p * f32(weight_decay)
    s.add_(g * g)
    p.add_((g * nlr).div_(_sqrt(s).add_(f32(eps))))
    _copy_out(p, out16)


@torch.no_grad()
def lion_step_(p, g, m, *, lr, beta1, beta2, weight_decay, grad_scale, out16):
    g = g * f32(grad_scale)
    u = (m * f32(beta1)).add_(g * f32(1.0 - beta1)).sign_()
    if weight_decay != 0.0:
        p.mul_(f32(1.0 - lr * weight_decay))
    p.add_(u.mul_(f32(-lr)))
    m.mul_(f32(beta2)).add_(g * f32(1.0 - beta2))
    _copy_out(p, out16)
