"""Muon's optimizer state per rank from the plan alone (specs/optim.md §Muon at ZeRO stages 1-3):
the momentum of the matrices the rank owns, whole, and Adam's two moments of its part of the rest."""

from __future__ import annotations

from typing import Callable

from ..optim import uses_muon
from ..sharding import whole_tensor_partition, ShardPlan

__all__ = ["muon_state_bytes"]


def muon_state_bytes(plan: ShardPlan, rank: int, itemsize: int = 4,
                     select: Callable[[str, tuple[int, ...]], bool] = uses_muon) -> int:
    """Bytes of the config's Muon state (`select`: its grouping) on dp rank `rank` of `plan`, at
    `itemsize` bytes per element (the master's: 4 in 16-bit training): at stage 0 every matrix's
    momentum and Adam's moments of every other parameter; at stages 1-3 the momentum of the matrices
    the whole-matrix partition gives `rank`, and the moments of its pieces of the others."""
    slots = [(u, s) for u in plan.units for s in u.slots]
    muon = frozenset(s.name for _, s in slots if select(s.name, s.shape))
    if not plan.placement.optimizer:
        matrices = sum(s.numel for _, s in slots if s.name in muon)
        return itemsize * (matrices + 2 * (plan.num_params - matrices))
    part = whole_tensor_partition(plan, muon)
    held = sum(min(hi, u.numel) - min(lo, u.numel) for u in plan.units for lo, hi in [u.shard_range(rank)])
    pieces = sum(part.piece(n, rank)[1] - part.piece(n, rank)[0] for n in muon)
    return itemsize * (part.load(rank) + 2 * (held - pieces))
