"""The groups MiCS and hpZ add to a run's data-parallel ranks (`specs/mesh.md §MiCS`, `specs/mesh.md §hpZ`)."""

from __future__ import annotations

import dataclasses
from typing import Any

__all__ = ["ZeroGroups"]


@dataclasses.dataclass(frozen=True, eq=False)
class ZeroGroups:
    """MiCS's and hpZ's collectives beside the group ZeRO shards over (`Sharding.comm`).

    `replicas` (MiCS): the ranks holding the same shard as this one, one in each shard group; each
    unit's reduced gradient shard is all-reduced over them. `hpz` (hpZ): the adjacent ranks that
    hold a secondary partition of each stage-3 unit between its forward and its backward, and
    re-gather it from there for backward. None where that feature is off.
    """

    @property
    def not_traceable(self) -> str | None:
        """Why a step with these groups cannot run as one graph (`fnzero.jit(scope="step")`), or None
        (hpZ's secondary partitions serve stage 3, which the plan already declares)."""
        if self.replicas is not None:
            return "MiCS all-reduces the gradient shards across its replica groups, a collective the graph's ladder lacks"
        return None

    replicas: Any = None
    hpz: Any = None

    @property
    def num_replicas(self) -> int:
        """Copies of each shard: 1 without MiCS."""
        return self.replicas.world_size if self.replicas is not None else 1
