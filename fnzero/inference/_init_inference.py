"""`fnzero.init_inference`: DeepSpeed-Inference's entry point, over `fnzero.shard` (`specs/inference.md`)."""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import nn

from .._errors import ConfigError
from ..config import ConfigWarning, describe
from .._state import TrainState
from ..sharding import current_world_size, default_device, ShardedModule, load_config, check_heads
from ..offload import store_shards
from ..state import initial_params, shard
from ._engine import InferenceEngine
from ._inference_config import InferenceConfig, read_inference_config
from ._int8 import int8_targets, quantize_model
from ._no_effect import refuse_objects, warn_no_effect

__all__ = ["init_inference"]

PRECISION_BLOCK = {torch.float16: "fp16", torch.bfloat16: "bf16"}


def init_inference(model: nn.Module, config: Any = None, **kwargs: Any) -> InferenceEngine:
    """DeepSpeed's `deepspeed.init_inference(model, config=None, **kwargs)` on fnzero: `model` laid
    out for inference over this world's ranks, its weights read from `checkpoint` when given.

    `config`: None, a dict, a path or JSON text of DeepSpeed-Inference keys; `kwargs`: the same
    keys, merged over it (two different values for one key are DeepSpeed's `Conflicting argument`
    ConfigError). Keys, aliases and defaults are DeepSpeed 0.19.8's (`specs/inference.md` §Keys):
    `dtype` (default torch.float16; `torch.int8`: weight-only int8), `tensor_parallel` (AutoTP),
    `checkpoint` (safetensors or `save_pretrained`, read per rank), `max_out_tokens`, `zero`
    (ZeRO-Inference). Keys for DeepSpeed's CUDA kernels warn (`ConfigWarning`) that they have no
    effect. The model is put in eval mode.

    >>> import torch, fnzero
    >>> engine = fnzero.init_inference(torch.nn.Linear(3, 2), dtype=torch.float32)
    >>> engine(torch.ones(1, 3)).shape
    torch.Size([1, 2])
    """
    cfg, given = read_inference_config(config, kwargs)
    refuse_objects(cfg)
    warn_no_effect(cfg, given, stacklevel=2)
    _check_model(model, cfg)
    world = current_world_size()
    tp = cfg.tensor_parallel.tp_size
    if world % tp:
        raise ConfigError(f"tensor_parallel.tp_size {tp} does not divide the world size {world}: the world is "
                          f"data-parallel replicas x tensor-parallel ranks, so it must be a multiple of {tp}")
    if tp > 1:
        check_heads(model, tp, "tensor_parallel.tp_size")
    shard_cfg = _shard_config(cfg, world)
    int8 = cfg.dtype == torch.int8
    if not int8:
        model.to(cfg.dtype)  # DeepSpeed's _convert_to_dtype (a meta model is converted too)
    targets = int8_targets(model) if int8 else []
    for path in targets:  # held whole per rank, outside ZeRO's units, until quantised (`_int8.py`)
        model.get_submodule(path).weight.requires_grad_(False)
    model.eval()
    sm = shard(model, config=shard_cfg, device=default_device())
    compute = sm.policy.compute_dtype or sm.plan.param_dtype
    params = {n: t.to(compute) for n, t in initial_params(sm, cfg.checkpoint_path, stacklevel=4).items()}
    if sm.policy.offload_param == "nvme":  # ZeRO-Inference: the shards in a parameter store, placeholders here
        params = store_shards(sm, params)
    elif sm.policy.offload_param == "cpu" and sm.sharding.device.type != "cpu":  # in host memory (a CPU run's already are)
        params = store_shards(sm, params, where="cpu")
    frozen, buffers = sm.constants
    if targets:
        frozen = quantize_model(sm.module, frozen, targets)
        sm.replace_constants(frozen, buffers)
    state = TrainState(params=params, master=None, opt_state=None,
                       frozen=frozen, buffers=buffers, step=torch.zeros((), dtype=torch.int64), loss_scale=None,
                       sharding=sm.sharding)
    return InferenceEngine(sm, state, cfg)


def _check_model(model: Any, cfg: InferenceConfig) -> None:
    if isinstance(model, (ShardedModule, TrainState)):
        what = "int8 weights cannot be trained, and a" if cfg.dtype == torch.int8 else "a"
        raise ConfigError(
            f"init_inference takes the model itself (an nn.Module, on any device or the meta device), not a "
            f"{type(model).__name__}: {what} {type(model).__name__} belongs to training (its optimizer state and "
            "master weights). Export the trained weights (fnzero.checkpoint.export, or sm.state_dict(state) saved "
            "with safetensors) and call init_inference(fresh model, checkpoint=that file or directory)")
    if not isinstance(model, nn.Module):
        raise ConfigError(f"init_inference takes an nn.Module, got a {type(model).__name__}")


def _shard_config(cfg: InferenceConfig, world: int):
    """The training-config form of the inference keys `fnzero.shard` reads: the ZeRO section, the
    tensor-parallel size and the 16-bit precision block."""
    zero = dict(cfg.zero)
    offload = zero.pop("offload_optimizer", None)
    if offload is not None:
        # A training config's section (DeepSpeedExamples' ds_config_nvme.json: parameters on nvme, the
        # optimizer on the cpu): DeepSpeed validates the block and its engine reads nothing of `zero`;
        # an engine has no optimizer, so the block is checked, warned about, and not passed on.
        _load_zero({"stage": 3, "offload_optimizer": offload}, world)
        if isinstance(offload, dict) and offload.get("device", "none") not in ("none", None):
            warnings.warn(f"`zero.offload_optimizer` is {describe(offload)}, which has no effect in fnzero: an inference "
                          "engine has no optimizer to offload; remove the key to silence this warning",
                          ConfigWarning, stacklevel=3)
    if cfg.dtype == torch.int8 and zero.get("stage") == 3:
        raise ConfigError("dtype int8 with `zero.stage` 3: int8 weights are held whole on each rank (tensor-parallel "
                          "slices), outside the units ZeRO-3 shards; use stage 0, or a floating dtype")
    raw = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": zero,
           # Whole logits out of the LM head (gathered over the vocabulary), as the model's callers expect.
           "tensor_parallel": {"autotp_size": cfg.tensor_parallel.tp_size if cfg.tensor_parallel.tp_size > 1 else 0,
                               "vocab_parallel_lm_head": False}}
    if cfg.dtype in PRECISION_BLOCK:
        raw[PRECISION_BLOCK[cfg.dtype]] = {"enabled": True}
    return _load_zero(zero, world, raw)


def _load_zero(zero: dict, world: int, raw: dict | None = None):
    """`raw` (by default a config of `zero` alone) loaded, its errors said to come from `zero`."""
    try:
        return load_config(raw or {"train_micro_batch_size_per_gpu": 1, "zero_optimization": zero}, world_size=world)
    except ConfigError as err:
        raise ConfigError(f"DeepSpeed-Inference's `zero` section is read as a training config's "
                          f"zero_optimization: {err}") from None
