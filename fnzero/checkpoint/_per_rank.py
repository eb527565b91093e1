"""Per-rank leaves on load (specs/checkpoint-format.md Coordinates): each rank's own tensors, under
`PER_RANK_FIELDS` of an optimizer state, read back only at the world size that saved them."""

from __future__ import annotations

import math

import torch

from .._errors import CheckpointError
from .._state import TrainState
from . import _format as F
from ._tree import Leaf

__all__ = ["read_per_rank_leaf"]


def read_per_rank_leaf(leaf: Leaf, ix: dict, like: TrainState, rd) -> torch.Tensor:
    """A rank's own leaf (`PER_RANK_FIELDS`: the 1-bit optimizers' compression errors), read whole,
    in the shape it was saved with: only at the world size that saved it, whose rank r held it."""
    world = like.sharding.world_size
    if ix["world_size"] != world:
        raise CheckpointError(
            f"{leaf.path}: each rank's own state (the compression errors of 1-bit Adam, 0/1 Adam and 1-bit LAMB) "
            f"was saved by {ix['world_size']} ranks and cannot be resharded to {world}: their padding and chunks "
            f"depend on the world size; load at {ix['world_size']} ranks")
    entry = rd.tensors.get(leaf.key)
    if entry is None:
        raise CheckpointError(f"the checkpoint has no {leaf.key!r} (rank {like.sharding.rank}'s {leaf.path}); was it "
                              f"saved with another optimizer (the checkpoint's: {ix.get('optimizer')})?")
    shape = tuple(entry["shape"])
    out = torch.empty(math.prod(shape), dtype=F.DTYPES[entry["dtype"]])
    rd.read(leaf.key, 0, out.numel(), out)
    return out.reshape(shape).to(device=leaf.tensor.device, dtype=leaf.tensor.dtype)
