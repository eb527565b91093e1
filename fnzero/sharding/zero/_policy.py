"""The sharding policy: what `fnzero.shard` reads from a Config, once, at the edge, so core code never
sees the raw config. The precision and offload readers serve the step's policy too (`state/_policy.py`)."""

from __future__ import annotations

import dataclasses

import torch

from ..._errors import ConfigError
from ..comm import BlockQuantizer, CommQuantization
from ._placement import REPLICATED, Placement, placement_for_stage

__all__ = ["ShardPolicy", "shard_policy", "DTYPES", "config_precision", "offload_device", "comm_quantization",
           "checked_quantization"]

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16, None: None}


@dataclasses.dataclass(frozen=True)
class ShardPolicy:
    placement: Placement = REPLICATED  # what is sharded (`zero_optimization.stage` names a preset)
    compute_dtype: torch.dtype | None = None  # None: keep the model's dtype (fp32 or fp64 training)
    persistence_threshold: int = 0
    prefetch_numel: int = 0
    max_live_numel: int = 10**18
    max_reuse_distance: int = 1_000_000_000  # stage3_max_reuse_distance, DeepSpeed's default
    offload_optimizer: str | None = None  # None | "cpu" | "nvme"
    offload_param: str | None = None  # None | "cpu" | "nvme"
    # `torch_autocast`: forward runs under torch.autocast with this dtype ("default": the
    # device's autocast default, as DeepSpeed passes dtype=None); None: off.
    autocast_dtype: torch.dtype | str | None = None
    # ZeRO++'s `zero_quantized_*`: the codecs of what stage 3's gathers and the gradient
    # reduce-scatters carry; None: full precision (`comm_quantization`).
    quantization: CommQuantization | None = None


def config_precision(cfg) -> str:
    """fp16 or bf16 when that block of the config is enabled, else fp32."""
    if cfg is None:
        return "fp32"
    return "fp16" if cfg.fp16.enabled else "bf16" if cfg.bf16.enabled else "fp32"


def offload_device(cfg, block: str = "offload_optimizer") -> str | None:
    """`zero_optimization.<block>.device`, None when absent or "none"."""
    if cfg is None:
        return None
    oo = getattr(cfg.zero_optimization, block)  # the block is named by the caller
    dev = oo.device if oo is not None else None
    return None if dev in (None, "none") else str(dev)


def shard_policy(cfg, stage: "int | Placement | None" = None) -> ShardPolicy:
    """The config's sharding policy; `stage` (a ZeRO stage or a `Placement`) overrides its stage."""
    if cfg is None:
        return ShardPolicy(placement=placement_for_stage(stage or 0))
    z = cfg.zero_optimization
    precision = config_precision(cfg)
    return ShardPolicy(
        placement=placement_for_stage(z.stage if stage is None else stage),
        compute_dtype=None if precision == "fp32" else DTYPES[precision],
        persistence_threshold=int(z.stage3_param_persistence_threshold),
        prefetch_numel=int(z.stage3_prefetch_bucket_size),
        max_live_numel=int(z.stage3_max_live_parameters),
        max_reuse_distance=int(z.stage3_max_reuse_distance),
        offload_optimizer=offload_device(cfg),
        offload_param=offload_device(cfg, "offload_param"),
        autocast_dtype=_autocast_dtype(cfg),
        quantization=comm_quantization(cfg),
    )


def comm_quantization(cfg) -> CommQuantization | None:
    """The config's `zero_quantized_*` switches as `BlockQuantizer()` codecs, None when none is on
    (`specs/collectives.md` §Quantized collectives)."""
    if cfg is None:
        return None
    z = cfg.zero_optimization
    int8 = BlockQuantizer()
    q = CommQuantization(weights=int8 if z.zero_quantized_weights else None,
                         frozen_weights=int8 if z.zero_quantized_nontrainable_weights else None,
                         gradients=int8 if z.zero_quantized_gradients else None)
    return q if q.active else None


def _autocast_dtype(cfg) -> torch.dtype | str | None:
    ac = cfg.torch_autocast
    if ac is None or not ac.enabled:
        return None
    return DTYPES[ac.dtype] if ac.dtype is not None else "default"


def checked_quantization(policy: ShardPolicy, given: CommQuantization | None) -> CommQuantization | None:
    """`given`, else the config's (`policy.quantization`), refused where it would quantize nothing:
    weights need stage 3, gradients stage 2 or 3, as in DeepSpeed."""
    q = given if given is not None else policy.quantization
    if q is None or not q.active:
        return None
    stage = policy.placement.stage
    for key, codec, needs, ok in (
        ("zero_quantized_weights", q.weights, 3, policy.placement.params),
        ("zero_quantized_nontrainable_weights", q.frozen_weights, 3, policy.placement.params),
        ("zero_quantized_gradients", q.gradients, 2, policy.placement.grads),
    ):
        if codec is not None and not ok:
            raise ConfigError(
                f"`zero_optimization.{key}` quantizes what ZeRO stage {needs} moves, but this run is stage {stage}; "
                f"use stage {needs}{' or 3' if needs == 2 else ''}, or remove it")
    return q
