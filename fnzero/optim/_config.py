"""Build the optimizer a fnzero Config names (the `optimizer` block, DeepSpeed's layout)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

from fnzero._errors import ConfigError

from ._adagrad import adagrad
from ._adam import adam, adamw
from ._base import Optimizer
from ._chains import CHAINS, muon
from ._host import host_optimizer
from ._transform import GradientTransformation
from ._lamb import lamb
from ._lion import lion
from ._muon_heads import muon_head_counts
from ._sgd import sgd
from ._onebit_adam import onebit_adam
from ._onebit_lamb import onebit_lamb
from ._zero_one_adam import zero_one_adam

__all__ = ["from_config", "chain_from_config", "host_from_config", "ConfigOptimizer", "config_optimizer", "needs_model"]

# Keyed by the lower-cased type: DeepSpeed matches optimizer names case-insensitively.
FACTORIES: dict[str, Callable[..., Optimizer]] = {
    "adam": adam, "adamw": adamw, "sgd": sgd, "adagrad": adagrad, "lamb": lamb, "lion": lion, "muon": muon,
    "onebitadam": onebit_adam, "zerooneadam": zero_one_adam, "onebitlamb": onebit_lamb,
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
    if kind not in FACTORIES:
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
    `config_optimizer`; None where the optimizer reads none). `fnzero.shard` keeps it with the
    state's sharding, so whoever builds the optimizer (`init_state`, the step) never asks which
    type needs what; `for_config` carries the same model's facts to another config's block."""

    config: Any
    head_counts: Mapping[str, int] | None = None

    def for_config(self, cfg: Any) -> "ConfigOptimizer":
        """The same model's facts for `cfg`'s optimizer block (a step may run another config)."""
        return ConfigOptimizer(cfg, self.head_counts if _needs_heads(cfg) else None)

    def implementation(self, on_host: bool) -> Optimizer:
        """The fused implementation of this block: torch's kernels on the device (`from_config`),
        or fnzero's C kernels on the host (`host_from_config`: ZeRO-Offload)."""
        return host_from_config(self.config) if on_host else from_config(self.config, self.head_counts)


def _needs_heads(cfg: Any) -> bool:
    """The block is Muon with `per_head_muon`: its optimizer orthogonalises per attention head."""
    opt = getattr(cfg, "optimizer", None)
    return opt is not None and optimizer_kind(cfg) == "muon" and bool(getattr(opt.params, "per_head_muon", False))


def needs_model(cfg: Any) -> bool:
    """Whether the optimizer of `cfg` reads facts of the model (per_head_muon's heads), so that it
    can only be built once the model is known (`config_optimizer`)."""
    return _needs_heads(cfg)


def config_optimizer(cfg: Any, model: Any) -> ConfigOptimizer | None:
    """`cfg`'s optimizer block with the facts of `model` it reads: `muon_head_counts(model)` for
    Muon with `per_head_muon` (its ConfigError when the model's heads cannot be resolved); None
    without an optimizer block."""
    if getattr(cfg, "optimizer", None) is None:
        return None
    return ConfigOptimizer(cfg, muon_head_counts(model) if _needs_heads(cfg) else None)


def from_config(cfg: Any, head_counts: Mapping[str, int] | None = None) -> Optimizer:
    """The optimizer of ``cfg.optimizer``: its ``type`` (any case) and ``params`` (Muon's
    ``per_head_muon`` takes ``head_counts=fnzero.optim.muon_head_counts(model)``).

    >>> import fnzero
    >>> cfg = fnzero.load_config({"train_batch_size": 1,
    ...                           "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "weight_decay": 0.01}}})
    >>> from_config(cfg).elementwise
    True
    """
    kind = optimizer_kind(cfg)
    return FACTORIES[kind](**_params(cfg, kind, head_counts))


def chain_from_config(cfg: Any, head_counts: Mapping[str, int] | None = None) -> GradientTransformation:
    """The chain of gradient transformations that ``cfg.optimizer`` names, with its ``params``
    (and Muon's ``head_counts``, as `from_config`): the definition the fused optimizer of
    `from_config` computes.

    >>> import fnzero
    >>> cfg = fnzero.load_config({"train_batch_size": 1, "optimizer": {"type": "Lamb", "params": {"lr": 1e-3}}})
    >>> chain_from_config(cfg).elementwise
    False
    """
    kind = optimizer_kind(cfg)
    FACTORIES[kind](**_params(cfg, kind, head_counts))  # the same checks of every value
    if kind not in CHAINS:
        raise ConfigError(f"optimizer type {cfg.optimizer.type} exchanges its momentum itself and has no chain; "
                          "build it with from_config (specs/optim.md §1-bit optimizers)")
    return CHAINS[kind](**_params(cfg, kind, head_counts))


def host_from_config(cfg: Any) -> Optimizer:
    """The host implementation (fnzero's C kernels over flat fp32 shards: ZeRO-Offload) of
    ``cfg.optimizer``; a ConfigError for a type no host kernel computes (SGD, Lamb).

    >>> import fnzero
    >>> cfg = fnzero.load_config({"train_batch_size": 1, "optimizer": {"type": "Lion", "params": {"lr": 1e-4}}})
    >>> host_from_config(cfg).elementwise
    True
    """
    kind = optimizer_kind(cfg)
    params = params_dict(cfg.optimizer.params)
    FACTORIES[kind](**params)  # the same checks of every value
    return host_optimizer(cfg.optimizer.type, **params)
