"""The training state: an explicit, immutable pytree. Behaviour lives in functions elsewhere."""

from __future__ import annotations

import dataclasses
from typing import Any

import optree
import torch

__all__ = ["TrainState", "LossScaleState", "Sharding"]


class Sharding:
    """Where a state's tensors live: the ShardPlan (pure data, equal on every rank) and the
    collectives that connect the ranks. Like `jax.Array.sharding`, it travels with the state as
    static (non-leaf) metadata, so `train_step` needs nothing but the state and the batch.
    """

    __slots__ = ("plan", "comm", "device", "tp", "pp", "watchdog", "shard_sources", "ep", "quantization", "groups",
                 "optimizer")

    def __init__(self, plan, comm, device: torch.device, tp=None, pp=None, watchdog=None, ep=None, quantization=None,
                 groups=None, optimizer=None):
        self.plan = plan
        self.comm = comm  # the ranks ZeRO shards over: the data-parallel ranks, or with MiCS its shard group
        self.device = torch.device(device)
        # The tensor-parallel layout (`fnzero.sharding.TPLayout`): which parameters are this
        # rank's slices along the tp axis, and that axis' collectives; None without tensor parallelism.
        self.tp = tp
        # This rank's pipeline stage (`fnzero.pipeline.PipelineInfo`): which layers the plan holds,
        # and the pipeline's collectives; None without pipeline parallelism.
        self.pp = pp
        # The expert-parallel layout (`fnzero.sharding.EPLayout`): the modules holding this rank's
        # experts, the ep group they exchange tokens over and the expert-data-parallel group their
        # units are sharded and reduced over; None without expert parallelism.
        self.ep = ep
        # MiCS's replica group and hpZ's group (`fnzero.sharding.zero._groups.ZeroGroups`); None
        # without either (`specs/mesh.md §MiCS`).
        self.groups = groups
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
        # The config's optimizer block with the facts of the model it reads (`fnzero.optim.ConfigOptimizer`:
        # per_head_muon's head counts), resolved by `shard`, where the model is known: `init_state`
        # and the step build the config's optimizer from it; None without an optimizer block.
        self.optimizer = optimizer

    @property
    def rank(self) -> int:
        return self.comm.rank

    @property
    def world_size(self) -> int:
        return self.comm.world_size

    @property
    def replicas(self):
        """MiCS's replica group (the ranks holding this rank's shard); None without MiCS."""
        return self.groups.replicas if self.groups is not None else None

    @property
    def dp_size(self) -> int:
        """Data-parallel ranks: those sharing the batch (`world_size` times the MiCS replicas)."""
        return self.comm.world_size * (self.groups.num_replicas if self.groups is not None else 1)

    @property
    def expert_comm(self):
        """The collectives expert units are sharded and reduced over; None without expert parallelism."""
        return self.ep.expert_dp if self.ep is not None else None

    # Two states share a sharding when they share plan and communicator; identity is enough for the
    # communicator (one per process group) and keeps treespec comparison cheap.
    def __eq__(self, other):
        return (isinstance(other, Sharding) and other.plan == self.plan and other.comm is self.comm
                and other.tp == self.tp and other.pp == self.pp and other.ep is self.ep and other.groups is self.groups)

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
