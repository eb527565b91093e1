"""The device mesh: the job's ranks as a grid of named axes, each with its own collectives
(`specs/mesh.md`).

Axes, outermost first: `dp` (data parallel: ZeRO shards over it, the batch is split over it) and
`tp` (tensor parallel: each layer's weights are split over it). Rank r sits at
(dp, tp) = divmod(r, tp): the ranks of one tensor-parallel group are adjacent, so on a
multi-GPU host they share the fast links, as in Megatron and torchtitan.

Over torch.distributed the axes are a `torch.distributed.device_mesh.DeviceMesh`'s dimensions,
so each axis is a process group (gloo on CPU, NCCL on GPU). In a simulated world each axis is a
sub-world of the threads (`Collectives.new_groups`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch.distributed as dist

from .._errors import ConfigError
from ._collectives import Collectives, LocalCollectives, ProcessGroupCollectives

__all__ = ["Mesh", "MeshShape", "make_mesh", "mesh_from_config"]


@dataclasses.dataclass(frozen=True)
class MeshShape:
    """Sizes of the axes; their product is the world size."""

    dp: int
    tp: int = 1

    @property
    def world_size(self) -> int:
        return self.dp * self.tp

    def coords(self, rank: int) -> dict[str, int]:
        """Rank's index along each axis."""
        dp, tp = divmod(rank, self.tp)
        return {"dp": dp, "tp": tp}

    def groups(self, axis: str) -> list[list[int]]:
        """The partition of the world's ranks into the groups of `axis` (ranks that differ only
        along it), in rank order."""
        if axis == "tp":
            return [[d * self.tp + t for t in range(self.tp)] for d in range(self.dp)]
        if axis == "dp":
            return [[d * self.tp + t for d in range(self.dp)] for t in range(self.tp)]
        raise ValueError(f"mesh axes are dp and tp, not {axis!r}")


@dataclasses.dataclass(frozen=True)
class Mesh:
    """One rank's view of the mesh: its world rank, its coordinates and the collectives of each
    axis (`dp`, `tp`) and of the whole world."""

    shape: MeshShape
    rank: int
    world: Collectives
    dp: Collectives
    tp: Collectives
    device_mesh: Any = None  # the torch DeviceMesh, when the world is a process group

    @property
    def coords(self) -> dict[str, int]:
        return self.shape.coords(self.rank)


def make_mesh(comm: Collectives, tp: int = 1) -> Mesh:
    """The mesh over `comm`'s ranks with `tp` tensor-parallel ranks per group and the rest data
    parallel. A ConfigError names the numbers when `tp` does not divide the world."""
    n = comm.world_size
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ConfigError(f"the tensor-parallel size must be a positive integer, got {tp!r}")
    if n % tp:
        raise ConfigError(f"a mesh of tensor-parallel size {tp} needs a world size that is a multiple of {tp}; "
                          f"this world has {n} rank(s)")  # fmt: skip
    shape = MeshShape(dp=n // tp, tp=tp)
    if tp == 1:
        return Mesh(shape, comm.rank, comm, comm, LocalCollectives())
    if isinstance(comm, ProcessGroupCollectives) and comm.group is None:
        from torch.distributed.device_mesh import init_device_mesh

        device_type = "cuda" if dist.get_backend() == "nccl" else "cpu"
        dm = init_device_mesh(device_type, (shape.dp, shape.tp), mesh_dim_names=("dp", "tp"))
        return Mesh(shape, comm.rank, comm, ProcessGroupCollectives(dm.get_group("dp")),
                    ProcessGroupCollectives(dm.get_group("tp")), dm)  # fmt: skip
    new_groups = getattr(comm, "new_groups", None)
    if new_groups is None:
        raise ConfigError(f"tensor parallelism needs collectives that can form sub-groups; {type(comm).__name__} "
                          "cannot (use torch.distributed's default group or fnzero.testing's simulated worlds)")
    return Mesh(shape, comm.rank, comm, new_groups(shape.groups("dp")), new_groups(shape.groups("tp")))


def mesh_from_config(comm: Collectives, config: Any) -> Mesh:
    """The mesh a config asks for: `tensor_parallel.autotp_size` tensor-parallel ranks, the rest
    data parallel."""
    tp_cfg = getattr(config, "tensor_parallel", None)
    return make_mesh(comm, tp_cfg.size if tp_cfg is not None else 1)
