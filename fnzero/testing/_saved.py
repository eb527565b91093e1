"""`count_saved_bytes`: what autograd keeps for backward inside a block, each storage once
(`specs/mesh.md` §Sequence memory measures the activation formulas with it).

    with ft.count_saved_bytes(exclude=model.parameters()) as saved:
        loss = loss_fn(model(x), y)
    saved.bytes, saved.tensors
"""

from __future__ import annotations

import contextlib
from typing import Iterable, Iterator

import torch

__all__ = ["SavedBytes", "count_saved_bytes"]


class SavedBytes:
    """Storages autograd saved inside a `count_saved_bytes` block: `bytes` in all, `tensors`
    (storage key -> (bytes, shape, dtype) of the first tensor seen on it)."""

    def __init__(self, exclude: set[int]):
        self._exclude = exclude
        self.tensors: dict[int, tuple[int, tuple[int, ...], torch.dtype]] = {}

    @property
    def bytes(self) -> int:
        return sum(n for n, _, _ in self.tensors.values())

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        try:
            storage = t.untyped_storage()
        except (RuntimeError, NotImplementedError):  # tensor subclasses without storage
            return t
        key = storage.data_ptr()
        # Views share their base's storage and count once; empty storages (checkpoint's dummy) are nothing.
        if storage.nbytes() and key not in self._exclude and key not in self.tensors:
            self.tensors[key] = (storage.nbytes(), tuple(t.shape), t.dtype)
        return t  # kept as it is: the count changes nothing autograd does


@contextlib.contextmanager
def count_saved_bytes(exclude: Iterable[torch.Tensor] = ()) -> Iterator[SavedBytes]:
    """Count the bytes of the tensors autograd saves for backward inside the block, each storage
    once, leaving out `exclude`'s storages (a model's parameters: model state, not activations).

    Only hooks that are innermost see a saved tensor: tensors saved inside a region with hooks of
    its own (an `fnzero.shard` module's apply, the inside of a checkpointed region) are not counted;
    a checkpoint's saved inputs are. Count a plain model's forward (`sp` routed on it by
    `fnzero.sharding.sp.split_for_sp`, as `fnzero.shard` does), not a sharded module's.
    """
    counter = SavedBytes({p.untyped_storage().data_ptr() for p in exclude})
    with torch.autograd.graph.saved_tensors_hooks(counter._pack, lambda t: t):
        yield counter
