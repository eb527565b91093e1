"""The step's policies: what `fnzero.train_step` (and `init_state`, for the first loss scale) reads
from a Config, once, at the edge. Core code
receives these frozen policies, never the raw config, so it can be driven and tested without a
config file."""

from __future__ import annotations

import dataclasses

import torch

from ..sharding import DTYPES, config_precision, offload_device

__all__ = ["StepPolicy", "LossScalePolicy", "step_policy", "scaler_for"]


@dataclasses.dataclass(frozen=True)
class LossScalePolicy:
    """fp16 loss scaling (DeepSpeed's fp16 block). `static_scale` > 0 disables dynamic scaling."""

    static_scale: float = 0.0
    initial_scale_power: int = 16
    window: int = 1000
    hysteresis: int = 2
    consecutive_hysteresis: bool = False
    min_scale: float = 1.0

    @property
    def dynamic(self) -> bool:
        return self.static_scale <= 0


def scaler_for(policy: LossScalePolicy | None, placement) -> LossScalePolicy | None:
    """The scaler DeepSpeed runs for a state laid out by `placement`: `policy` under ZeRO (its
    DynamicLossScaler); without hysteresis where no optimizer state is sharded, as DeepSpeed's
    FP16_Optimizer, which wraps the optimizer without ZeRO, halves on every overflow
    (`specs/loss-scaling.md` §Stage 0). The state's placement, not the config's stage, decides:
    `fnzero.shard(model, stage=N, config=cfg)` runs stage N."""
    if policy is None or placement.optimizer:
        return policy
    return dataclasses.replace(policy, hysteresis=1, consecutive_hysteresis=False)


@dataclasses.dataclass(frozen=True)
class StepPolicy:
    accumulation_steps: int = 1
    clip: float = 1.0  # 0: off; 1.0 is DeepSpeed's `gradient_clipping` default
    loss_scale: LossScalePolicy | None = None
    accum_dtype: torch.dtype | None = None  # None: fp32 for 16-bit training, the param dtype otherwise
    comm_dtype: torch.dtype | None = None  # None: the gradient's own dtype
    predivide_factor: float = 1.0
    prescale_gradients: bool = False
    offload_optimizer: str | None = None  # None | "cpu" | "nvme"
    overlap_comm: bool = True  # start gradient collectives from backward hooks
    timings: bool = False  # wall_clock_breakdown: metrics["timings"] with forward/backward/comm/optimizer
    # On CPU, give the heap's free pages back between each forward and its backward, where
    # `fnzero.memory.return_freed_memory` tuned the allocator (`fnzero/_ext/_heap.py`).
    trim_heap: bool = True
    # The rows one micro-batch has (train_micro_batch_size_per_gpu) and the world size the
    # config's batch triad was resolved for; a batch is checked against them (`train/_setup.py`).
    micro_batch: int | None = None
    config_world: int | None = None

    @property
    def not_traceable(self) -> str | None:
        """Why a step of this policy cannot run as one graph (`fnzero.jit(scope="step")`), or None."""
        if self.offload_optimizer is not None:
            return "offload_optimizer runs the optimizer on the host, outside any graph"
        if self.timings:
            return "wall_clock_breakdown times phases that a single graph does not separate"
        return None


def comm_dtype_of(cfg) -> str | None:
    """The config's gradient-reduction dtype (None: the gradients' own). With sequence parallelism,
    DeepSpeed 0.19.8's engine sets `communication_data_type` to `seq_parallel_communication_data_type`
    (fp32 by default), so the former is then not consulted at all (specs/config.md §Top level)."""
    if cfg.sequence_parallel_size > 1:
        return cfg.seq_parallel_communication_data_type
    return cfg.communication_data_type


def step_policy(cfg) -> StepPolicy:
    precision = config_precision(cfg)
    ls = None
    if precision == "fp16":
        f = cfg.fp16
        ls = LossScalePolicy(
            static_scale=float(f.loss_scale),
            initial_scale_power=int(f.initial_scale_power),
            window=int(f.loss_scale_window),
            hysteresis=int(f.hysteresis),
            consecutive_hysteresis=bool(f.consecutive_hysteresis),
            min_scale=float(f.min_loss_scale),
        )
    return StepPolicy(
        accumulation_steps=int(cfg.gradient_accumulation_steps),
        clip=float(cfg.gradient_clipping or 0.0),
        loss_scale=ls,
        accum_dtype=DTYPES[cfg.data_types.grad_accum_dtype],
        comm_dtype=DTYPES[comm_dtype_of(cfg)],
        predivide_factor=float(cfg.gradient_predivide_factor),
        prescale_gradients=bool(cfg.prescale_gradients),
        offload_optimizer=offload_device(cfg),
        # Overlap changes only when collectives run, never their results, so fnzero overlaps
        # unless the config explicitly says `overlap_comm: false`.
        overlap_comm=cfg.zero_optimization.overlap_comm is not False,
        timings=bool(cfg.wall_clock_breakdown),
        micro_batch=cfg.train_micro_batch_size_per_gpu,
        config_world=cfg.world_size,
    )
