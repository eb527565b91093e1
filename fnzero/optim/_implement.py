"""Which implementation runs an optimizer: the one lookup (specs/optim.md §Where an optimizer runs).

What an optimizer computes is a chain of gradient transformations; how it runs is an `Optimizer`
record. The implementation is read from what the chain declares and where its state lives, never
from a type name:

* a chain that declares `implementations` (the config's chain, `chain_from_config`: DeepSpeed's
  fused kernels, torch's on the device or fnzero's C kernels on the host; a 1-bit chain: its
  fused step) runs the one declared for where its state is;
* a chain that declares none there (a user's own, `adamw_chain(...)` called directly, Muon's
  chain) runs its own arithmetic (`as_optimizer`): a fused kernel rounds differently from a
  chain's computed-then-added updates, so a chain is never silently replaced by one;
* an `Optimizer`: already an implementation, run as it is.

Streaming through NVMe files wraps whichever was chosen (`fnzero.offload.nvme_optimizer`), above
this package.
"""

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
