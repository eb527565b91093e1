"""A non-elementwise optimizer (Muon, a chain reading whole tensors) at ZeRO stages 1-3: the
whole-tensor optimizer partition (specs/optim.md §Muon at ZeRO stages 1-3): each parameter the chain
must see whole is gathered to its owning rank by one all-to-all, updated there, and returned to the
flat shards by a second."""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from .._errors import ShardingError
from ..optim import Optimizer, as_optimizer, routed_by_name, whole_tensor_names
from ..sharding import WholeTensorPartition, from_owners, param_pieces, to_owners, whole_tensor_partition, ShardPlan

__all__ = ["OwnerLayout", "owner_layout", "owner_tree", "owner_update"]


class OwnerLayout(NamedTuple):
    """What a non-elementwise optimizer runs as at stages 1-3."""

    optimizer: Optimizer  # its chain, each partition routed by name (`routed_by_name`)
    part: WholeTensorPartition  # who owns each parameter the chain needs whole


@functools.lru_cache(maxsize=8)
def owner_layout(plan: ShardPlan, opt: Optimizer) -> OwnerLayout:
    """The layout of `opt` (not elementwise) over `plan` (stages 1-3), the same on every rank; made
    once per plan and optimizer (the step asks for it at every step)."""
    tx = opt.transform
    if tx is None:
        raise ShardingError(
            "the optimizer is not elementwise (it reads whole tensors) and is a fused implementation without a chain of "
            "gradient transformations, so it cannot run on ZeRO stage 1-3 flat shards; use stage 0, or give a chain "
            "that declares no fused implementation (fnzero.optim.lamb_chain(...), say): its whole-tensor transforms "
            "run on each parameter's owning rank (specs/optim.md §Muon at ZeRO stages 1-3)"
        )
    shapes = {s.name: s.shape for u in plan.units for s in u.slots}
    _check_shapes(tx, shapes)
    names = frozenset(whole_tensor_names(tx, shapes))
    return OwnerLayout(as_optimizer(routed_by_name(tx, shapes)), whole_tensor_partition(plan, names))


def _check_shapes(tx, shapes) -> None:
    """`init` on shape-only tensors, on every rank alike: a parameter a transform refuses (a vector
    given to `scale_by_muon`) is a ConfigError everywhere, not on its owner alone. A user's `init`
    that reads values cannot run on shapes: its own checks then run on the owners only."""
    try:
        tx.init({n: torch.empty(s, device="meta") for n, s in shapes.items()})
    except (NotImplementedError, RuntimeError):  # a meta tensor has no values to read
        pass


def owner_tree(layout: OwnerLayout, comm, pieces: dict[str, torch.Tensor], *more: dict[str, torch.Tensor]):
    """The optimizer's trees from per-parameter pieces (`pieces` and any `more` of the same dtype):
    the owned whole tensors gathered, every other parameter's piece as it is."""
    part = layout.part
    like = next(iter(pieces.values()))
    trees = [pieces, *more]
    wholes = to_owners(comm, part, [{n: t[n] for n, _ in part.owners} for t in trees], like) if part.owners \
        else [{} for _ in trees]
    return [{**{n: p for n, p in t.items() if n not in part.owner_of}, **w} for t, w in zip(trees, wholes)]


def owner_update(plan: ShardPlan, layout: OwnerLayout, comm, grads: dict[str, torch.Tensor],
                 target: dict[str, torch.Tensor], opt_state, scalars) -> tuple[dict[str, torch.Tensor], object]:
    """The optimizer step over this rank's flat shards (`grads`, `target`: unit name -> shard of the
    same length) through the whole-tensor partition; returns (new shards, new state)."""
    rank = comm.rank
    values = param_pieces(plan, rank, target)
    gpieces = {n: g.to(values[n].dtype) if n in layout.part.owner_of else g
               for n, g in param_pieces(plan, rank, grads).items()}
    g_tree, p_tree = owner_tree(layout, comm, gpieces, values)
    new, new_state = layout.optimizer.update(g_tree, opt_state, p_tree, scalars.lr, momentum=scalars.momentum,
                                             global_norm=scalars.global_norm)
    owned = {n: new[n] for n in layout.part.owned(rank)}
    back = from_owners(comm, layout.part, owned, next(iter(values.values()))) if layout.part.owners else {}
    shards = {}
    for u in plan.units:
        lo, hi = u.real_range(rank)
        parts = [(back[s.name] if s.name in back else new[s.name]).reshape(-1) for s in u.slots
                 if min(hi, s.offset + s.numel) > max(lo, s.offset)]
        old = target[u.name]
        pad = old.numel() - (hi - lo)
        if pad:
            parts.append(old[old.numel() - pad:])
        shards[u.name] = torch.cat(parts).to(old.dtype) if parts else old.clone()
    return shards, new_state
