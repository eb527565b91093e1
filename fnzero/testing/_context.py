"""Which simulated rank the calling thread is, and a lock for torch's process-wide RNG.

Each rank's thread runs inside `providing_collectives(comm)` (`fnzero/sharding/comm/_collectives.py`),
so user code that calls `fnzero.shard`, `fnzero.init_distributed()` or `fnzero.load_config`
without naming a world gets its thread's rank inside `simulated_world(n).run(fn)` and the real
process group under `fnzero launch`.
"""

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
    weights: in a simulated world the ranks are threads sharing one generator, and this holds
    `RNG_LOCK` so their draws cannot interleave; in a real process it is just a seeded fork of
    the RNG. Restoring the previous state keeps the block free of side effects on later draws.
    A collective inside the block lets the lock go while it waits (no deadlock), so draws after a
    collective inside `seeded` are not reproducible: build first, shard and init after. Draws
    outside it take no lock, so in a simulated world a rank's `torch.randint(...)` may land between
    another rank's draws inside `seeded`: give such data a generator of its own
    (`torch.Generator().manual_seed(k)`).
    """
    with RNG_LOCK:
        state = torch.random.get_rng_state()
        torch.manual_seed(seed)
        try:
            yield
        finally:
            torch.random.set_rng_state(state)
