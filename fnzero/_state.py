"""The training state: an explicit, immutable pytree. Behaviour lives in functions elsewhere."""

from __future__ import annotations

import dataclasses
from typing import Any

import optree
import torch

from ._errors import ShardingError

__all__ = ["TrainState", "LossScaleState", "Sharding", "StateMesh"]


@dataclasses.dataclass(frozen=True, eq=False)
class StateMesh:
    """The axes a state's tensors are laid out over, one value: `data`, `replicas` (MiCS), `hpz`, `tp`,
    `pp`, `ep`, `sp`, each its collectives or layout, None where the run does not use it (`specs/mesh.md`
    §The state's mesh, which says what each holds)."""

    data: Any
    replicas: Any = None
    hpz: Any = None
    tp: Any = None
    pp: Any = None
    ep: Any = None
    sp: Any = None  # the sequence axis: ranks of `data` that share one sample's tokens (`SPLayout`)

    AXES = ("data", "replicas", "hpz", "tp", "pp", "ep", "sp")

    def axis(self, name: str) -> Any:
        """The axis `name`, which this state must have: a ShardingError says when it has none."""
        if name not in self.AXES:
            raise ValueError(f"a state's mesh has the axes {', '.join(self.AXES)}, not {name!r}")
        value = getattr(self, name)
        if value is None:
            raise ShardingError(f"this state has no {name} axis (its mesh has {', '.join(self.present)})")
        return value

    @property
    def present(self) -> tuple[str, ...]:
        """The axes this state has, `data` always among them."""
        return tuple(a for a in self.AXES if getattr(self, a) is not None)

    def replace(self, **axes) -> "StateMesh":
        """The same mesh with some axes changed (None: without that axis)."""
        return dataclasses.replace(self, **axes)

    @property
    def num_replicas(self) -> int:
        """Copies of each ZeRO shard: MiCS's replica group's size, 1 without MiCS."""
        return self.replicas.world_size if self.replicas is not None else 1

    @property
    def dp_size(self) -> int:
        """Data-parallel ranks: those sharing the batch (the data axis times the MiCS replicas), each
        sequence-parallel group counted once: its ranks hold one sample's tokens between them."""
        sp = self.sp.size if self.sp is not None else 1
        return self.data.world_size * self.num_replicas // sp

    @property
    def expert_data(self) -> Any:
        """The collectives expert units are sharded and reduced over; None without expert parallelism."""
        return self.ep.expert_dp if self.ep is not None else None

    @property
    def not_traceable(self) -> str | None:
        """Why a step over this mesh cannot run as one graph (`fnzero.jit(scope="step")`), or None:
        what each axis' layout declares, and MiCS's replica groups (hpZ's secondary partitions
        serve stage 3, which the plan already declares)."""
        for layout in (self.tp, self.pp, self.ep, self.sp):
            reason = getattr(layout, "not_traceable", None) if layout is not None else None
            if reason is not None:
                return reason
        if self.replicas is not None:
            return "MiCS all-reduces the gradient shards across its replica groups, a collective the graph's ladder lacks"
        return None

    # Two meshes are the same when they hold the same collectives (identity: one per process group,
    # and it keeps treespec comparison cheap) and equal layouts (equal on every rank of an axis).
    def __eq__(self, other):
        return (isinstance(other, StateMesh) and other.data is self.data and other.replicas is self.replicas
                and other.hpz is self.hpz and other.tp == self.tp and other.pp == self.pp and other.ep is self.ep and other.sp is self.sp)

    def __hash__(self):
        return id(self.data)


class Sharding:
    """Where a state's tensors live: the ShardPlan (pure data, equal on every rank) and the mesh
    of axes that connect the ranks (`StateMesh`). Like `jax.Array.sharding`, it travels with the
    state as static (non-leaf) metadata, so `train_step` needs nothing but the state and the batch.

    `comm`, `tp`, `pp`, `ep`, `replicas`, `expert_comm`, `dp_size`, `rank` and `world_size` are
    read from the mesh, its only source.
    """

    __slots__ = ("plan", "mesh", "device", "watchdog", "shard_sources", "quantization", "config_optimizer")

    def __init__(self, plan, mesh: StateMesh, device: torch.device, watchdog=None, quantization=None,
                 config_optimizer=None):
        self.plan = plan
        self.mesh = mesh
        self.device = torch.device(device)
        # The job's collective watchdog (`fnzero.sharding.comm._watchdog`), told by the step which step
        # runs; None without one (one process, a simulated world, its own collectives).
        self.watchdog = watchdog
        # Where the placeholder shards of the state's `params` and `frozen` are read from
        # (`offload_param: nvme`, `fnzero/sharding/zero/_param_store.py`): set once, when the first
        # state is made and before any state holds a placeholder; None while every shard is in memory.
        self.shard_sources = None
        # What travels quantized (ZeRO++ qwZ/qgZ, `fnzero.sharding.CommQuantization`): codecs for
        # stage 3's gathers and the gradient reduce-scatters; None: everything in full precision.
        self.quantization = quantization
        # Not part of the mesh: the config's optimizer block with the facts of the model it reads
        # (`fnzero.optim.ConfigOptimizer`), resolved by `shard`, where the model is known (`specs/mesh.md`).
        self.config_optimizer = config_optimizer

    @property
    def comm(self):
        """The ranks ZeRO shards over: the mesh's data axis."""
        return self.mesh.data

    @property
    def tp(self):
        return self.mesh.tp

    @property
    def pp(self):
        return self.mesh.pp

    @property
    def ep(self):
        return self.mesh.ep

    @property
    def replicas(self):
        """MiCS's replica group (the ranks holding this rank's shard); None without MiCS."""
        return self.mesh.replicas

    @property
    def expert_comm(self):
        return self.mesh.expert_data

    @property
    def dp_size(self) -> int:
        return self.mesh.dp_size

    @property
    def rank(self) -> int:
        return self.mesh.data.rank

    @property
    def world_size(self) -> int:
        return self.mesh.data.world_size

    # Two states share a sharding when they share plan and mesh.
    def __eq__(self, other):
        return isinstance(other, Sharding) and other.plan == self.plan and other.mesh == self.mesh

    def __hash__(self):
        return hash((self.plan, id(self.comm)))

    def __repr__(self):
        p = self.plan
        return (
            f"Sharding(stage={p.stage}, rank={self.rank}/{self.world_size}, units={len(p.units)}, "
            f"params={p.num_params}, device={self.device}"
            + (f", tp={self.tp.rank}/{self.tp.size})" if self.tp is not None else ")")
        )


@optree.dataclasses.dataclass(frozen=True, eq=False, namespace="")
class LossScaleState:
    """fp16 dynamic loss scaling, as data (`specs/loss-scaling.md`).

    `scale`: the current loss scale; `good_steps`: consecutive steps without overflow since the
    last change; `hysteresis`: overflows still tolerated before the scale is cut. 0-dim CPU tensors.
    """

    scale: torch.Tensor
    good_steps: torch.Tensor
    hysteresis: torch.Tensor


@optree.dataclasses.dataclass(frozen=True, eq=False, namespace="")
class TrainState:
    """Everything a training step reads and writes, per rank.

    Fields (leaves are tensors; see `specs/sharding.md` for which are shards):
      params:     unit name -> flat parameter buffer in the compute dtype; the whole padded unit at
                  stages 0-2 (and for persistent units at stage 3), this rank's shard at stage 3.
      master:     unit name -> fp32 master weights (this rank's shard at stages 1-3) when the compute
                  dtype is 16-bit; None when params are already the master copy.
      opt_state:  the optimizer's state over the master shards.
      frozen:     requires_grad=False parameters by state_dict name, replicated, never updated.
      buffers:    module buffers by state_dict name, replicated.
      step:       applied optimizer steps (0-dim int64, CPU). Skipped fp16 steps do not count.
      loss_scale: LossScaleState for fp16, else None.
      sharding:   static metadata (plan + collectives), not a leaf.
    """

    params: dict[str, torch.Tensor]
    master: dict[str, torch.Tensor] | None
    opt_state: Any
    frozen: dict[str, torch.Tensor]
    buffers: dict[str, torch.Tensor]
    step: torch.Tensor
    loss_scale: LossScaleState | None
    sharding: Sharding = optree.dataclasses.field(pytree_node=False)

    def replace(self, **changes) -> "TrainState":
        """A copy with some fields changed (the state itself is immutable)."""
        return dataclasses.replace(self, **changes)

    @property
    def plan(self):
        return self.sharding.plan
