"""Every DeepSpeed optimizer name as a chain of gradient transformations (`_transform.py`).

These are the definitions: `fnzero.optim.adamw(...)` and the others compute the same step with
fused kernels (torch's, fnzero's C kernels on the host, the NVMe store), and a property test
checks each against its chain in float64 (`tests/test_optim_chains.py`). A user's own chain runs
through `as_optimizer`.
"""

from __future__ import annotations

from typing import Any, Callable

from ._transform import (
    GradientTransformation, add_decayed_weights, chain, scale_by_adam, scale_by_bias_correction, scale_by_learning_rate,
    scale_by_lion, scale_by_lr_decay, scale_by_rss, scale_by_trust_ratio, trace,
)

__all__ = ["adam_chain", "adamw_chain", "sgd_chain", "adagrad_chain", "lamb_chain", "lion_chain", "CHAINS"]


def adam_chain(lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
               adam_w_mode: bool = True, bias_correction: bool = True, **ignored: Any) -> GradientTransformation:
    """Adam: decoupled weight decay after the direction (`adam_w_mode`, DeepSpeed's default), or
    an L2 penalty on the gradient before it."""
    b1, b2 = betas
    direction = scale_by_adam(b1, b2, eps, bias_correction)
    if adam_w_mode:
        return chain(direction, add_decayed_weights(weight_decay), scale_by_learning_rate(lr))
    return chain(add_decayed_weights(weight_decay), direction, scale_by_learning_rate(lr))


def adamw_chain(lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
                adam_w_mode: bool = True, bias_correction: bool = True, **ignored: Any) -> GradientTransformation:
    """AdamW: decoupled weight decay whatever `adam_w_mode` says (as DeepSpeed's AdamW type)."""
    return adam_chain(lr, betas, eps, weight_decay, True, bias_correction)


def sgd_chain(lr: float = 1e-3, momentum: float = 0.0, dampening: float = 0.0, weight_decay: float = 0.0,
              nesterov: bool = False, **ignored: Any) -> GradientTransformation:
    """SGD as torch.optim.SGD: L2 weight decay, torch's momentum buffer, the learning rate."""
    parts = [add_decayed_weights(weight_decay)]
    if momentum != 0.0:
        parts.append(trace(momentum, dampening, nesterov))
    return chain(*parts, scale_by_learning_rate(lr))


def adagrad_chain(lr: float = 1e-2, eps: float = 1e-10, weight_decay: float = 0.0, lr_decay: float = 0.0,
                  initial_accumulator_value: float = 0.0, **ignored: Any) -> GradientTransformation:
    """Adagrad as torch.optim.Adagrad: L2 weight decay, the root sum of squares, `lr_decay`."""
    return chain(add_decayed_weights(weight_decay), scale_by_rss(initial_accumulator_value, eps),
                 scale_by_lr_decay(lr_decay), scale_by_learning_rate(lr))


def lamb_chain(lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
               bias_correction: bool = True, max_coeff: float = 10.0, min_coeff: float = 0.01,
               eps_inside_sqrt: bool = False, **ignored: Any) -> GradientTransformation:
    """DeepSpeed's FusedLamb: the uncorrected Adam direction plus weight decay, scaled per tensor
    by the trust ratio, then by the bias correction and the learning rate."""
    b1, b2 = betas
    parts = [scale_by_adam(b1, b2, eps, bias_correction=False, eps_inside_sqrt=eps_inside_sqrt),
             add_decayed_weights(weight_decay), scale_by_trust_ratio(min_coeff, max_coeff)]
    if bias_correction:
        parts.append(scale_by_bias_correction(b1, b2))
    return chain(*parts, scale_by_learning_rate(lr))


def lion_chain(lr: float = 1e-4, betas=(0.9, 0.99), weight_decay: float = 0.0, **ignored: Any) -> GradientTransformation:
    """Lion: the sign of the interpolated momentum, decoupled weight decay, the learning rate."""
    b1, b2 = betas
    return chain(scale_by_lion(b1, b2), add_decayed_weights(weight_decay), scale_by_learning_rate(lr))


# Keyed by the lower-cased DeepSpeed optimizer type, as `_config.FACTORIES`.
CHAINS: dict[str, Callable[..., GradientTransformation]] = {
    "adam": adam_chain, "adamw": adamw_chain, "sgd": sgd_chain, "adagrad": adagrad_chain, "lamb": lamb_chain,
    "lion": lion_chain,
}
