"""`SPLayout`: this rank's place among the sequence-parallel ranks, which hold one sample's tokens
between them (`specs/mesh.md` §Sequence)."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from ..._errors import ShardingError

__all__ = ["SPLayout"]


@dataclasses.dataclass(frozen=True, eq=False)
class SPLayout:
    """The sequence axis of a state's mesh: `comm`, the ranks of one sequence-parallel group (adjacent
    data-parallel ranks; rank i holds the i-th of `size` equal runs of every sample's tokens)."""

    # Why a step with this axis cannot run as one graph (`fnzero.jit(scope="step")`).
    not_traceable = "sequence parallelism's all-to-alls run inside the model's attention"

    comm: Any

    @property
    def size(self) -> int:
        return self.comm.world_size

    @property
    def rank(self) -> int:
        return self.comm.rank

    def shard_range(self, length: int) -> tuple[int, int]:
        """[start, stop) of this rank's tokens in a sequence of `length`; a ShardingError when the
        ranks cannot hold equal runs."""
        if length % self.size:
            raise ShardingError(f"a sequence of {length} tokens does not divide over {self.size} sequence-parallel "
                                f"ranks; pad it to a multiple of {self.size} (fnzero.shard_sequence(..., "
                                "pad_to_multiple=True))")
        per = length // self.size
        return self.rank * per, (self.rank + 1) * per

    def loss_share(self, loss_sum: torch.Tensor, tokens: torch.Tensor | int) -> torch.Tensor:
        """This rank's share of its group's mean loss: `loss_sum` over its own tokens divided by the
        `tokens` of all the group's ranks (summed here, one int64 all-reduce). The shares add up to
        the mean over the whole sequence, so the step's sum over the data axis is the batch's loss."""
        count = torch.as_tensor(tokens, dtype=torch.int64, device=loss_sum.device).reshape(1)
        total = self.comm.all_reduce(count.clone()) if self.size > 1 else count
        return loss_sum / total[0].clamp_min(1).to(loss_sum.dtype)

    def gather_sequence(self, x: torch.Tensor) -> torch.Tensor:
        """A (batch, local tokens) tensor of every rank joined along the tokens: (batch, all tokens).
        Not differentiable: for masks and position ids."""
        if self.size == 1:
            return x
        b, s_local = x.shape
        wire = x.to(torch.uint8) if x.dtype == torch.bool else x  # NCCL gathers bytes, not bools
        flat = self.comm.all_gather(wire.contiguous().reshape(-1)).to(x.dtype)
        return flat.reshape(self.size, b, s_local).permute(1, 0, 2).reshape(b, self.size * s_local)
