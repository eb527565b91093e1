"""Which implementation runs an optimizer: the one lookup (specs/optim.md §Where an optimizer runs).

What an optimizer computes is a chain of gradient transformations; how it runs is an `Optimizer`
record. The implementation is chosen from what the optimizer is and where its state lives, never
from a type name:

* the config's optimizer block (`ConfigOptimizer`): DeepSpeed's fused kernels for its chain,
  torch's on the device or fnzero's C kernels on the host (ZeRO-Offload);
* a chain (`GradientTransformation`): its own arithmetic (`as_optimizer`), wherever it runs: a
  fused kernel rounds differently from a chain's computed-then-added updates, so a chain is never
  silently replaced by one;
* an `Optimizer`: already an implementation, run as it is.

Streaming through NVMe files wraps whichever was chosen (`fnzero.offload.nvme_optimizer`), above
this package.
"""

from __future__ import annotations

from typing import Any

from ._base import Optimizer
from ._config import ConfigOptimizer
from ._transform import GradientTransformation, as_optimizer

__all__ = ["implementation"]


def implementation(optimizer: Any, on_host: bool = False) -> Optimizer:
    """The `Optimizer` that runs `optimizer` (a `ConfigOptimizer`, a chain, or an `Optimizer`),
    with its state on the host (`on_host`: ZeRO-Offload's master) or on the device; a TypeError
    for anything else."""
    if isinstance(optimizer, ConfigOptimizer):
        return optimizer.implementation(on_host)
    if isinstance(optimizer, GradientTransformation):
        return as_optimizer(optimizer)
    if isinstance(optimizer, Optimizer):
        return optimizer
    raise TypeError(f"no implementation of a {type(optimizer).__name__}: give a fnzero.optim chain or Optimizer")
