"""`FunctionalCollectives`: the `Collectives` interface over torch's traceable functional
collectives, for code that runs inside a torch.compile graph (the whole-step graph,
`fnzero/train/_whole_step.py`). Each call becomes a node of the graph, which schedules it; the
async forms complete at once (`CollectivesBase`)."""

from __future__ import annotations

from typing import Any

import torch

from ..._errors import DistributedError
from ._all_to_all import resolve_splits
from ._collectives import CollectivesBase

__all__ = ["FunctionalCollectives"]


class FunctionalCollectives(CollectivesBase):
    """Collectives over `group` (None: the default group) as functional collectives; a world of one
    returns its input."""

    def __init__(self, group: Any, rank: int, world_size: int):
        self.group, self.rank, self.world_size = group, rank, world_size

    def all_gather(self, shard: torch.Tensor) -> torch.Tensor:
        if self.world_size == 1:
            return shard
        import torch.distributed._functional_collectives as funcol

        return funcol.all_gather_tensor(shard, 0, self.group)

    def reduce_scatter(self, full: torch.Tensor, donate: bool = False) -> torch.Tensor:
        if self.world_size == 1:
            return full
        import torch.distributed._functional_collectives as funcol

        return funcol.reduce_scatter_tensor(full, "sum", 0, self.group)

    def all_reduce(self, t: torch.Tensor, op: str = "sum") -> torch.Tensor:
        if self.world_size == 1:
            return t
        import torch.distributed._functional_collectives as funcol

        return funcol.all_reduce(t, op, self.group)

    def broadcast(self, t: torch.Tensor, src: int = 0) -> torch.Tensor:
        if self.world_size == 1:
            return t
        import torch.distributed._functional_collectives as funcol

        return funcol.broadcast(t, src, self.group)

    def all_to_all(self, tensor: torch.Tensor, *, input_split_sizes=None, output_split_sizes=None,
                   label: str = "") -> torch.Tensor:
        if input_split_sizes is not None and output_split_sizes is None and self.world_size > 1:
            # Learning them would read a tensor's values while the graph is traced.
            raise DistributedError(f"rank {self.rank}: a traced all_to_all needs output_split_sizes with "
                                   f"input_split_sizes: the graph must know its shapes", ranks=(self.rank,))
        ins, outs = resolve_splits(self, tensor, input_split_sizes, output_split_sizes)
        if self.world_size == 1:
            return tensor
        import torch.distributed._functional_collectives as funcol

        return funcol.all_to_all_single(tensor, outs, ins, self.group)

    def barrier(self) -> None:  # a graph has no barrier: its collectives order it
        return None
