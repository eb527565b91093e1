"""Which simulated rank the calling thread is (`providing_collectives`), and a lock for torch's
process-wide RNG (`specs/testing.md` §Worlds, §RNG)."""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch

from ..sharding import provided_collectives, providing_collectives, GLOBAL_RNG_LOCK

__all__ = ["current_comm", "rank_context", "RNG_LOCK", "seeded"]

# torch's default generator is one per process: simulated ranks (threads) that build models with
# it concurrently would interleave draws and build different weights. Everything that seeds and
# draws from it in a simulated world holds this lock, the same one `fnzero.shard` holds while it
# initialises a meta model. Re-entrant so `seeded` can nest.
RNG_LOCK = GLOBAL_RNG_LOCK


def current_comm() -> Any:
    """The calling thread's simulated-rank collectives, or None outside a simulated world."""
    return provided_collectives()


@contextlib.contextmanager
def rank_context(comm: Any) -> Iterator[None]:
    with providing_collectives(comm):
        yield


@contextlib.contextmanager
def seeded(seed: int) -> Iterator[None]:
    """Run the block with torch's CPU RNG seeded to `seed`, alone, then restore the RNG.

    Build models inside it (`with ft.seeded(0): model = MyModel()`) so every rank gets identical
    weights (`specs/testing.md` §RNG). A collective inside the block lets the lock go while it
    waits (no deadlock), so draws after it are not reproducible: build first, shard and init after.
    """
    with RNG_LOCK:
        state = torch.random.get_rng_state()
        torch.manual_seed(seed)
        try:
            yield
        finally:
            torch.random.set_rng_state(state)
