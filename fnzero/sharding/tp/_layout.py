"""Which parameters are split along the tensor-parallel axis, and how: pure data, the same on every
rank (`specs/mesh.md §Layout`, which says how `dim`, `blocks` and uneven sizes cut a tensor)."""

from __future__ import annotations

import dataclasses

import torch

from ._ops import split_sizes

__all__ = ["ParamSplit", "TPLayout"]


@dataclasses.dataclass(frozen=True)
class ParamSplit:
    """How one parameter of full shape `full_shape` is split over `size` ranks."""

    full_shape: tuple[int, ...]
    dim: int
    size: int
    blocks: int = 1

    def __post_init__(self) -> None:
        if self.full_shape[self.dim] % self.blocks:
            raise ValueError(f"dimension {self.dim} of {self.full_shape} does not hold {self.blocks} equal blocks")

    def pieces(self) -> list[int]:
        """Each rank's length along `dim` within one block."""
        return split_sizes(self.full_shape[self.dim] // self.blocks, self.size)

    def local_shape(self, rank: int) -> tuple[int, ...]:
        shape = list(self.full_shape)
        shape[self.dim] = self.pieces()[rank] * self.blocks
        return tuple(shape)

    def local(self, full: torch.Tensor, rank: int) -> torch.Tensor:
        """Rank's slice of `full` (a copy, contiguous)."""
        pieces = self.pieces()
        lo = sum(pieces[:rank])
        parts = full.chunk(self.blocks, dim=self.dim) if self.blocks > 1 else (full,)
        return torch.cat([p.narrow(self.dim, lo, pieces[rank]) for p in parts], dim=self.dim).contiguous()

    def full(self, locals_: list[torch.Tensor]) -> torch.Tensor:
        """The full tensor from every rank's slice, in rank order."""
        per_rank = [t.chunk(self.blocks, dim=self.dim) if self.blocks > 1 else (t,) for t in locals_]
        blocks = [torch.cat([r[b] for r in per_rank], dim=self.dim) for b in range(self.blocks)]
        return torch.cat(blocks, dim=self.dim)

    def start(self, rank: int) -> int:
        """Where rank's piece starts within a block (the first vocabulary row of an embedding)."""
        return sum(self.pieces()[:rank])


@dataclasses.dataclass(frozen=True)
class TPLayout:
    """The tensor-parallel split of a model: `splits` by state-dict name (every name of a tied
    parameter), over `size` ranks; this rank is `rank`. `comm`: the group's collectives (not
    compared: equal layouts on different ranks are the same layout). `vocab_head`: the LM head's
    weight name when its logits come out split over the vocabulary."""

    # Why a step with this axis cannot run as one graph (`fnzero.jit(scope="step")`).
    not_traceable = "tensor parallelism's collectives run inside the model's layers"

    size: int
    rank: int
    splits: dict[str, ParamSplit]
    comm: object = dataclasses.field(compare=False, repr=False, default=None)
    vocab_head: str | None = None  # the LM head's weight when it is split over the vocabulary

    def vocab_start(self) -> int:
        """The first vocabulary entry of this rank's slice of the LM head's logits."""
        return self.splits[self.vocab_head].start(self.rank) if self.vocab_head is not None else 0

    def split_of(self, *names: str) -> ParamSplit | None:
        """The split of the parameter called any of `names` (a slot's name and its tied aliases),
        or None when it is replicated."""
        return next((self.splits[n] for n in names if n in self.splits), None)

    def gather_full(self, name: str, local: torch.Tensor) -> torch.Tensor:
        """The full tensor of parameter `name` from every rank's `local` slice (collective over
        the group: every rank calls it for the same names in the same order)."""
        split = self.splits.get(name)
        if split is None or self.size == 1:
            return local
        width = max(p for p in split.pieces()) * split.blocks
        shape = list(split.full_shape)
        shape[split.dim] = width
        padded = local.new_zeros(shape)
        padded.narrow(split.dim, 0, local.shape[split.dim]).copy_(local)
        parts = self.comm.all_gather(padded.reshape(-1)).view(self.size, *shape)
        return split.full([parts[r].narrow(split.dim, 0, split.local_shape(r)[split.dim]) for r in range(self.size)])
