"""Every DeepSpeed optimizer name as a chain of gradient transformations (`_transform.py`;
specs/optim.md §Chains). Called directly they declare no implementation and run their own arithmetic;
`chain_from_config` declares the fused kernels DeepSpeed runs for the name."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Callable

from fnzero._errors import ConfigError

from . import _validate as check
from ._base import Optimizer
from ._muon import ADAM_DEFAULT_LR, MUON_DEFAULT_LR, partition, scale_by_muon, uses_muon
from ._onebit_adam import onebit_adam
from ._onebit_common import chain_form
from ._onebit_lamb import onebit_lamb
from ._transform import (
    GradientTransformation, _named, add_decayed_weights, as_optimizer, chain, scale_by_adam, scale_by_bias_correction,
    scale_by_learning_rate, scale_by_lion, scale_by_lr_decay, scale_by_rss, scale_by_trust_ratio, trace,
)
from ._zero_one_adam import zero_one_adam

__all__ = ["adam_chain", "adamw_chain", "sgd_chain", "adagrad_chain", "lamb_chain", "lion_chain", "muon_chain", "muon",
           "onebit_adam_chain", "zero_one_adam_chain", "onebit_lamb_chain", "CHAINS"]


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


def muon_chain(lr: float | None = None, momentum: float = 0.95, weight_decay: float = 0.0, ns_method: str = "gram",
               betas=(0.9, 0.95), eps: float = 1e-10, adam_w_mode: bool = True, muon_lr: float | None = None,
               adam_lr: float | None = None, nesterov: bool = True, ns_steps: int = 5,
               adam_lr_ratio: float | None = None, select: Callable[[str, tuple[int, ...]], bool] = uses_muon,
               per_head_muon: bool = False, head_counts: Mapping[str, int] | None = None,
               **ignored: Any) -> GradientTransformation:
    """DeepSpeed's Muon with its auxiliary Adam, by DeepSpeed's config keys: for the parameters
    `select` chooses (`uses_muon`) `scale_by_muon → add_decayed_weights(weight_decay) → lr` at
    `muon_lr` (else `lr`, else 0.02); for the rest Adam (`adam_chain`: bias-corrected, decoupled
    decay unless `adam_w_mode` is false) at `adam_lr` (else `lr`, else 3e-4). A step's `lr=` extra
    (the schedule's) is Muon's; Adam's is it times `adam_lr_ratio` (default: Adam's lr over
    Muon's, so both follow the schedule in proportion). `per_head_muon`: the attention projections
    `head_counts` names (`muon_head_counts(model)`: name -> heads) are orthogonalised per head."""
    check.extra_kwargs("muon", ignored)
    if check.flag("muon", "per_head_muon", per_head_muon) and head_counts is None:
        raise ConfigError(
            "muon: per_head_muon=True needs the attention head counts, which come from the model: pass "
            "head_counts=fnzero.optim.muon_head_counts(model) (from a config: fnzero.optim.chain_from_config(cfg, "
            "head_counts=...) given as optimizer= to init_state and train_step)"
        )
    lr_muon = check.number("muon", "muon_lr", _first(muon_lr, lr, MUON_DEFAULT_LR))
    lr_adam = check.number("muon", "adam_lr", _first(adam_lr, lr, ADAM_DEFAULT_LR))
    if adam_lr_ratio is None:
        adam_lr_ratio = lr_adam / lr_muon if lr_muon > 0 else 1.0
    check.number("muon", "weight_decay", weight_decay)
    heads = head_counts if per_head_muon else None
    muon_half = chain(scale_by_muon(momentum, nesterov, ns_steps, ns_method, heads), add_decayed_weights(weight_decay),
                      scale_by_learning_rate(lr_muon))
    b1, b2 = check.betas("muon", betas)
    adam_half = adam_chain(lr_adam, (b1, b2), check.number("muon", "eps", eps), weight_decay,
                           check.flag("muon", "adam_w_mode", adam_w_mode), True)

    def adam_extra(extra: dict) -> dict:
        step_lr = extra.get("lr")
        return extra if step_lr is None else {**extra, "lr": step_lr * adam_lr_ratio}

    return partition(select, muon_half, adam_half, outside_extra=adam_extra)


def _first(*values):
    return next(v for v in values if v is not None)


def muon(**kwargs: Any) -> Optimizer:
    """`muon_chain(**kwargs)` as an `Optimizer` (`as_optimizer`): not elementwise, so at ZeRO stages
    1-3 the step runs its chain through the whole-matrix optimizer partition (specs/optim.md
    §Muon at ZeRO stages 1-3)."""
    return as_optimizer(muon_chain(**kwargs))


@_named
def onebit_adam_chain(**params: Any) -> GradientTransformation:
    """1-bit Adam (`onebit_adam(**params)`) as a chain that exchanges its own gradients."""
    return chain_form(onebit_adam(**params))


@_named
def zero_one_adam_chain(**params: Any) -> GradientTransformation:
    """0/1 Adam (`zero_one_adam(**params)`) as a chain that exchanges its own gradients."""
    return chain_form(zero_one_adam(**params))


@_named
def onebit_lamb_chain(**params: Any) -> GradientTransformation:
    """1-bit LAMB (`onebit_lamb(**params)`) as a chain that exchanges its own gradients."""
    return chain_form(onebit_lamb(**params))


# Keyed by the lower-cased DeepSpeed optimizer type (DeepSpeed matches names case-insensitively):
# the optimizers a config may name.
CHAINS: dict[str, Callable[..., GradientTransformation]] = {
    "adam": adam_chain, "adamw": adamw_chain, "sgd": sgd_chain, "adagrad": adagrad_chain, "lamb": lamb_chain,
    "lion": lion_chain, "muon": muon_chain, "onebitadam": onebit_adam_chain, "zerooneadam": zero_one_adam_chain,
    "onebitlamb": onebit_lamb_chain,
}
