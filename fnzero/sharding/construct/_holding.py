"""`ShardedModule.holding` and `gather_held`: stage-3 units kept gathered across the no-grad
forwards of a decode (`specs/generation.md` §Residency; the holder is `zero/_residency.py`)."""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

from ..._errors import ShardingError
from ..zero import HeldUnits, ambient, within

__all__ = ["HoldsGatheredUnits"]


class HoldsGatheredUnits:
    """What `ShardedModule` offers a decode loop (it has the `plan`, `config`, `_frozen` and
    `_new_run` these read)."""

    @contextlib.contextmanager
    def holding(self, max_live_parameters: int | None = None) -> Iterator[HeldUnits]:
        """Keep stage-3 units gathered across the `torch.no_grad()` applies inside the block (a decode
        loop: `fnzero.generate` runs in one), as many as fit `max_live_parameters` elements gathered at
        once (DeepSpeed's `stage3_max_live_parameters`; default the config's, 1e9 without a config),
        the others gathered per forward with the next one fetched ahead; freed when the block ends.
        Yields the `HeldUnits`. Every rank plans alike: the plan's unit order, not a recorded one."""
        held = HeldUnits.for_plan(self.plan, self.config, max_live_parameters)
        try:
            with within(held=held):
                yield held
        finally:
            held.release()

    @torch.no_grad()
    def gather_held(self, params: dict[str, torch.Tensor]) -> bool:
        """Inside `holding()`, gather every unit without running the model, when those gathers are all
        a forward would make (every unit planned, each shard in memory: `HeldUnits.gathers_alone`);
        False, doing nothing, otherwise. For a rank that will run no forward but must take part in
        the others' gathers (`fnzero.generate`'s ranks that do not decode)."""
        held = ambient().held
        if held is None:
            raise ShardingError("gather_held: call it inside sm.holding()")
        if not held.gathers_alone(params, self._frozen):
            return False
        self._new_run(params).release()  # its construction starts the planned gathers (`start_planned`)
        held.settle()
        return True
