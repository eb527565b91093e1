"""Models of the smaller DeepSpeed sections: precision, aio, activation checkpointing, logging, checkpoint.

Defaults are DeepSpeed 0.19.8's (pinned by tests/test_config_defaults.py): runtime/precision_config.py,
swap_tensor/constants.py, activation_checkpointing/config.py, comm/constants.py, profiling/constants.py,
monitor/config.py, runtime/config.py and runtime/constants.py.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, field_validator

from ._types import Bool, Float, Int, Model, PosInt, Str, StrList, before

__all__ = [
    "FP16Config", "BF16Config", "TorchAutocastConfig", "AioConfig", "ActivationCheckpointingConfig",
    "CommsLoggerConfig", "DataTypesConfig", "FlopsProfilerConfig", "TensorboardConfig", "CsvMonitorConfig",
    "CheckpointConfig", "ParallelWriteConfig", "CompileConfig", "TimersConfig", "ThroughputTimerConfig", "DType",
    "canonical_dtype",
]

DType = Literal["fp32", "fp16", "bf16"]
_DTYPE_SPELLINGS = {
    "fp32": "fp32", "float32": "fp32", "float": "fp32", "torch.float32": "fp32",
    "fp16": "fp16", "float16": "fp16", "half": "fp16", "torch.float16": "fp16",
    "bf16": "bf16", "bfloat16": "bf16", "torch.bfloat16": "bf16",
}


def canonical_dtype(value: object) -> object:
    """DeepSpeed's dtype spellings ("float16", "torch.bfloat16", "BF16") -> fp32/fp16/bf16; others unchanged."""
    if isinstance(value, str):
        return _DTYPE_SPELLINGS.get(value.strip().lower(), value)
    return value


class FP16Config(Model):
    """`fp16`: fp16 mixed precision with (dynamic) loss scaling."""

    enabled: Bool = Field(False, description="Train with fp16 compute and fp32 master weights.")
    auto_cast: Bool = Field(
        False, description="DeepSpeed: cast floating-point inputs to fp16. No effect: fnzero always casts them (warns when true)."
    )
    loss_scale: Annotated[Float, Field(ge=0.0)] = Field(0.0, description="Static loss scale; 0 = dynamic scaling.")
    initial_scale_power: Annotated[Int, Field(ge=0, le=127)] = Field(16, description="Dynamic scaling starts at 2**power.")
    loss_scale_window: PosInt = Field(1000, description="Overflow-free steps before the scale is raised.")
    hysteresis: PosInt = Field(2, description="Overflows tolerated before the scale is lowered.")
    consecutive_hysteresis: Bool = Field(False, description="Refill hysteresis after every overflow-free step.")
    # DeepSpeed 0.19.8 types it `int` (1e-10 or 0.5 is refused there): a whole number > 0.
    min_loss_scale: PosInt = Field(1, description="Floor of the dynamic loss scale (a whole number, as DeepSpeed).")


class BF16Config(Model):
    """`bf16` (legacy spelling `bfloat16`): bf16 mixed precision, no loss scaling."""

    enabled: Bool = Field(False, description="Train with bf16 compute and fp32 master weights.")
    immediate_grad_update: Bool = Field(False, description="DeepSpeed kernel scheduling hint; accepted, no effect.")
    check_grad_overflow: Bool = Field(
        True, description="DeepSpeed skips a bf16 step whose gradients overflow; fnzero always checks, and stops "
        "with an error naming the step (warns when false).")


class TorchAutocastConfig(Model):
    """`torch_autocast`: run forward under torch.autocast instead of casting the model."""

    enabled: Bool = Field(False, description="Wrap forward in torch.autocast.")
    dtype: Literal["fp16", "bf16"] | None = Field(
        None, description="Autocast dtype; null = torch.autocast's default for the device (DeepSpeed passes dtype=None)."
    )
    lower_precision_safe_modules: StrList | None = Field(
        None,
        description="Fully qualified module class names whose parameters communicate in the autocast dtype; "
        "null = torch.nn.Linear and Conv1d/2d/3d (DeepSpeed's LOWER_PRECISION_SAFE_MODULES).",
    )

    _dt = before(canonical_dtype, "dtype")


class AioConfig(Model):
    """`aio`: asynchronous NVMe I/O settings used by NVMe offload."""

    block_size: PosInt = Field(1_048_576, description="Bytes per I/O request.")
    queue_depth: PosInt = Field(8, description="Outstanding I/O requests.")
    thread_count: PosInt = Field(1, description="I/O threads per request (DeepSpeed's newer name: intra_op_parallelism).")
    single_submit: Bool = Field(False, description="Submit requests one at a time; no effect in fnzero (warns when true).")
    overlap_events: Bool = Field(True, description="Overlap submission and completion; fnzero always does (warns when false).")
    use_gds: Bool = Field(False, description="NVIDIA GPUDirect Storage; must be false (not implemented).")


class ActivationCheckpointingConfig(Model):
    """`activation_checkpointing`: options for recomputing activations in backward."""

    partition_activations: Bool = Field(False, description="Shard checkpointed activations across ranks.")
    contiguous_memory_optimization: Bool = Field(False, description="Copy checkpoints into one contiguous buffer.")
    cpu_checkpointing: Bool = Field(False, description="Keep checkpointed activations in host memory.")
    number_checkpoints: PosInt | None = Field(None, description="Checkpoints per forward for the contiguous buffer.")
    synchronize_checkpoint_boundary: Bool = Field(False, description="Synchronize at each checkpoint boundary.")
    profile: Bool = Field(False, description="Time checkpointed forward/backward.")


class CommsLoggerConfig(Model):
    """`comms_logger`: log collective operations."""

    enabled: Bool = Field(False, description="Record collectives.")
    verbose: Bool = Field(False, description="Print every collective as it happens; no effect in fnzero (warns when true).")
    prof_all: Bool = Field(True, description="Record all collectives (else only prof_ops); fnzero always records all.")
    debug: Bool = Field(False, description="Include the calling function in records; no effect in fnzero (warns when true).")
    prof_ops: StrList = Field((), description="Collective names to record when prof_all is false; no effect in fnzero.")


class WatchdogConfig(Model):
    """`watchdog` (fnzero's own; DeepSpeed has no such key and ignores it): how long a rank may
    wait in a collective for another rank that does not come, before the job ends naming it."""

    timeout_seconds: Annotated[Float, Field(ge=0.0)] = Field(
        300.0, description="Seconds a collective may wait for a missing rank (0 = off; at most half the process "
        "group's timeout, init_distributed's timeout_s, so that the rank is named before that timeout fails another).")


class DataTypesConfig(Model):
    """`data_types`: dtypes of internal buffers."""

    grad_accum_dtype: DType | None = Field(None, description="Gradient accumulation dtype; null = the training dtype.")

    _dt = before(canonical_dtype, "grad_accum_dtype")


class FlopsProfilerConfig(Model):
    """`flops_profiler`: count flops of one step."""

    enabled: Bool = Field(False, description="Profile one step.")
    recompute_fwd_factor: Annotated[Float, Field(ge=0.0)] = Field(0.0, description="Extra forward passes from recomputation.")
    profile_step: PosInt = Field(1, description="Which step to profile.")
    module_depth: Annotated[Int, Field(ge=-1)] = Field(-1, description="Module depth to report; -1 = all.")
    top_modules: PosInt = Field(1, description="How many top modules to report.")
    detailed: Bool = Field(True, description="Per-module breakdown.")
    output_file: Str | None = Field(None, description="Write the report here; null = stdout.")


class TensorboardConfig(Model):
    """`tensorboard`: write training scalars for TensorBoard."""

    enabled: Bool = Field(False, description="Write TensorBoard event files.")
    output_path: Str = Field("", description="Directory for event files; empty = ./runs.")
    job_name: Str = Field("DeepSpeedJobName", description="Sub-directory name for this run.")


class CsvMonitorConfig(Model):
    """`csv_monitor`: write training scalars as CSV."""

    enabled: Bool = Field(False, description="Write CSV files.")
    output_path: Str = Field("", description="Directory for CSV files.")
    job_name: Str = Field("DeepSpeedJobName", description="Sub-directory name for this run.")


class ParallelWriteConfig(Model):
    """`checkpoint.parallel_write`."""

    pipeline_stage: Bool = Field(False, description="Pipeline-stage parallel writes (no pipeline in fnzero: no effect).")


class CheckpointConfig(Model):
    """`checkpoint`: checkpoint tag validation and storage."""

    tag_validation: Literal["Ignore", "Warn", "Fail"] = Field(
        "Warn", description="What to do when ranks save under different tags (case-insensitive); no effect in fnzero."
    )
    load_universal: Bool = Field(
        False, description="`fnzero.checkpoint.load(config=)` reads the tag `latest_universal` names before `latest`'s.")
    use_node_local_storage: Bool = Field(
        False, description="Each node commits a whole checkpoint on its own disk (`save(config=)`, `node_local=`).")
    parallel_write: ParallelWriteConfig = Field(default_factory=ParallelWriteConfig, description="Parallel write options.")

    @field_validator("tag_validation", mode="before")
    @classmethod
    def _tag(cls, value: object) -> object:
        if isinstance(value, str):
            return {"ignore": "Ignore", "warn": "Warn", "fail": "Fail"}.get(value.lower(), value)
        return value


class CompileConfig(Model):
    """`compile`: DeepSpeed 0.19.8's DeepCompile (compile/config.py `CompileConfig`). fnzero does not implement
    DeepCompile (`fnzero.jit` compiles the step instead): `deepcompile: true` is refused by name, and the
    other keys, which configure DeepCompile or DeepSpeed's `engine.compile()`, are accepted without effect."""

    deepcompile: Literal[False] = Field(False, description="DeepCompile; must be false (not implemented).")
    autoep_non_moe: Bool = Field(False, description="engine.compile() of AutoEP layers' parents; no effect.")
    free_activation: Bool = Field(False, description="DeepCompile: free activations eagerly; no effect.")
    free_activation_threshold: Int = Field(10 * 1024 * 1024, description="DeepCompile: bytes; no effect.")
    offload_activation: Bool = Field(False, description="DeepCompile: offload activations; no effect.")
    offload_activation_pin_memory: Bool = Field(True, description="DeepCompile: pinned buffers; no effect.")
    offload_opt_states: Bool = Field(False, description="DeepCompile: offload optimizer states; no effect.")
    double_buffer: Bool = Field(True, description="DeepCompile: double buffering; no effect.")
    symmetric_memory: Bool = Field(False, description="DeepCompile: symmetric memory; no effect.")
    debug_log: Bool = Field(False, description="DeepCompile: dump graphs; no effect.")
    offload_parameters: Bool = Field(False, description="DeepCompile: offload parameters; no effect.")
    sync_before_reduce: Bool = Field(False, description="DeepCompile: synchronise; no effect.")
    sync_after_reduce: Bool = Field(False, description="DeepCompile: synchronise; no effect.")
    sync_before_allgather: Bool = Field(False, description="DeepCompile: synchronise; no effect.")
    sync_after_allgather: Bool = Field(False, description="DeepCompile: synchronise; no effect.")
    keep_int_input_tensors: Bool = Field(True, description="DeepCompile: input storage; no effect.")
    keep_all_input_tensors: Bool = Field(False, description="DeepCompile: input storage; no effect.")
    passes: tuple[Literal["z1", "z3", "autosp", "autotp"], ...] | None = Field(
        None, description="DeepCompile passes; no effect.")

    _passes = before(lambda v: tuple(v) if isinstance(v, list) else v, "passes")


class ThroughputTimerConfig(Model):
    """`timers.throughput` (utils/config.py `DeepSpeedThroughputTimerConfig`)."""

    enabled: Bool = Field(True, description="DeepSpeed's throughput timer; fnzero's progress line always reports "
                          "samples/s (no effect).")
    synchronized: Bool = Field(True, description="Synchronise the device before timing; no effect in fnzero.")


class TimersConfig(Model):
    """`timers` (DeepSpeed reads only its `throughput` block)."""

    throughput: ThroughputTimerConfig = Field(default_factory=ThroughputTimerConfig, description="Throughput timer.")
