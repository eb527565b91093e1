"""Keys fnzero accepts but does not act on: one `ConfigWarning` each when a user sets one (specs/config.md
§Keys, legend **W**).

Silently accepting a value that asks for behaviour fnzero lacks would be the "silent acceptance"
STYLE.md warns of, and refusing it would break configs that work with DeepSpeed.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

from ._expert import NO_EFFECT_KEYS as EXPERT_NO_EFFECT
from ._models import Config
from ._optim_models import ONEBIT_TYPES
from ._types import describe

__all__ = ["ConfigWarning", "NO_EFFECT", "no_effect_table", "warn_no_effect"]


class ConfigWarning(UserWarning):
    """A config key was accepted but has no effect in fnzero (the message says why and what happens instead).

    Silence one with `warnings.filterwarnings("ignore", category=fnzero.config.ConfigWarning)`,
    or better, remove the key from the config.
    """


def _changed(path: str, when: Callable[[Any], bool] | None = None) -> Callable[[Any], Any]:
    """The user's value at dotted `path` of a config (training or inference) when it is not its model's
    default (DeepSpeed's) and `when(cfg)` holds, else None."""
    *parents, leaf = path.split(".")

    def value_of(cfg: Any) -> Any:
        if when is not None and not when(cfg):
            return None
        node: Any = cfg
        for part in parents:
            node = getattr(node, part)
        value = getattr(node, leaf)
        return value if value != type(node).model_fields[leaf].default else None
    return value_of


def _ratio(cfg: Config) -> float | None:
    oo = cfg.zero_optimization.offload_optimizer
    return oo.ratio if oo is not None and oo.ratio < 1.0 else None


def _onebit(cfg: Config) -> bool:
    return cfg.optimizer is not None and cfg.optimizer.type in ONEBIT_TYPES


NoEffect = tuple[Callable[[Any], Any], str]
_HOW = "the comms logger records every collective; it cannot restrict itself to prof_ops"
_NEVER_READ = "DeepSpeed's 1-bit optimizers store it and never read it"
_ONLY_COUNT = "the step-time model needs only the parameter count"
# dotted key -> why it has no effect: it warns when set to a value other than its default; or
# (the user's value when it asks for something fnzero does not do, else None; why).
_TABLE: dict[str, str | NoEffect] = {
    "fp16.auto_cast": "in fp16/bf16 training `ShardedModule.apply` always casts floating-point inputs to the compute "
                      "dtype, whatever auto_cast says",
    "bf16.check_grad_overflow": "fnzero checks every step's gradient norm, and stops with an error naming the step on "
                                "inf/NaN (DeepSpeed with the check on skips that step; with it off, applies it)",
    "dump_state": "fnzero prints no engine state; print(cfg.to_json()) shows the resolved config",
    "zero_optimization.ignore_unused_parameters": "fnzero never fails on a parameter that receives no gradient (its "
                                                  "gradient counts as zero)",
    "zero_optimization.offload_optimizer.ratio": (
        _ratio,
        "fnzero offloads either all of the optimizer state or none of it (only `fnzero plan` models a partial "
        "ratio)",
    ),
    "torch_autocast.lower_precision_safe_modules": (
        _changed("torch_autocast.lower_precision_safe_modules", lambda c: c.torch_autocast.enabled),
        "DeepSpeed reduces those modules' gradients in the autocast dtype; fnzero reduces every gradient in "
        "the parameters' dtype (more precise, and the same for every module)",
    ),
    "seq_parallel_communication_data_type": (
        _changed("seq_parallel_communication_data_type", lambda c: c.sequence_parallel_size == 1),
        "it is read only with sequence_parallel_size > 1, where gradients are reduced in this dtype in place of "
        "communication_data_type (as in DeepSpeed, whose engine reads it only then)",
    ),
    "comms_logger.verbose": "the comms logger records collectives in `ShardedModule.comm.records` and prints nothing "
                            "as they run",
    "comms_logger.debug": "records do not name the calling function",
    "comms_logger.prof_all": _HOW,
    "comms_logger.prof_ops": _HOW,
    "aio.single_submit": "fnzero's NVMe I/O thread pool always submits requests in batches",
    "aio.overlap_events": "fnzero's NVMe I/O thread pool always overlaps submission and completion",
    "checkpoint.tag_validation": "fnzero.checkpoint.save does not compare tags across ranks",
    "tensor_parallel.tp_overlap_comm": "fnzero's tensor-parallel all-reduces run in line with the layer that needs "
                                       "them",
    "tensor_parallel.keep_module_on_host": "fnzero already keeps weights on the host until each rank's slice is "
                                          "placed",
    "tensor_parallel.dtype": (
        lambda c: c.tensor_parallel.dtype if c.tensor_parallel.dtype.lower() not in ("fp16", "float16", "torch.float16")
        else None,
        "DeepSpeed reads it for inference; training precision comes from the fp16/bf16 blocks",
    ),
    "tensor_parallel.tensor_parallel.tp_size": "it sizes DeepSpeed's inference AutoTP; training splits over "
                                               "tensor_parallel.autotp_size ranks",
    "tensor_parallel.tensor_parallel.tp_grain_size": "DeepSpeed's training AutoTP does not read it either (uneven "
                                                     "splits are fnzero's default)",
    "pipeline.partition": "DeepSpeed does not read it either: PipelineModule(partition_method=...) decides how "
                          "layers are split",
    "pipeline.use_reentrant": "fnzero rematerialises with torch's non-reentrant checkpoint (the same numbers)",
    "zero_optimization.mics_hierarchical_params_gather": "fnzero gathers a unit with one all-gather over its MiCS "
        "shard group; DeepSpeed's two-level gather (across nodes, then within each) moves the same values over other "
        "links (specs/mesh.md §MiCS)",
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
    **{f"optimizer.params.{key}": (_changed(f"optimizer.params.{key}", _onebit), why) for key, why in {
        "cuda_aware": "fnzero's compressed all-reduce runs over the data-parallel collectives (no MPI)",
        "comm_backend_name": "fnzero's compressed all-reduce runs over the data-parallel collectives, whatever "
                             "backend they have",
        "bias_correction": f"{_NEVER_READ} (no bias correction)",
        "eps_inside_sqrt": _NEVER_READ,
        "max_grad_norm": _NEVER_READ,
    }.items()},
    "optimizer.params.torch_adam": (
        _changed("optimizer.params.torch_adam", lambda c: c.optimizer is not None and c.optimizer.type == "Muon"),
        "Muon's auxiliary Adam is fnzero's adam_chain either way (DeepSpeed's torch.optim.AdamW computes the same "
        "update)",
    ),
    # A disabled block has no effect at all (as in DeepSpeed), so it never warns.
    **{f"expert_parallel.{field}": (_changed(f"expert_parallel.{field}", lambda c: c.expert_parallel.enabled), why)
       for field, why in EXPERT_NO_EFFECT.items()},
    "autotuning.enabled": (
        lambda c: True if c.autotuning.enabled and c.autotuning.metric_path is None else None,
        "a training run does not tune (as in DeepSpeed, where only the launcher acts on the block): run "
        "`fnzero autotune` or `fnzero launch --autotuning tune|run` to tune",
    ),
    "autotuning.fast": "fnzero tunes only ZeRO stage x micro-batch x offload (DeepSpeed's fast mode), never the "
                       "buckets and overlap switches",
    "autotuning.mp_size": "fnzero reads the tensor-parallel size from `tensor_parallel.autotp_size`",
    "autotuning.model_info_path": "fnzero writes no model-info file; the first trial reports the parameter count",
    "autotuning.model_info.profile": "fnzero has no profile-only run",
    "autotuning.model_info.hidden_size": _ONLY_COUNT,
    "autotuning.model_info.num_layers": _ONLY_COUNT,
}


def no_effect_table(entries: dict[str, str | NoEffect]) -> dict[str, NoEffect]:
    """`entries` with each bare reason given its test: the key warns when set to a value other than its default."""
    return {path: entry if isinstance(entry, tuple) else (_changed(path), entry) for path, entry in entries.items()}


NO_EFFECT = no_effect_table(_TABLE)


def warn_no_effect(cfg: Any, stacklevel: int = 2, table: dict[str, NoEffect] = NO_EFFECT) -> list[str]:
    """Warn once per key of `table` (by default the training config's) that `cfg` sets to a value that
    would change something in DeepSpeed; returns the messages."""
    messages: list[str] = []
    for path, (value_of, why) in table.items():
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
