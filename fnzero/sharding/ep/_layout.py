"""`EPLayout`: where a model's experts are, for the step, checkpoints and reports
(`specs/mesh.md §Expert parallelism`)."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

__all__ = ["EPLayout", "StackedSplit"]


@dataclasses.dataclass(frozen=True)
class StackedSplit:
    """A tensor stacking a layer's experts along dim 0, cut into `size` equal runs of rows, with the
    part of `ParamSplit`'s interface that readers of whole tensors use."""

    full_shape: tuple[int, ...]
    size: int
    dim: int = 0
    blocks: int = 1

    def start(self, rank: int) -> int:
        return rank * (self.full_shape[0] // self.size)

    def local(self, full, rank: int):
        """Rank's rows of `full` (a copy, contiguous)."""
        per = self.full_shape[0] // self.size
        return full.narrow(0, rank * per, per).contiguous()


@dataclasses.dataclass(frozen=True, eq=False)
class EPLayout:
    """This rank's place among the expert-parallel ranks (`comm`; `expert_dp`, where ZeRO shards expert
    units), and the `ExpertGroup` paths (`modules`, each a unit), with their global expert counts and
    `ExpertGroup.name_on` (`renames`)."""

    # Why a step with this axis cannot run as one graph (`fnzero.jit(scope="step")`).
    not_traceable = "expert parallelism's all-to-all runs inside the model's MoE layers"

    comm: Any
    expert_dp: Any
    modules: tuple[str, ...]
    num_experts: dict[str, int]
    renames: dict[str, Callable[[str, int], tuple[str, bool]]] = dataclasses.field(default_factory=dict)
    # Full names of the whole layers' expert parameters this rank does not hold (other ranks' experts,
    # named apart), and of those it holds a dim-0 piece of (stacked experts) -> the whole tensor's shape.
    elsewhere: frozenset[str] = frozenset()
    stacked: dict[str, tuple[int, ...]] = dataclasses.field(default_factory=dict)

    def split_of(self, name: str) -> "StackedSplit | None":
        """How the whole tensor of a stacked expert parameter is cut over the ep ranks, or None for
        a parameter this rank holds whole."""
        shape = self.stacked.get(name)
        return StackedSplit(shape, self.size) if shape is not None else None

    @property
    def size(self) -> int:
        return self.comm.world_size

    @property
    def rank(self) -> int:
        return self.comm.rank

    def consolidate(self, module: str, views: list[dict[str, Any]]) -> dict[str, Any]:
        """The whole layer's parameters (full names) from every ep rank's `views` of the expert unit of
        `module` (rank order, named as on this rank), stacked pieces concatenated along dim 0."""
        import torch

        rename, prefix = self.renames[module], module + "."
        out: dict[str, Any] = {}
        pieces: dict[str, list] = {}
        for ep_rank, named in enumerate(views):
            for name, t in named.items():
                there, stacked = rename(name[len(prefix):], ep_rank)
                if stacked:
                    pieces.setdefault(prefix + there, []).append(t)
                else:
                    out[prefix + there] = t
        out.update({name: torch.cat(ts, dim=0) for name, ts in pieces.items()})
        return out

    def unit_from_every_rank(self, unit, full) -> dict[str, Any]:
        """An expert unit's parameters on every ep rank (each holds the same layout of other experts),
        by the whole layer's names, from this rank's full buffer: one all-gather over the ep ranks."""
        from ..zero import unit_views

        every = self.comm.all_gather(full).view(self.size, -1)
        return self.consolidate(unit.module, [unit_views(unit, every[j]) for j in range(self.size)])

    def whole_from_every_rank(self, whole: dict[str, Any]) -> dict[str, Any]:
        """The expert parameters among `whole` (frozen ones at stages 0-2), removed from it, from every ep
        rank by the whole layer's names: one all-gather per tensor over the ep ranks."""
        out: dict[str, Any] = {}
        for module in self.modules:
            mine = {n: t for n, t in whole.items() if n.startswith(module + ".")}
            every = {n: self.comm.all_gather(t.contiguous().reshape(-1)).view(self.size, *t.shape)
                     for n, t in mine.items()}
            out.update(self.consolidate(module, [{n: g[j] for n, g in every.items()} for j in range(self.size)]))
            for n in mine:
                whole.pop(n)
        return out
