"""DeepSpeed keys that are aliases, that DeepSpeed removed, or that name features fnzero lacks.

Runs on the raw dict before validation (specs/config.md §Unsupported features, §Removed or
deprecated by DeepSpeed); a key reported here is dropped so that no later check reports it again.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

from ._problems import Problems
from ._types import describe

__all__ = ["normalize"]

# Top-level blocks of DeepSpeed features fnzero does not implement. Present-but-off is fine: null,
# false, {} or `enabled: false`. (`compile` is a model of its own: its off switch is `deepcompile`.)
UNSUPPORTED_BLOCKS = (
    "hybrid_engine", "compression_training", "quantize_training",
    "sparse_attention", "elasticity", "curriculum_learning", "data_efficiency", "wandb",
    "comet", "nebula", "eigenvalue", "progressive_layer_drop", "amp", "moe",
    "weight_quantization", "datastates", "zenflow",
)
# (`moe` is no DeepSpeed 0.19.8 key: its runtime/config.py reads none, so DeepSpeed ignores it; MoE layers
# are configured in code, `deepspeed.moe.layer.MoE`, and AutoEP by `expert_parallel`, a model of its own.)
# Of those, the blocks DeepSpeed 0.19.8 reads with `enabled` defaulting to false (HybridEngineConfig,
# WandbConfig, CometConfig): off unless enabled is true. (`autotuning` is a model of its own.)
OFF_UNLESS_ENABLED = {"hybrid_engine", "wandb", "comet"}
# Flags of unsupported features: key -> (value that means "off", what the feature is). An off value
# of None: only null (or absence) is off, as DeepSpeed builds the feature from any object, {} included.
UNSUPPORTED_FLAGS: dict[str, tuple[Any, str]] = {
    "compile.deepcompile": (False, "DeepCompile; fnzero.jit compiles the step instead"),
    "datastates_ckpt": (False, "DataStates checkpointing"),  # DeepSpeed: on unless false
    "use_data_before_expert_parallelism": (False, "the data-before-expert (D + E) rank order of expert-parallel groups"),
    "zero_optimization.zenflow": (None, "ZenFlow"),
    "zero_optimization.zeropp_loco_param": (None, "ZeRO++ LoCo"),
    "fp16.fp16_master_weights_and_grads": (False, "fp16 master weights"),
    "bf16.bf16_master_weights_and_grads": (False, "bf16 master weights"),
    "bf16.bf16_optimizer_states": (False, "bf16 optimizer states"),
    "aio.use_gds": (False, "GPUDirect Storage"),
    "sparse_gradients": (False, "CSR sparse gradients"),
    "graph_harvesting": (False, "graph harvesting"),
}
# Of those, the ones DeepSpeed turns on with any value but the off one (an object, null).
ANY_VALUE_ON = {"datastates_ckpt"}
# Of those, the keys fnzero's models do not carry (dropped once checked to be off).
NOT_FIELDS = {
    "use_data_before_expert_parallelism", "graph_harvesting", "sparse_gradients", "datastates_ckpt",
    "zero_optimization.zenflow", "zero_optimization.zeropp_loco_param", "fp16.fp16_master_weights_and_grads",
    "bf16.bf16_master_weights_and_grads", "bf16.bf16_optimizer_states",
}
# Keys DeepSpeed 0.19.8 refuses in any form, off included, because it removed the feature
# (runtime/config.py _REMOVED_TOP_LEVEL_CONFIG_KEYS, _REMOVED_ZERO_CONFIG_KEYS). fnzero accepts their off
# forms, which older DeepSpeed versions wrote, and warns that DeepSpeed itself would refuse them; MiCS's
# keys it also reads on, as DeepSpeed's last source did (IMPLEMENTED_REMOVED), with the same warning.
DEEPSPEED_REMOVED = (
    "amp", "compression_training", "curriculum_learning", "eigenvalue", "elasticity", "graph_harvesting", "nebula",
    "progressive_layer_drop", "quantize_training", "sparse_attention", "sparse_gradients",
    "zero_optimization.mics_hierarchical_params_gather", "zero_optimization.mics_shard_size",
    "zero_optimization.zeropp_loco_param",
)
IMPLEMENTED_REMOVED = {  # key -> (the values that mean "off", the feature)
    "zero_optimization.mics_shard_size": (lambda v: isinstance(v, (int, float)) and v <= 0, "MiCS"),
    "zero_optimization.mics_hierarchical_params_gather": (lambda v: v is False, "MiCS"),
}
# Keys DeepSpeed deprecated and replaced: key -> replacement advice.
REMOVED = {
    "zero_optimization.cpu_offload_params": '`zero_optimization.offload_param: {"device": "cpu"}`',
    "zero_optimization.allgather_size": "`zero_optimization.allgather_bucket_size`",
    "fp32_allreduce": '`communication_data_type: "fp32"`',
    "allreduce_always_fp32": '`communication_data_type: "fp32"`',
}
# Keys DeepSpeed 0.19.8 still reads but deprecates (runtime/zero/config.py, json_schema_extra
# "deprecated"): key -> (the key it sets, its value from the old one (None: set nothing)). As in
# DeepSpeed, giving both is an error; each use warns (ConfigWarning, after a successful load).
DEPRECATED: dict[str, tuple[str | None, Any]] = {
    "zero_optimization.cpu_offload": ("offload_optimizer", lambda v: {"device": "cpu"} if v else None),
    "zero_optimization.cpu_offload_param": ("offload_param", lambda v: {"device": "cpu"} if v else None),
    "zero_optimization.cpu_offload_use_pin_memory": (None, None),  # DeepSpeed: set_new_param False
    "zero_optimization.stage3_gather_fp16_weights_on_model_save": ("stage3_gather_16bit_weights_on_model_save",
                                                                  lambda v: v),
}

# The second spelling of a field in DeepSpeed 0.19.8's pydantic models (`Field(alias=...)`, read by
# name or alias) -> fnzero's field, which is whichever of the two DeepSpeed documents. DeepSpeed
# refuses both spellings in one block (pydantic's extra_forbidden), and so does fnzero, naming both.
MODEL_ALIASES = {
    "zero_optimization.prefetch_bucket_size": "zero_optimization.stage3_prefetch_bucket_size",
    "zero_optimization.param_persistence_threshold": "zero_optimization.stage3_param_persistence_threshold",
    "zero_optimization.model_persistence_threshold": "zero_optimization.stage3_model_persistence_threshold",
    "zero_optimization.max_live_parameters": "zero_optimization.stage3_max_live_parameters",
    "zero_optimization.max_reuse_distance": "zero_optimization.stage3_max_reuse_distance",
    "zero_optimization.gather_16bit_weights_on_model_save":
        "zero_optimization.stage3_gather_16bit_weights_on_model_save",
    "zero_optimization.module_granularity_threshold": "zero_optimization.stage3_module_granularity_threshold",
    "zero_optimization.use_all_reduce_for_fetch_params": "zero_optimization.stage3_use_all_reduce_for_fetch_params",
    "zero_optimization.allgather_sequential": "zero_optimization.stage3_allgather_sequential",
    "tensor_parallel.tp": "tensor_parallel.tensor_parallel",
    "tensor_parallel.kernel_inject": "tensor_parallel.replace_with_kernel_inject",
}
# Spellings DeepSpeed reads outside its models (it takes one of the two silently when both are
# given); fnzero takes both when they agree and refuses them, naming both, when they differ.
# `sp_size` is not DeepSpeed's (it ignores it): it is Hugging Face Accelerate's name for the same size
# (`ParallelismConfig.sp_size`), taken here so that a config written with it means what it says.
ALIASES = {
    "bfloat16": "bf16",
    "aio.intra_op_parallelism": "aio.thread_count",
    "sp_size": "sequence_parallel_size",
}


def _present(raw: dict[str, Any], keys: Iterable[str]) -> Iterator[tuple[str, dict[str, Any], str]]:
    """(dotted key, the object holding it, its last part) of each of `keys` that `raw` holds."""
    for dotted in keys:
        *head, leaf = dotted.split(".")
        node: Any = raw
        for part in head:
            node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, dict) and leaf in node:
            yield dotted, node, leaf


def _is_off(value: Any) -> bool:
    if value is None or value is False or value == {}:
        return True
    return isinstance(value, dict) and value.get("enabled") is False


def _rename_aliases(raw: dict[str, Any], problems: Problems) -> None:
    """Rewrite the other spelling of each key to fnzero's, reporting both spellings given at once."""
    for table, strict in ((MODEL_ALIASES, True), (ALIASES, False)):
        for old, parent, leaf in _present(raw, table):
            new = table[old]
            new_leaf = new.rsplit(".", 1)[-1]
            if new_leaf in parent and (strict or parent[new_leaf] != parent[leaf]):
                values = (f" (set to {describe(parent[leaf])} and {describe(parent[new_leaf])})"
                          if parent[new_leaf] != parent[leaf] else "")
                problems.add(f"`{old}` and `{new}` are two spellings of one key, both given{values}; keep only "
                             f"`{new}`" + (" (DeepSpeed refuses both together too)" if strict else ""))
            else:
                parent[new_leaf] = parent[leaf]
            del parent[leaf]


def _removed_by_deepspeed(raw: dict[str, Any]) -> list[str]:
    """A warning for each key present that DeepSpeed 0.19.8 refuses whatever its value."""
    out = []
    for key, parent, leaf in _present(raw, DEEPSPEED_REMOVED):
        is_off, what = IMPLEMENTED_REMOVED.get(key, (lambda v: True, ""))
        if is_off(parent[leaf]):
            out.append(f"`{key}` is off, so it has no effect in fnzero, but DeepSpeed 0.19.8 refuses this key in any "
                       "form since it removed the feature: remove it")
        else:
            out.append(f"`{key}` turns on {what}, which fnzero runs as DeepSpeed's last source did, but DeepSpeed "
                       "0.19.8 refuses this key in any form since it removed the feature")
    return out


def normalize(raw: dict[str, Any], problems: Problems) -> list[str]:
    """Rewrite aliases and deprecated keys, report removed/unsupported ones, in place; returns the
    deprecation messages to warn with once the config has loaded."""
    # Long: one self-contained branch per deprecated DeepSpeed key, read top to bottom like the table in
    # specs/config.md.
    deprecations = _removed_by_deepspeed(raw)  # warned only when the config loads, i.e. when they are off
    _rename_aliases(raw, problems)  # first: a deprecated key's replacement may be given in either spelling
    if isinstance(raw.get("zero_optimization"), bool):
        # DeepSpeed 0.19.8 still reads this (read_zero_config_deprecated), with a warning.
        stage = 1 if raw["zero_optimization"] else 0
        deprecations.append(
            f"`zero_optimization: {describe(raw['zero_optimization'])}` is a format DeepSpeed deprecates; read as "
            f'`zero_optimization: {{"stage": {stage}}}` (write that instead)'
        )
        raw["zero_optimization"] = {"stage": stage}
        if stage and "allgather_size" in raw:
            raw["zero_optimization"]["allgather_bucket_size"] = raw.pop("allgather_size")
    for key, parent, leaf in _present(raw, DEPRECATED):
        new, convert = DEPRECATED[key]
        value = parent.pop(leaf)
        if new is None:
            deprecations.append(f"`{key}` is deprecated in DeepSpeed and has no effect; remove it")
            continue
        if new in parent:
            problems.add(f"`{key}` is the deprecated form of `zero_optimization.{new}`; give only `zero_optimization.{new}`")
            continue
        if not isinstance(value, bool):
            problems.add(f"`{key}` must be true or false, got {describe(value)}")
            continue
        converted = convert(value)
        if converted is not None:
            parent[new] = converted
        deprecations.append(
            f"`{key}: {describe(value)}` is deprecated in DeepSpeed; read as "
            f"{f'`zero_optimization.{new}: {describe(converted)}`' if converted is not None else 'no offload'} "
            "(write that instead)"
        )

    for key, parent, leaf in _present(raw, REMOVED):
        problems.add(f"`{key}` was removed from DeepSpeed; use {REMOVED[key]} instead")
        del parent[leaf]

    for key in UNSUPPORTED_BLOCKS:
        if key in raw:
            value = raw[key]
            off = _is_off(value) or (key in OFF_UNLESS_ENABLED and isinstance(value, dict)
                                     and value.get("enabled", False) is False)
            if not off:
                problems.add(
                    f"`{key}` is a DeepSpeed feature fnzero does not implement; remove the block"
                    + (" or set enabled: false" if isinstance(raw[key], dict) and "enabled" in raw[key] else "")
                )
            del raw[key]

    for key, parent, leaf in _present(raw, UNSUPPORTED_FLAGS):
        off, what = UNSUPPORTED_FLAGS[key]
        value = parent[leaf]
        if value is off:
            if key in NOT_FIELDS:
                del parent[leaf]  # accepted when off, but not a field of fnzero's models
            continue
        if value is True or off is None or key in ANY_VALUE_ON:
            problems.add(
                f"`{key}` ({what}) is a DeepSpeed feature fnzero does not implement; remove it or set it to "
                f"{describe(off)}"
            )
            del parent[leaf]
        elif key in NOT_FIELDS:  # no field of fnzero's models would report the wrong type
            problems.add(f"`{key}` must be {describe(off)} (off), got {describe(value)}: {what} is a DeepSpeed "
                         "feature fnzero does not implement")
            del parent[leaf]
        # other wrong types (a string, a number) are left for the type check to report

    return deprecations
