"""Build the schedule a fnzero Config names (the `scheduler` block, DeepSpeed's layout)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fnzero._errors import ConfigError
from fnzero.optim import DEFAULT_LR, HAS_BETAS, optimizer_kind, params_dict

from ._base import Schedule, constant
from ._one_cycle import lr_range_test, one_cycle
from ._warmup import warmup_cosine_lr, warmup_decay_lr, warmup_lr

__all__ = ["from_config"]

FACTORIES: dict[str, Callable[..., Schedule]] = {
    "warmuplr": warmup_lr,
    "warmupdecaylr": warmup_decay_lr,
    "warmupcosinelr": warmup_cosine_lr,
    "onecycle": one_cycle,
    "lrrangetest": lr_range_test,
}
CANONICAL = ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle", "LRRangeTest")


def _optimizer_values(cfg: Any) -> tuple[str | None, float | None, float | None]:
    """(optimizer kind, its lr, its beta1 or momentum), or Nones without an optimizer block."""
    if cfg.optimizer is None:
        return None, None, None
    kind = optimizer_kind(cfg)
    params = params_dict(cfg.optimizer.params)
    lr = params.get("muon_lr", params.get("lr", DEFAULT_LR[kind]))  # Muon: its own half's lr
    betas = params.get("betas", (0.9, 0.999) if kind != "lion" else (0.9, 0.99))
    mom = float(betas[0]) if kind in HAS_BETAS else None
    return kind, float(lr), mom


def from_config(cfg: Any) -> Schedule:
    """The schedule of ``cfg.scheduler`` (``type`` in any case, ``params``), given the
    optimizer's lr ``cfg.optimizer.params.lr``; without a scheduler, that lr held constant.

    OneCycle cycles momentum only for optimizers with betas (Adam, AdamW, Lamb, Lion), as
    DeepSpeed does; for SGD and Adagrad its ``momentum`` is None.

    >>> import fnzero
    >>> cfg = fnzero.load_config({"train_batch_size": 1, "optimizer": {"type": "AdamW", "params": {"lr": 0.1}},
    ...     "scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 10, "warmup_num_steps": 2}}})
    >>> s = from_config(cfg)
    >>> s(0), round(s(10), 8)
    (0.0, 1e-05)
    """
    kind, base_lr, base_mom = _optimizer_values(cfg)
    block = cfg.scheduler
    if block is None:
        if base_lr is None:
            raise ConfigError(
                "the config has neither a `scheduler` nor an `optimizer` block, so there is no learning rate; "
                'add e.g. "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}'
            )
        return constant(base_lr)
    name = str(block.type)
    factory = FACTORIES.get(name.lower())
    if factory is None:
        raise ConfigError(f"scheduler type {name!r} is not supported; use one of {', '.join(CANONICAL)}")
    params = params_dict(block.params)
    if factory is warmup_cosine_lr and base_lr is None:
        raise ConfigError("WarmupCosineLR scales the optimizer's lr, but the config has no `optimizer` block")
    extra: dict[str, Any] = {"base_lr": base_lr}
    if factory is one_cycle:
        extra["base_momentum"] = base_mom
        if kind is not None and kind not in HAS_BETAS:
            params["cycle_momentum"] = False
    if factory is warmup_lr and "warmup_max_lr" not in params and base_lr is None:
        extra.pop("base_lr")
    try:
        return factory(**params, **extra)
    except TypeError as e:  # an unknown or missing parameter name
        raise ConfigError(f"scheduler {name}: {e}") from None
