"""The device mesh: the job's ranks as a grid of named axes, `pp` × `dp` × `tp`, each with its own
collectives, the dp axis divided for `ep`/`edp`, `sp`, MiCS and hpZ (`specs/mesh.md` §Mesh, §Sequence,
§MiCS, §hpZ)."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import torch.distributed as dist

from ..._errors import ConfigError
from ._collectives import Collectives, LocalCollectives, ProcessGroupCollectives

__all__ = ["Mesh", "MeshShape", "make_mesh", "mesh_from_config", "ranks_per_node", "zero_groups_of"]


@dataclasses.dataclass(frozen=True)
class MeshShape:
    """Sizes of the axes; their product is the world size."""

    dp: int
    tp: int = 1
    pp: int = 1
    ep: int = 1  # expert-parallel ranks per group: a division of dp (dp = edp x ep)
    mics: int = 0  # MiCS shard group size, a division of dp (0: off, ZeRO shards over the whole dp axis)
    hpz: int = 1  # hpZ secondary partition group size, a division of dp (1: off)
    sp: int = 1  # sequence-parallel ranks per group, a division of dp: they share one sample's tokens

    AXES = ("pp", "dp", "tp")  # outermost first
    SUB_AXES = ("ep", "edp", "mics", "mics_replica", "hpz", "sp")  # the divisions of dp

    @property
    def edp(self) -> int:
        """Expert-data-parallel ranks: those holding the same experts."""
        return self.dp // self.ep

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.tp

    @property
    def batch_dp(self) -> int:
        """Data-parallel ranks that read different samples: dp over the sequence-parallel ranks."""
        return self.dp // self.sp

    def rank_of(self, pp: int, dp: int, tp: int) -> int:
        return (pp * self.dp + dp) * self.tp + tp

    def coords(self, rank: int) -> dict[str, int]:
        """Rank's index along each axis."""
        rest, tp = divmod(rank, self.tp)
        pp, dp = divmod(rest, self.dp)
        edp, ep = divmod(dp, self.ep)
        batch_dp, sp = divmod(dp, self.sp)
        return {"pp": pp, "dp": dp, "tp": tp, "edp": edp, "ep": ep, "batch_dp": batch_dp, "sp": sp}

    def groups(self, axis: str) -> list[list[int]]:
        """The partition of the world's ranks into the groups of `axis` (ranks that differ only
        along it), in rank order. The sub-axes divide each dp group: ep, mics, hpz and sp groups are
        runs of adjacent dp ranks, edp and mics_replica groups take every ep-th (mics-th)."""
        if axis in self.SUB_AXES:
            size = {"ep": self.ep, "edp": self.ep, "mics": self.mics, "mics_replica": self.mics, "hpz": self.hpz,
                    "sp": self.sp}[axis]
            out = []
            for group in self.groups("dp"):
                runs = [group[i:i + size] for i in range(0, self.dp, size)]
                out += runs if axis in ("ep", "mics", "hpz", "sp") else [list(g) for g in zip(*runs)]
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
    mics: Collectives | None = None  # its MiCS shard group, which ZeRO shards over (None: dp itself)
    mics_replicas: Collectives | None = None  # the ranks holding the same MiCS shard (None without MiCS)
    hpz: Collectives | None = None  # its hpZ group, which backward re-gathers parameters over (None: off)
    sp: Collectives | None = None  # its sequence-parallel group, sharing one sample's tokens (None: off)

    @property
    def expert_dp(self) -> Collectives:
        """The ranks ZeRO shards and reduces expert parameters over."""
        return self.edp if self.edp is not None else self.dp

    @property
    def coords(self) -> dict[str, int]:
        return self.shape.coords(self.rank)


def make_mesh(comm: Collectives, tp: int = 1, pp: int = 1, ep: int = 1, mics: int = 0, hpz: int = 1,
              sp: int = 1) -> Mesh:
    """The mesh over `comm`'s ranks: `tp` tensor-parallel ranks per group, `pp` pipeline stages, the
    rest data parallel, split by `ep`, `mics` (0: off), `hpz` (1: off) and `sp` (sequence-parallel
    ranks, 1: off) (`specs/mesh.md` §Mesh, §Expert parallelism, §Sequence, §MiCS, §hpZ). A
    ConfigError names a size that does not divide its ranks."""
    n = comm.world_size
    for what, v, low in (("tensor-parallel size", tp, 1), ("pipeline stage count", pp, 1),
                         ("expert-parallel size", ep, 1), ("MiCS shard size", mics, 0), ("hpZ partition size", hpz, 1),
                         ("sequence-parallel size", sp, 1)):
        if isinstance(v, bool) or not isinstance(v, int) or v < low:
            raise ConfigError(f"the {what} must be {'a positive' if low else 'a non-negative'} integer, got {v!r}")
    if n % (tp * pp):
        what = f"tensor-parallel size {tp}" + (f" x {pp} pipeline stages" if pp > 1 else "")
        raise ConfigError(f"a mesh of {what} needs a world size that is a multiple of {tp * pp}; this world has {n} "
                          "rank(s)")
    dp = n // (tp * pp)
    if dp % ep:
        raise ConfigError(f"expert-parallel size {ep} must divide the data-parallel world: this mesh has {dp} "
                          f"data-parallel rank(s) ({n} rank(s) / tensor-parallel {tp} / pipeline {pp})")
    _check_zero_groups(dp, tp, pp, ep, mics, hpz)
    _check_sequence_axis(dp, n, tp, pp, ep, mics, hpz, sp)
    shape = MeshShape(dp=dp, tp=tp, pp=pp, ep=ep, mics=mics, hpz=hpz, sp=sp)
    sub_axes = (("ep", "edp") * (ep > 1) + ("mics", "mics_replica") * (mics > 0) + ("hpz",) * (hpz > 1)
                + ("sp",) * (sp > 1))
    if tp == 1 and pp == 1 and not sub_axes:
        return Mesh(shape, comm.rank, comm, comm, LocalCollectives())
    if isinstance(comm, ProcessGroupCollectives) and comm.group is None:
        from torch.distributed.device_mesh import init_device_mesh

        device_type = "cuda" if dist.get_backend() == "nccl" else "cpu"
        dm = init_device_mesh(device_type, (shape.pp, shape.dp, shape.tp), mesh_dim_names=MeshShape.AXES)
        axis = {a: ProcessGroupCollectives(dm.get_group(a)) for a in MeshShape.AXES}
        sub = {a: _process_group_of(shape.groups(a), comm.rank) for a in sub_axes}
        return _mesh(shape, comm, axis, sub, dm)
    new_groups = getattr(comm, "new_groups", None)
    if new_groups is None:
        raise ConfigError(f"a mesh needs collectives that can form sub-groups; {type(comm).__name__} "
                          "cannot (use torch.distributed's default group or fnzero.testing's simulated worlds)")
    axis = {a: new_groups(shape.groups(a)) for a in MeshShape.AXES}
    return _mesh(shape, comm, axis, {a: new_groups(shape.groups(a)) for a in sub_axes})


def _mesh(shape: MeshShape, comm: Collectives, axis: dict, sub: dict, device_mesh: Any = None) -> Mesh:
    return Mesh(shape, comm.rank, comm, axis["dp"], axis["tp"], device_mesh, pp=axis["pp"],
                ep=sub.get("ep", LocalCollectives()), edp=sub.get("edp"), mics=sub.get("mics"),
                mics_replicas=sub.get("mics_replica"), hpz=sub.get("hpz"), sp=sub.get("sp"))


def ranks_per_node(world_size: int) -> int:
    """Ranks on this rank's node: the launcher's LOCAL_WORLD_SIZE (torchrun, `fnzero launch`), else
    the whole world (one process, or a simulated world's threads: one host)."""
    local = os.environ.get("LOCAL_WORLD_SIZE")
    return int(local) if local and local.isdigit() and int(local) > 0 else world_size


def _check_zero_groups(dp: int, tp: int, pp: int, ep: int, mics: int, hpz: int) -> None:
    """MiCS and hpZ divide the data-parallel ranks, alone: one ConfigError naming the key."""
    others = [f"{what} {v}" for what, v in (("tensor-parallel size", tp), ("pipeline stages", pp),
                                            ("expert-parallel size", ep)) if v > 1]
    for key, v, on in (("mics_shard_size", mics, mics > 0), ("zero_hpz_partition_size", hpz, hpz > 1)):
        if on and others:
            raise ConfigError(f"zero_optimization.{key} {v} with {' and '.join(others)}: fnzero shards over "
                              "MiCS and hpZ groups of the data-parallel ranks only without tensor, pipeline or expert "
                              "parallelism; remove one")
        if on and dp % v:
            raise ConfigError(f"zero_optimization.{key} {v} must divide the data-parallel ranks: this mesh has {dp}")
    if mics > 0 and hpz > 1:
        raise ConfigError(f"zero_optimization.mics_shard_size {mics} with zero_optimization.zero_hpz_partition_size "
                          f"{hpz}: MiCS already keeps parameter gathers inside its shard groups; use one of the two")
    local = ranks_per_node(dp)
    if hpz > 1 and local % hpz:
        raise ConfigError(f"zero_optimization.zero_hpz_partition_size {hpz} must divide the ranks per node "
                          f"({local}, LOCAL_WORLD_SIZE): its groups of adjacent ranks must each sit on one node")


def _check_sequence_axis(dp: int, n: int, tp: int, pp: int, ep: int, mics: int, hpz: int, sp: int) -> None:
    """The sequence axis divides the data-parallel ranks and composes with ZeRO, tensor, pipeline and
    expert parallelism, not yet with MiCS or hpZ: one ConfigError naming the sizes."""
    if sp == 1:
        return
    if dp % sp:
        raise ConfigError(f"sequence_parallel_size {sp} must divide the data-parallel ranks: this mesh has {dp} "
                          f"({n} rank(s) / tensor-parallel {tp} / pipeline {pp})")
    others = [f"{what} {v}" for what, v in (("MiCS shard size", mics), ("hpZ partition size", hpz)) if v > 1]
    if others:
        raise ConfigError(f"sequence_parallel_size {sp} with {' and '.join(others)}: fnzero's sequence parallelism "
                          "composes with ZeRO stages 0-3, tensor, pipeline and expert parallelism, not yet with MiCS "
                          "or hpZ; remove one")


def _process_group_of(partition: list[list[int]], rank: int) -> ProcessGroupCollectives:
    """This rank's group of `partition` as a process group (every rank creates every group, in one
    order: `new_group` is collective over the whole world)."""
    mine = None
    for ranks in partition:
        group = dist.new_group(ranks)
        if rank in ranks:
            mine = group
    return ProcessGroupCollectives(mine)


def mesh_from_config(comm: Collectives, config: Any, pp: int | None = None, ep: int = 1,
                     zero_groups: tuple[int, int] = (0, 1)) -> Mesh:
    """The mesh a config asks for: its tp size, its pipeline stages (`pp`, the pipeline model's own,
    when it says "auto"), `ep` and `zero_groups` (MiCS shard size, hpZ partition size)."""
    tp_cfg = config.tensor_parallel if config is not None else None
    stages = config.pipeline.size if config is not None else None  # None: "auto"
    if stages is not None and pp is not None and stages != pp:
        raise ConfigError(f"pipeline.stages is {stages} but the pipeline model asks for {pp} stages (num_stages)")
    sp = config.sequence_parallel_size if config is not None else 1
    return make_mesh(comm, tp_cfg.size if tp_cfg is not None else 1, stages or pp or 1, ep, *zero_groups, sp=sp)


def zero_groups_of(config: Any, optimizer_sharded: bool, params_sharded: bool) -> tuple[int, int]:
    """(MiCS shard size, 0 when off; hpZ partition size, 1 when off) a config asks: MiCS needs a sharded
    optimizer state, hpZ sharded parameters (otherwise the key has no effect, warned when loaded)."""
    if config is None:
        return 0, 1
    z = config.zero_optimization
    mics = z.mics_shard_size if z.mics_shard_size > 0 and optimizer_sharded else 0
    return mics, z.zero_hpz_partition_size if z.zero_hpz_partition_size > 1 and params_sharded else 1
