"""The chain a fnzero Config names (the `optimizer` block, DeepSpeed's layout), with the
implementations DeepSpeed runs for it declared (`chain_from_config`)."""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

from fnzero._errors import ConfigError

from ._adagrad import adagrad
from ._adam import adam, adamw
from ._base import Optimizer
from ._chains import CHAINS
from ._host import host_optimizer
from ._implement import implementation
from ._transform import GradientTransformation, Implementations
from ._lamb import lamb
from ._lion import lion
from ._muon_heads import muon_head_counts
from ._sgd import sgd

__all__ = ["from_config", "chain_from_config", "host_from_config", "ConfigOptimizer", "config_optimizer", "needs_model"]

# The fused device implementation of each type that has one, keyed as `CHAINS` (Muon's is its
# chain's own arithmetic; a 1-bit chain declares its own). These factories also check every value,
# which the chains of these types do not.
_FUSED: dict[str, Callable[..., Optimizer]] = {
    "adam": adam, "adamw": adamw, "sgd": sgd, "adagrad": adagrad, "lamb": lamb, "lion": lion,
}
CANONICAL = ("Adam", "AdamW", "SGD", "Adagrad", "Lamb", "Lion", "Muon", "OneBitAdam", "ZeroOneAdam", "OneBitLamb")
# The lr each factory uses when a config gives none; schedules need it too (WarmupCosineLR
# scales it, and it is the constant lr when there is no scheduler).
DEFAULT_LR: dict[str, float] = {"adam": 1e-3, "adamw": 1e-3, "sgd": 1e-3, "adagrad": 1e-2, "lamb": 1e-3, "lion": 1e-4,
                             "muon": 0.02, "onebitadam": 1e-3, "zerooneadam": 1e-3, "onebitlamb": 1e-3}
# Optimizers whose torch/DeepSpeed class has `betas`; DeepSpeed's OneCycle only cycles momentum
# for these and logs that it disabled cycle_momentum for the others (SGD, Adagrad).
HAS_BETAS = frozenset({"adam", "adamw", "lamb", "lion", "onebitadam", "zerooneadam", "onebitlamb"})


def params_dict(params: Any) -> dict[str, Any]:
    """A `params` block as keyword arguments: a pydantic model (model_dump) or a mapping.
    Keys set to None mean "not given", so the factory's own default applies."""
    if params is None:
        return {}
    if hasattr(params, "model_dump"):
        raw = params.model_dump()
    elif isinstance(params, Mapping):
        raw = dict(params)
    else:
        raise ConfigError(f"`params` must be a mapping or a pydantic model, got {type(params).__name__}")
    return {k: v for k, v in raw.items() if v is not None}


def optimizer_kind(cfg: Any) -> str:
    """The lower-cased optimizer type of `cfg`, checked."""
    block = cfg.optimizer
    if block is None:
        raise ConfigError(
            'the config has no `optimizer` block; add one, e.g. "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}'
        )
    kind = str(block.type).lower()
    if kind not in CHAINS:
        raise ConfigError(f"optimizer type {block.type!r} is not supported; use one of {', '.join(CANONICAL)}")
    return kind


# DeepSpeed schedulers that scale each param group's own lr; the others set every group's lr to
# the same absolute value (runtime/lr_schedules.py `_format_param`), Muon's two halves included.
_SCALING_SCHEDULERS = frozenset({"warmupcosinelr"})


def _params(cfg: Any, kind: str, head_counts: Mapping[str, int] | None = None) -> dict[str, Any]:
    """The factory's keyword arguments: the `params` block, and for Muon how its Adam half follows
    the schedule (in proportion, or at the schedule's lr itself as DeepSpeed's absolute schedulers)
    and `head_counts` (per_head_muon's, from the model: `muon_head_counts`)."""
    params = params_dict(cfg.optimizer.params)
    if head_counts is not None:
        if kind != "muon":
            raise ConfigError(f"head_counts= is for optimizer type Muon with per_head_muon, not {cfg.optimizer.type}")
        params["head_counts"] = head_counts
    sched = getattr(cfg, "scheduler", None)
    if kind == "muon" and sched is not None and str(sched.type).lower() not in _SCALING_SCHEDULERS:
        params["adam_lr_ratio"] = 1.0
    return params


class ConfigOptimizer(NamedTuple):
    """A config's `optimizer` block as one model needs it: the `config` and the facts of the model
    its optimizer reads (`head_counts`: per_head_muon's, resolved from the model by
    `config_optimizer`; None where the optimizer reads none). Not an optimizer itself: `chain()`
    is the config's chain. `fnzero.shard` keeps it with the state's sharding, so whoever builds
    the optimizer (`init_state`, the step) never asks which type needs what; `for_config` carries
    the same model's facts to another config's block."""

    config: Any
    head_counts: Mapping[str, int] | None = None

    def for_config(self, cfg: Any) -> "ConfigOptimizer":
        """The same model's facts for `cfg`'s optimizer block (a step may run another config)."""
        return ConfigOptimizer(cfg, self.head_counts if needs_model(cfg) else None)

    def chain(self) -> GradientTransformation:
        """The block's chain with its implementations declared (`chain_from_config`)."""
        return chain_from_config(self.config, self.head_counts)


def needs_model(cfg: Any) -> bool:
    """Whether the optimizer of `cfg` reads facts of the model, so that it can only be built once
    the model is known (`config_optimizer`): Muon with `per_head_muon` orthogonalises per head."""
    opt = getattr(cfg, "optimizer", None)
    return opt is not None and optimizer_kind(cfg) == "muon" and bool(getattr(opt.params, "per_head_muon", False))


def config_optimizer(cfg: Any, model: Any) -> ConfigOptimizer | None:
    """`cfg`'s optimizer block with the facts of `model` it reads: `muon_head_counts(model)` for
    Muon with `per_head_muon` (its ConfigError when the model's heads cannot be resolved); None
    without an optimizer block."""
    if getattr(cfg, "optimizer", None) is None:
        return None
    return ConfigOptimizer(cfg, muon_head_counts(model) if needs_model(cfg) else None)


def chain_from_config(cfg: Any, head_counts: Mapping[str, int] | None = None) -> GradientTransformation:
    """The chain of gradient transformations that ``cfg.optimizer`` names: its ``type`` (any case)
    and ``params`` (Muon's ``per_head_muon`` takes ``head_counts=fnzero.optim.muon_head_counts(model)``),
    declaring the implementations DeepSpeed runs for that name (`implementation` reads them): the
    fused kernels on the device (Muon: none, its chain's own arithmetic; 1-bit: their step), and
    fnzero's C kernels on the host (ZeRO-Offload; a ConfigError for a type none computes).

    >>> import fnzero
    >>> cfg = fnzero.load_config({"train_batch_size": 1, "optimizer": {"type": "Lamb", "params": {"lr": 1e-3}}})
    >>> chain_from_config(cfg).elementwise
    False
    """
    kind = optimizer_kind(cfg)
    params = _params(cfg, kind, head_counts)
    fused = _FUSED[kind](**params) if kind in _FUSED else None  # first: its checks of every value
    tx = CHAINS[kind](**params)
    declared = tx.implementations or Implementations()
    device = declared.device if fused is None else (lambda: fused)
    host = functools.partial(host_optimizer, cfg.optimizer.type, **params)
    return tx._replace(implementations=Implementations(device, host))


def from_config(cfg: Any, head_counts: Mapping[str, int] | None = None) -> Optimizer:
    """The device implementation of ``cfg.optimizer``'s chain (`chain_from_config`).

    >>> import fnzero
    >>> cfg = fnzero.load_config({"train_batch_size": 1,
    ...                           "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "weight_decay": 0.01}}})
    >>> from_config(cfg).elementwise
    True
    """
    return implementation(chain_from_config(cfg, head_counts))


def host_from_config(cfg: Any) -> Optimizer:
    """The host implementation (fnzero's C kernels over flat fp32 shards: ZeRO-Offload) of
    ``cfg.optimizer``'s chain; a ConfigError for a type no host kernel computes (SGD, Lamb).

    >>> import fnzero
    >>> cfg = fnzero.load_config({"train_batch_size": 1, "optimizer": {"type": "Lion", "params": {"lr": 1e-4}}})
    >>> host_from_config(cfg).elementwise
    True
    """
    return implementation(chain_from_config(cfg), on_host=True)
