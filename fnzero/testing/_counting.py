"""`count_collectives`: record what a block of code sends, per op, in calls and bytes.

    with ft.count_collectives(sm) as c:
        state, _ = step(state, batch)
    c.calls("all_gather"), c.bytes("reduce_scatter"), c.ring_bytes()
"""

from __future__ import annotations

import contextlib
from collections import Counter
from typing import Any, Iterator

from ..sharding import CollectiveRecord, RecordingCollectives
from .._state import Sharding, TrainState

__all__ = ["count_collectives", "CollectiveCounter"]

_OPS = ("all_gather", "reduce_scatter", "all_reduce", "broadcast", "all_to_all", "send")


class CollectiveCounter:
    """Collectives recorded on this rank, in logical bytes (`specs/collectives.md` §Traffic)."""

    def __init__(self, comm: RecordingCollectives):
        self.comm = comm

    @property
    def records(self) -> list[CollectiveRecord]:
        return list(self.comm.records)

    def _select(self, op: str | None) -> list[CollectiveRecord]:
        if op is not None and op not in _OPS:
            raise ValueError(f"unknown collective {op!r}; one of {_OPS}")
        return [r for r in self.comm.records if op is None or r.op == op]

    def calls(self, op: str | None = None) -> int:
        """Number of calls of `op` (all ops when None)."""
        return len(self._select(op))

    def bytes(self, op: str | None = None) -> int:
        """Logical bytes of `op` (all ops when None)."""
        return sum(r.bytes for r in self._select(op))

    def ring_bytes(self, op: str | None = None) -> float:
        """Ring-equivalent bytes this rank sends: all_reduce x 2(N-1)/N, all_gather and
        reduce_scatter x (N-1)/N, broadcast and all_to_all x 1."""
        return self.comm.ring_bytes_sent(self._select(op))

    def ops(self) -> list[str]:
        """The ops in call order (compare sequences across stages or runs)."""
        return [r.op for r in self.comm.records]

    def summary(self) -> dict[str, tuple[int, int]]:
        """op -> (calls, bytes), for ops that were called."""
        calls, size = Counter(), Counter()
        for r in self.comm.records:
            calls[r.op] += 1
            size[r.op] += r.bytes
        return {op: (calls[op], size[op]) for op in calls}

    def __repr__(self) -> str:
        return f"CollectiveCounter(rank {self.comm.rank} of {self.comm.world_size}: {self.summary()})"


def _sharding_of(target: Any) -> Sharding | None:
    """The Sharding to patch: a TrainState's, a ShardedModule's, or `target` itself."""
    if isinstance(target, TrainState):
        return target.sharding
    if isinstance(target, Sharding):
        return target
    if hasattr(target, "sharding") and hasattr(target, "comm") and isinstance(target.sharding, Sharding):
        return target.sharding  # a ShardedModule
    return None


@contextlib.contextmanager
def count_collectives(target: Any) -> Iterator[CollectiveCounter]:
    """Count the collectives issued inside the block.

    target: a ShardedModule, a TrainState or a Sharding (its collectives, shared by every state the
    module built, are replaced by a recording wrapper for the block and put back after), or any
    Collectives (then use `counter.comm` yourself). In a simulated world each rank counts its own calls.
    """
    sharding = _sharding_of(target)
    if sharding is None:
        if not (hasattr(target, "world_size") and hasattr(target, "all_gather")):
            raise TypeError(
                f"count_collectives needs a ShardedModule, TrainState, Sharding or Collectives, got {type(target).__name__}"
            )
        yield CollectiveCounter(RecordingCollectives(target))
        return
    # The mesh is the only source of the collectives (a ShardedModule's `comm` reads it too): the
    # block's mesh has the recorder for its data axis.
    original = sharding.mesh
    recorder = RecordingCollectives(original.data)
    sharding.mesh = original.replace(data=recorder)
    try:
        yield CollectiveCounter(recorder)
    finally:
        sharding.mesh = original
