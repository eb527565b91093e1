"""Placements: what a unit holds as this rank's shard instead of a replica; a ZeRO stage names one of
four presets (`specs/sharding.md` §Placements)."""

from __future__ import annotations

import dataclasses

from ..._errors import ShardingError

__all__ = ["Placement", "placement_for_stage", "REPLICATED"]


@dataclasses.dataclass(frozen=True)
class Placement:
    """Which parts of a unit's training state are this rank's shard (True) or a full replica."""

    optimizer: bool = False  # fp32 master weights and optimizer moments
    grads: bool = False  # gradients: reduce-scattered as backward produces them
    params: bool = False  # parameters: held as a shard, gathered in forward

    def __post_init__(self) -> None:
        if (self.params and not self.grads) or (self.grads and not self.optimizer):
            raise ShardingError(
                f"{self!r} shards parameters without gradients or gradients without optimizer state; "
                "a rank updates the shard whose gradient it owns, so each sharded kind needs the ones before it"
            )

    @property
    def stage(self) -> int:
        """The ZeRO stage this placement is the preset of (for configs, reports and checkpoints)."""
        return int(self.optimizer) + int(self.grads) + int(self.params)

    def without_params(self) -> "Placement":
        """This placement with parameters replicated (a stage-3 unit kept gathered: persistent)."""
        return dataclasses.replace(self, params=False)


REPLICATED = Placement()

_PRESETS = {
    0: REPLICATED,
    1: Placement(optimizer=True),
    2: Placement(optimizer=True, grads=True),
    3: Placement(optimizer=True, grads=True, params=True),
}


def placement_for_stage(stage: "int | Placement") -> Placement:
    """The placement a ZeRO stage names (a `Placement` is returned as it is)."""
    if isinstance(stage, Placement):
        return stage
    if isinstance(stage, bool) or stage not in _PRESETS:
        raise ShardingError(f"ZeRO stage must be 0, 1, 2 or 3, got {stage!r}")
    return _PRESETS[stage]
