"""Small frozen policies read from a Config once, at the edge. Core code receives these, never the
raw config, so it can be driven and tested without a config file."""

from __future__ import annotations

import dataclasses

import torch

__all__ = ["ShardPolicy", "StepPolicy", "LossScalePolicy", "shard_policy", "step_policy"]

_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16, None: None}


@dataclasses.dataclass(frozen=True)
class ShardPolicy:
    stage: int = 0
    compute_dtype: torch.dtype | None = None  # None: keep the model's dtype (fp32 or fp64 training)
    persistence_threshold: int = 0
    prefetch_numel: int = 0
    max_live_numel: int = 10**18
    offload_optimizer: str | None = None  # None | "cpu" | "nvme"
    offload_param: str | None = None  # None | "cpu" | "nvme"
    # `torch_autocast`: forward runs under torch.autocast with this dtype ("default": the
    # device's autocast default, as DeepSpeed passes dtype=None); None: off.
    autocast_dtype: torch.dtype | str | None = None


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


def _cfg_precision(cfg) -> str:
    fp16 = getattr(getattr(cfg, "fp16", None), "enabled", False)
    bf16 = getattr(getattr(cfg, "bf16", None), "enabled", False)
    return "fp16" if fp16 else "bf16" if bf16 else "fp32"


def _offload_device(cfg, block: str = "offload_optimizer") -> str | None:
    oo = getattr(getattr(cfg, "zero_optimization", None), block, None)
    dev = getattr(oo, "device", None)
    return None if dev in (None, "none") else str(dev)


def shard_policy(cfg, stage: int | None = None) -> ShardPolicy:
    if cfg is None:
        return ShardPolicy(stage=stage or 0)
    z = cfg.zero_optimization
    precision = _cfg_precision(cfg)
    return ShardPolicy(
        stage=z.stage if stage is None else stage,
        compute_dtype=None if precision == "fp32" else _DTYPES[precision],
        persistence_threshold=int(z.stage3_param_persistence_threshold),
        prefetch_numel=int(z.stage3_prefetch_bucket_size),
        max_live_numel=int(z.stage3_max_live_parameters),
        offload_optimizer=_offload_device(cfg),
        offload_param=_offload_device(cfg, "offload_param"),
        autocast_dtype=_autocast_dtype(cfg),
    )


def _autocast_dtype(cfg) -> torch.dtype | str | None:
    ac = getattr(cfg, "torch_autocast", None)
    if ac is None or not ac.enabled:
        return None
    return _DTYPES[ac.dtype] if ac.dtype is not None else "default"


def step_policy(cfg) -> StepPolicy:
    precision = _cfg_precision(cfg)
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
    data_types = getattr(cfg, "data_types", None)
    accum = getattr(data_types, "grad_accum_dtype", None) if data_types is not None else None
    return StepPolicy(
        accumulation_steps=int(cfg.gradient_accumulation_steps),
        clip=float(cfg.gradient_clipping or 0.0),
        loss_scale=ls,
        accum_dtype=_DTYPES[accum],
        comm_dtype=_DTYPES[getattr(cfg, "communication_data_type", None)],
        predivide_factor=float(getattr(cfg, "gradient_predivide_factor", 1.0) or 1.0),
        prescale_gradients=bool(getattr(cfg, "prescale_gradients", False)),
        offload_optimizer=_offload_device(cfg),
        # Overlap changes only when collectives run, never their results, so fnzero overlaps
        # unless the config explicitly says `overlap_comm: false`.
        overlap_comm=getattr(getattr(cfg, "zero_optimization", None), "overlap_comm", None) is not False,
        timings=bool(getattr(cfg, "wall_clock_breakdown", False)),
    )
