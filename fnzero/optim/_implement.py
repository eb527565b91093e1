"""Which implementation runs an optimizer: the one lookup, from what a chain declares and where its
state lives, never from a type name (specs/optim.md §Where an optimizer runs)."""

from __future__ import annotations

from typing import Any

from ._base import Optimizer
from ._transform import GradientTransformation, as_optimizer

__all__ = ["implementation"]


def implementation(optimizer: Any, on_host: bool = False) -> Optimizer:
    """The `Optimizer` that runs `optimizer` (a chain or an `Optimizer`), with its state on the host
    (`on_host`: ZeRO-Offload's master) or on the device; a TypeError for anything else."""
    if isinstance(optimizer, Optimizer):
        return optimizer
    if not isinstance(optimizer, GradientTransformation):
        raise TypeError(f"no implementation of a {type(optimizer).__name__}: give a fnzero.optim chain or Optimizer")
    declared = optimizer.implementations
    build = None if declared is None else declared.host if on_host else declared.device
    return as_optimizer(optimizer) if build is None else build()
