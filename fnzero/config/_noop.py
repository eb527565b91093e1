"""Keys fnzero accepts but does not act on: one `ConfigWarning` each when a user sets one.

DeepSpeed reads these keys and changes what it does (prints, raises, logs, loads another format);
fnzero's runtime never reads them. Silently accepting a value that asks for behaviour fnzero
lacks would be the "silent acceptance" STYLE.md tells us to avoid, and refusing it would break
configs that work with DeepSpeed; so `load_config` accepts the value and warns once, naming the
key, its value and what fnzero does instead. Default values never warn. specs/config.md marks
these keys **W**.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

from ._autotuning import AUTOTUNING_NO_EFFECT
from ._expert import NO_EFFECT_KEYS as EXPERT_NO_EFFECT
from ._expert import ExpertParallelConfig
from ._models import Config
from ._optim_models import ONEBIT_TYPES
from ._types import describe

__all__ = ["ConfigWarning", "NO_EFFECT", "warn_no_effect"]


class ConfigWarning(UserWarning):
    """A config key was accepted but has no effect in fnzero (the message says why and what happens instead).

    Silence one with `warnings.filterwarnings("ignore", category=fnzero.config.ConfigWarning)`,
    or better, remove the key from the config.
    """


def _onebit_value(key: str, default: Any) -> Callable[[Config], Any]:
    """The user's value of `optimizer.params.<key>` for a 1-bit optimizer type when it is not the default."""

    def value_of(cfg: Config) -> Any:
        if cfg.optimizer is None or cfg.optimizer.type not in ONEBIT_TYPES:
            return None
        value = getattr(cfg.optimizer.params, key)
        return value if value != default else None
    return value_of


def _ratio(cfg: Config) -> float | None:
    oo = cfg.zero_optimization.offload_optimizer
    return oo.ratio if oo is not None and oo.ratio < 1.0 else None


# dotted key -> (the user's value when it is not the default, else None; why it has no effect).
NO_EFFECT: dict[str, tuple[Callable[[Config], Any], str]] = {
    "fp16.auto_cast": (
        lambda c: True if c.fp16.auto_cast else None,
        "in fp16/bf16 training `ShardedModule.apply` always casts floating-point inputs to the compute dtype, "
        "whatever auto_cast says",
    ),
    "bf16.check_grad_overflow": (
        lambda c: False if not c.bf16.check_grad_overflow else None,
        "fnzero checks every step's gradient norm, and stops with an error naming the step on inf/NaN (DeepSpeed "
        "with the check on skips that step; with it off, applies it)",
    ),
    "dump_state": (
        lambda c: True if c.dump_state else None,
        "fnzero prints no engine state; print(cfg.to_json()) shows the resolved config",
    ),
    "zero_optimization.ignore_unused_parameters": (
        lambda c: False if not c.zero_optimization.ignore_unused_parameters else None,
        "fnzero never fails on a parameter that receives no gradient (its gradient counts as zero)",
    ),
    "zero_optimization.offload_optimizer.ratio": (
        _ratio,
        "fnzero offloads either all of the optimizer state or none of it (only `fnzero plan` models a partial "
        "ratio)",
    ),
    "torch_autocast.lower_precision_safe_modules": (
        lambda c: list(c.torch_autocast.lower_precision_safe_modules)
        if c.torch_autocast.enabled and c.torch_autocast.lower_precision_safe_modules is not None else None,
        "DeepSpeed reduces those modules' gradients in the autocast dtype; fnzero reduces every gradient in "
        "the parameters' dtype (more precise, and the same for every module)",
    ),
    "seq_parallel_communication_data_type": (
        lambda c: c.seq_parallel_communication_data_type if c.seq_parallel_communication_data_type != "fp32" else None,
        "fnzero has no sequence (Ulysses) parallelism, whose all-to-alls this dtype is for",
    ),
    "comms_logger.verbose": (
        lambda c: True if c.comms_logger.verbose else None,
        "the comms logger records collectives in `ShardedModule.comm.records` and prints nothing as they run",
    ),
    "comms_logger.debug": (
        lambda c: True if c.comms_logger.debug else None,
        "records do not name the calling function",
    ),
    "comms_logger.prof_all": (
        lambda c: False if not c.comms_logger.prof_all else None,
        "the comms logger records every collective; it cannot restrict itself to prof_ops",
    ),
    "comms_logger.prof_ops": (
        lambda c: list(c.comms_logger.prof_ops) or None,
        "the comms logger records every collective; it cannot restrict itself to prof_ops",
    ),
    "aio.single_submit": (
        lambda c: True if c.aio.single_submit else None,
        "fnzero's NVMe I/O thread pool always submits requests in batches",
    ),
    "aio.overlap_events": (
        lambda c: False if not c.aio.overlap_events else None,
        "fnzero's NVMe I/O thread pool always overlaps submission and completion",
    ),
    "checkpoint.tag_validation": (
        lambda c: c.checkpoint.tag_validation if c.checkpoint.tag_validation != "Warn" else None,
        "fnzero.checkpoint.save does not compare tags across ranks",
    ),
    "tensor_parallel.tp_overlap_comm": (
        lambda c: True if c.tensor_parallel.tp_overlap_comm else None,
        "fnzero's tensor-parallel all-reduces run in line with the layer that needs them",
    ),
    "tensor_parallel.keep_module_on_host": (
        lambda c: True if c.tensor_parallel.keep_module_on_host else None,
        "fnzero already keeps weights on the host until each rank's slice is placed",
    ),
    "tensor_parallel.dtype": (
        lambda c: c.tensor_parallel.dtype if c.tensor_parallel.dtype.lower() not in ("fp16", "float16", "torch.float16")
        else None,
        "DeepSpeed reads it for inference; training precision comes from the fp16/bf16 blocks",
    ),
    "tensor_parallel.tensor_parallel.tp_size": (
        lambda c: c.tensor_parallel.tensor_parallel.tp_size if c.tensor_parallel.tensor_parallel.tp_size != 1 else None,
        "it sizes DeepSpeed's inference AutoTP; training splits over tensor_parallel.autotp_size ranks",
    ),
    "tensor_parallel.tensor_parallel.tp_grain_size": (
        lambda c: c.tensor_parallel.tensor_parallel.tp_grain_size
        if c.tensor_parallel.tensor_parallel.tp_grain_size != 1 else None,
        "DeepSpeed's training AutoTP does not read it either (uneven splits are fnzero's default)",
    ),
    "pipeline.partition": (
        lambda c: c.pipeline.partition if c.pipeline.partition != "best" else None,
        "DeepSpeed does not read it either: PipelineModule(partition_method=...) decides how layers are split",
    ),
    "pipeline.use_reentrant": (
        lambda c: c.pipeline.use_reentrant,
        "fnzero rematerialises with torch's non-reentrant checkpoint (the same numbers)",
    ),
    "zero_optimization.mics_hierarchical_params_gather": (
        lambda c: True if c.zero_optimization.mics_hierarchical_params_gather else None,
        "fnzero gathers a unit with one all-gather over its MiCS shard group; DeepSpeed's two-level gather "
        "(across nodes, then within each) moves the same values over other links (specs/mesh.md §MiCS)",
    ),
    "zero_optimization.mics_shard_size": (
        lambda c: c.zero_optimization.mics_shard_size
        if c.zero_optimization.mics_shard_size > 0 and c.zero_optimization.stage == 0 else None,
        "at ZeRO stage 0 nothing is sharded, so there is nothing to shard within MiCS groups (fnzero runs MiCS at "
        "stages 1-3)",
    ),
    "zero_optimization.zero_hpz_partition_size": (
        lambda c: c.zero_optimization.zero_hpz_partition_size
        if c.zero_optimization.zero_hpz_partition_size > 1 and c.zero_optimization.stage < 3 else None,
        "hpZ keeps a secondary partition of the parameters, which are sharded only at ZeRO stage 3 (as in "
        "DeepSpeed, which ignores it below)",
    ),
    "checkpoint.load_universal": (
        lambda c: True if c.checkpoint.load_universal else None,
        "fnzero.checkpoint.load reads fnzero checkpoints only, not DeepSpeed universal checkpoints",
    ),
    **{f"optimizer.params.{key}": (_onebit_value(key, default), why) for key, (default, why) in {
        "cuda_aware": (False, "fnzero's compressed all-reduce runs over the data-parallel collectives (no MPI)"),
        "comm_backend_name": ("nccl", "fnzero's compressed all-reduce runs over the data-parallel collectives, "
                              "whatever backend they have"),
        "bias_correction": (True, "DeepSpeed's 1-bit optimizers store it and never read it (no bias correction)"),
        "eps_inside_sqrt": (False, "DeepSpeed's 1-bit optimizers store it and never read it"),
        "max_grad_norm": (0.0, "DeepSpeed's 1-bit optimizers store it and never read it"),
    }.items()},
    "optimizer.params.torch_adam": (
        lambda c: True if c.optimizer is not None and c.optimizer.type == "Muon" and c.optimizer.params.torch_adam
        else None,
        "Muon's auxiliary Adam is fnzero's adam_chain either way (DeepSpeed's torch.optim.AdamW computes the same update)",
    ),
}


def _expert_value(field: str) -> Callable[[Config], Any]:
    """The user's value of `expert_parallel.<field>` when the block is enabled and it is not DeepSpeed's default."""
    default = ExpertParallelConfig.model_fields[field].default

    def value_of(cfg: Config) -> Any:
        value = getattr(cfg.expert_parallel, field)
        return value if cfg.expert_parallel.enabled and value != default else None
    return value_of


# A disabled block has no effect at all (as in DeepSpeed), so it never warns.
NO_EFFECT.update({f"expert_parallel.{field}": (_expert_value(field), why) for field, why in EXPERT_NO_EFFECT.items()})


def warn_no_effect(cfg: Config, stacklevel: int = 2) -> list[str]:
    """Warn once per key of NO_EFFECT that `cfg` sets to a non-default value; returns the messages."""
    messages: list[str] = []
    for path, (value_of, why) in NO_EFFECT.items():
        value = value_of(cfg)
        if value is None:
            continue
        message = (
            f"`{path}` is {describe(value)}, which has no effect in fnzero: {why}; "
            "remove the key (or set DeepSpeed's default) to silence this warning"
        )
        warnings.warn(message, ConfigWarning, stacklevel=stacklevel + 1)
        messages.append(message)
    return messages
NO_EFFECT.update(AUTOTUNING_NO_EFFECT)
