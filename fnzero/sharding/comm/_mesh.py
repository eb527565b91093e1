"""The device mesh: the job's ranks as a grid of named axes, each with its own collectives
(`specs/mesh.md`).

Axes, outermost first: `pp` (pipeline parallel: each stage holds a run of the model's layers),
`dp` (data parallel: ZeRO shards over it, the batch is split over it) and `tp` (tensor parallel:
each layer's weights are split over it). Rank r sits at r = (pp * DP + dp) * TP + tp: the ranks
of one tensor-parallel group are adjacent, so on a multi-GPU host they share the fast links, and
pipeline stages, which exchange one activation per micro-batch, are furthest apart, as in
Megatron and torchtitan.

Over torch.distributed the axes are a `torch.distributed.device_mesh.DeviceMesh`'s dimensions,
so each axis is a process group (gloo on CPU, NCCL on GPU). In a simulated world each axis is a
sub-world of the threads (`Collectives.new_groups`).

Expert parallelism divides the dp axis: dp = edp x ep, a dp index d at (edp, ep) = divmod(d, EP).
The `ep` ranks of a group are adjacent dp ranks (DeepSpeed's order) and each holds other experts
of every MoE layer; the `edp` (expert-data-parallel) ranks hold the same experts, and ZeRO shards
and reduces expert parameters over them, dense ones over the whole dp axis.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch.distributed as dist

from ..._errors import ConfigError
from ._collectives import Collectives, LocalCollectives, ProcessGroupCollectives

__all__ = ["Mesh", "MeshShape", "make_mesh", "mesh_from_config"]


@dataclasses.dataclass(frozen=True)
class MeshShape:
    """Sizes of the axes; their product is the world size."""

    dp: int
    tp: int = 1
    pp: int = 1
    ep: int = 1  # expert-parallel ranks per group: a division of dp (dp = edp x ep)

    AXES = ("pp", "dp", "tp")  # outermost first
    SUB_AXES = ("ep", "edp")  # the divisions of dp

    @property
    def edp(self) -> int:
        """Expert-data-parallel ranks: those holding the same experts."""
        return self.dp // self.ep

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.tp

    def rank_of(self, pp: int, dp: int, tp: int) -> int:
        return (pp * self.dp + dp) * self.tp + tp

    def coords(self, rank: int) -> dict[str, int]:
        """Rank's index along each axis."""
        rest, tp = divmod(rank, self.tp)
        pp, dp = divmod(rest, self.dp)
        edp, ep = divmod(dp, self.ep)
        return {"pp": pp, "dp": dp, "tp": tp, "edp": edp, "ep": ep}

    def groups(self, axis: str) -> list[list[int]]:
        """The partition of the world's ranks into the groups of `axis` (ranks that differ only
        along it), in rank order. `ep` and `edp` divide each dp group: ep groups are runs of
        adjacent dp ranks, edp groups take every ep-th."""
        if axis in self.SUB_AXES:
            out = []
            for group in self.groups("dp"):
                runs = [group[i:i + self.ep] for i in range(0, self.dp, self.ep)]
                out += runs if axis == "ep" else [list(g) for g in zip(*runs)]
            return sorted(out)
        if axis not in self.AXES:
            raise ValueError(f"mesh axes are {', '.join(self.AXES + self.SUB_AXES)}, not {axis!r}")
        sizes = {"pp": self.pp, "dp": self.dp, "tp": self.tp}
        others = [a for a in self.AXES if a != axis]
        out = []
        for i in range(sizes[others[0]]):
            for j in range(sizes[others[1]]):
                fixed = {others[0]: i, others[1]: j}
                out.append([self.rank_of(**{**fixed, axis: k}) for k in range(sizes[axis])])
        return sorted(out)


@dataclasses.dataclass(frozen=True)
class Mesh:
    """One rank's view of the mesh: its world rank, its coordinates and the collectives of each
    axis (`dp`, `tp`, `pp`) and of the whole world."""

    shape: MeshShape
    rank: int
    world: Collectives
    dp: Collectives
    tp: Collectives
    device_mesh: Any = None  # the torch DeviceMesh, when the world is a process group
    pp: Collectives = dataclasses.field(default_factory=LocalCollectives)
    ep: Collectives = dataclasses.field(default_factory=LocalCollectives)  # this rank's expert-parallel group
    edp: Collectives | None = None  # its expert-data-parallel group (None: dp itself, ep 1)

    @property
    def expert_dp(self) -> Collectives:
        """The ranks ZeRO shards and reduces expert parameters over."""
        return self.edp if self.edp is not None else self.dp

    @property
    def coords(self) -> dict[str, int]:
        return self.shape.coords(self.rank)


def make_mesh(comm: Collectives, tp: int = 1, pp: int = 1, ep: int = 1) -> Mesh:
    """The mesh over `comm`'s ranks with `tp` tensor-parallel ranks per group, `pp` pipeline
    stages, and the rest data parallel, of which each run of `ep` adjacent ranks splits the
    experts (`specs/mesh.md §Expert parallelism`). A ConfigError names the numbers when `tp * pp`
    does not divide the world or `ep` the data-parallel ranks."""
    n = comm.world_size
    for what, v in (("tensor-parallel size", tp), ("pipeline stage count", pp), ("expert-parallel size", ep)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ConfigError(f"the {what} must be a positive integer, got {v!r}")
    if n % (tp * pp):
        what = f"tensor-parallel size {tp}" + (f" x {pp} pipeline stages" if pp > 1 else "")
        raise ConfigError(f"a mesh of {what} needs a world size that is a multiple of {tp * pp}; this world has {n} "
                          "rank(s)")
    dp = n // (tp * pp)
    if dp % ep:
        raise ConfigError(f"expert-parallel size {ep} must divide the data-parallel world: this mesh has {dp} "
                          f"data-parallel rank(s) ({n} rank(s) / tensor-parallel {tp} / pipeline {pp})")
    shape = MeshShape(dp=dp, tp=tp, pp=pp, ep=ep)
    if tp == 1 and pp == 1 and ep == 1:
        return Mesh(shape, comm.rank, comm, comm, LocalCollectives())
    if isinstance(comm, ProcessGroupCollectives) and comm.group is None:
        from torch.distributed.device_mesh import init_device_mesh

        device_type = "cuda" if dist.get_backend() == "nccl" else "cpu"
        dm = init_device_mesh(device_type, (shape.pp, shape.dp, shape.tp), mesh_dim_names=MeshShape.AXES)
        axis = {a: ProcessGroupCollectives(dm.get_group(a)) for a in MeshShape.AXES}
        sub = {a: _process_group_of(shape.groups(a), comm.rank) for a in MeshShape.SUB_AXES} if ep > 1 else {}
        return Mesh(shape, comm.rank, comm, axis["dp"], axis["tp"], dm, pp=axis["pp"],
                    ep=sub.get("ep", LocalCollectives()), edp=sub.get("edp"))
    new_groups = getattr(comm, "new_groups", None)
    if new_groups is None:
        raise ConfigError(f"a mesh needs collectives that can form sub-groups; {type(comm).__name__} "
                          "cannot (use torch.distributed's default group or fnzero.testing's simulated worlds)")
    sub = {a: new_groups(shape.groups(a)) for a in MeshShape.SUB_AXES} if ep > 1 else {}
    return Mesh(shape, comm.rank, comm, new_groups(shape.groups("dp")), new_groups(shape.groups("tp")),
                pp=new_groups(shape.groups("pp")), ep=sub.get("ep", LocalCollectives()), edp=sub.get("edp"))


def _process_group_of(partition: list[list[int]], rank: int) -> ProcessGroupCollectives:
    """This rank's group of `partition` as a process group. Every rank creates every group, in
    one order: torch.distributed's `new_group` is collective over the whole world."""
    mine = None
    for ranks in partition:
        group = dist.new_group(ranks)
        if rank in ranks:
            mine = group
    return ProcessGroupCollectives(mine)


def mesh_from_config(comm: Collectives, config: Any, pp: int | None = None, ep: int = 1) -> Mesh:
    """The mesh a config asks for: `tensor_parallel.autotp_size` tensor-parallel ranks,
    `pipeline.stages` pipeline stages (or `pp`, a pipeline model's own stage count, when the
    config says "auto"), the rest data parallel, `ep` of them per expert-parallel group."""
    tp_cfg = config.tensor_parallel if config is not None else None
    stages = config.pipeline.size if config is not None else None  # None: "auto"
    if stages is not None and pp is not None and stages != pp:
        raise ConfigError(f"pipeline.stages is {stages} but the pipeline model asks for {pp} stages (num_stages)")
    return make_mesh(comm, tp_cfg.size if tp_cfg is not None else 1, stages or pp or 1, ep)
