"""`assert_pure`: a step leaves its inputs alone and gives the same result twice."""

from __future__ import annotations

from typing import Any, Callable

from ._trees import assert_trees_equal, tree_snapshot

__all__ = ["assert_pure"]


def _where(state: Any) -> str:
    sharding = getattr(state, "sharding", None)
    return f"rank {sharding.rank} of {sharding.world_size}: " if sharding is not None else ""


def assert_pure(step: Callable[[Any, Any], Any], state: Any, batch: Any, *, what: str = "") -> Any:
    """Call `step(state, batch)` twice and assert that

    * neither call modified `state` or `batch` (every tensor compared bit for bit with a deep
      snapshot taken before the first call: in-place updates, donated buffers, `.add_` on a batch
      tensor all show up, named by path, e.g. `state.params['<root>']`);
    * both calls returned the same pytree, bit for bit (a step that reads a global RNG, a clock or
      hidden mutable state fails here).

    Returns the first call's result. Inside a simulated or spawned world call it on every rank
    (the step's collectives need all ranks); the message names this rank.
    """
    where = (f"{what}: " if what else "") + _where(state)
    before_state, before_batch = tree_snapshot(state), tree_snapshot(batch)
    first = tree_snapshot(step(state, batch))  # a snapshot: a later call must not be able to edit it
    assert_trees_equal(state, before_state, what=f"{where}the step modified its input state", root="state")
    assert_trees_equal(batch, before_batch, what=f"{where}the step modified its input batch", root="batch")
    second = step(state, batch)
    assert_trees_equal(
        second, first, what=f"{where}the step is not deterministic: a second call on the same inputs differs",
        root="step(state, batch)",
    )
    return first
