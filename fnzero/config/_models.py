"""`Config`: the top-level, fully resolved fnzero/DeepSpeed configuration.

Only `load_config` makes one, so every field holds a concrete value and `to_json()` prints the
whole effective configuration (specs/config.md §Round trip).
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import Field

from ._autotuning import AutotuningConfig
from ._expert import ExpertParallelConfig
from ._optim_models import OptimizerConfig
from ._parallel import PipelineConfig, TensorParallelConfig
from ._sched_models import SchedulerConfig
from ._sections import (
    ActivationCheckpointingConfig, AioConfig, BF16Config, CheckpointConfig, CommsLoggerConfig, CompileConfig,
    CsvMonitorConfig, DataTypesConfig, DType, FlopsProfilerConfig, FP16Config, TensorboardConfig, TimersConfig,
    TorchAutocastConfig, WatchdogConfig, canonical_dtype,
)
from ._types import Bool, Float, Model, PosInt, before
from ._zero import ZeroConfig

__all__ = ["Config"]


class Config(Model):
    """A validated, resolved DeepSpeed config. Build it with `load_config`; it is immutable."""

    train_batch_size: PosInt = Field(description="Samples per optimizer step across all ranks (= micro x gas x world).")
    train_micro_batch_size_per_gpu: PosInt = Field(description="Samples per forward/backward on one rank.")
    gradient_accumulation_steps: PosInt = Field(description="Micro-batches accumulated per optimizer step.")
    gradient_clipping: Annotated[Float, Field(ge=0.0)] = Field(
        1.0, description="Global gradient-norm clip; 0 = off. DeepSpeed's default is 1.0 (clipping on)."
    )
    steps_per_print: PosInt | None = Field(
        None, description="Log progress every this many optimizer steps; null = no periodic progress line."
    )
    wall_clock_breakdown: Bool = Field(False, description="Time forward/backward/step separately.")
    memory_breakdown: Bool = Field(False, description="Log accelerator memory use.")
    prescale_gradients: Bool = Field(False, description="Divide gradients before reducing instead of after.")
    gradient_predivide_factor: Annotated[Float, Field(gt=0.0)] = Field(
        1.0, description="With prescale_gradients, divide by this before reducing and by world/this after."
    )
    dump_state: Bool = Field(False, description="DeepSpeed prints its engine state; no effect in fnzero (warns when true).")
    zero_allow_untested_optimizer: Bool = Field(False, description="Accepted for compatibility; fnzero's optimizers are all supported.")
    zero_force_ds_cpu_optimizer: Bool = Field(True, description="Accepted for compatibility; no effect (fnzero has one CPU path).")
    sequence_parallel_size: PosInt = Field(
        1, description="Sequence-parallel (Ulysses) ranks, each holding a slice of every sequence (alias: sp_size); "
        "the batch triad counts world / (sequence_parallel_size x tensor-parallel x pipeline stages) ranks."
    )
    communication_data_type: DType | None = Field(
        None, description="Dtype of gradient collectives; null = training dtype. Not read when "
        "sequence_parallel_size > 1 (seq_parallel_communication_data_type is)."
    )
    seq_parallel_communication_data_type: DType | None = Field(
        "fp32", description="With sequence_parallel_size > 1, the dtype gradients are reduced in, in place of "
        "communication_data_type (as DeepSpeed's engine does; null = training dtype); not the dtype of the "
        "attention's all-to-alls."
    )
    optimizer: OptimizerConfig | None = Field(None, description="Optimizer; null = the caller supplies one.")
    scheduler: SchedulerConfig | None = Field(None, description="Learning-rate schedule; null = constant lr.")
    fp16: FP16Config = Field(default_factory=FP16Config, description="fp16 mixed precision.")
    bf16: BF16Config = Field(default_factory=BF16Config, description="bf16 mixed precision (legacy key: bfloat16).")
    torch_autocast: TorchAutocastConfig = Field(default_factory=TorchAutocastConfig, description="torch.autocast.")
    zero_optimization: ZeroConfig = Field(default_factory=ZeroConfig, description="ZeRO stage and bucketing.")
    aio: AioConfig = Field(default_factory=AioConfig, description="Async NVMe I/O.")
    activation_checkpointing: ActivationCheckpointingConfig = Field(
        default_factory=ActivationCheckpointingConfig, description="Activation checkpointing."
    )
    data_types: DataTypesConfig = Field(default_factory=DataTypesConfig, description="Internal buffer dtypes.")
    comms_logger: CommsLoggerConfig = Field(default_factory=CommsLoggerConfig, description="Collective logging.")
    watchdog: WatchdogConfig = Field(default_factory=WatchdogConfig, description="fnzero's collective watchdog.")
    flops_profiler: FlopsProfilerConfig = Field(default_factory=FlopsProfilerConfig, description="Flops profiler.")
    tensorboard: TensorboardConfig = Field(default_factory=TensorboardConfig, description="TensorBoard monitor.")
    csv_monitor: CsvMonitorConfig = Field(default_factory=CsvMonitorConfig, description="CSV monitor.")
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig, description="Checkpoint options.")
    compile: CompileConfig = Field(default_factory=CompileConfig, description="DeepCompile (off; not implemented).")
    timers: TimersConfig = Field(default_factory=TimersConfig, description="DeepSpeed's throughput timer.")
    tensor_parallel: TensorParallelConfig = Field(default_factory=TensorParallelConfig,
                                                  description="AutoTP: tensor parallelism (Megatron-style).")
    pipeline: PipelineConfig = Field(default_factory=PipelineConfig,
                                     description="Pipeline parallelism of a fnzero.pipeline.PipelineModule.")
    expert_parallel: ExpertParallelConfig = Field(default_factory=ExpertParallelConfig,
                                                  description="AutoEP: MoE experts split over expert-parallel ranks.")
    autotuning: AutotuningConfig = Field(default_factory=AutotuningConfig,
                                         description="The autotuner's block (read by `fnzero autotune`).")
    # Not a DeepSpeed key: the data-parallel world size the batch triad was resolved against.
    # Excluded from to_json() so the printed config stays a valid DeepSpeed file.
    world_size: PosInt = Field(1, exclude=True, description="Data-parallel world size used to resolve the batch triad.")
    # Not a DeepSpeed key: every rank of the job (pipeline x data-parallel x tensor-parallel), as given to load_config.
    world_ranks: PosInt = Field(1, exclude=True, description="The job's ranks the config was loaded for.")

    _dt = before(canonical_dtype, "communication_data_type", "seq_parallel_communication_data_type")
    # DeepSpeed 0.19.8's parse_autoep_config: `if not param_dict: return AutoEPConfig()` (null, false: the defaults).
    _ep = before(lambda v: {} if v is None or v is False else v, "expert_parallel")

    @property
    def precision(self) -> Literal["fp32", "fp16", "bf16"]:
        """Training precision: fp16 or bf16 when that block is enabled, else fp32."""
        if self.fp16.enabled:
            return "fp16"
        if self.bf16.enabled:
            return "bf16"
        return "fp32"

    @property
    def zero_stage(self) -> int:
        """`zero_optimization.stage`."""
        return self.zero_optimization.stage

    def to_dict(self) -> dict[str, Any]:
        """The resolved config as plain JSON types, DeepSpeed key names, every default filled, except
        MiCS's keys when off: DeepSpeed 0.19.8 refuses them in any form (it removed MiCS)."""
        out = self.model_dump(mode="json")
        zero = out["zero_optimization"]
        if zero["mics_shard_size"] <= 0:
            del zero["mics_shard_size"]
        if not zero["mics_hierarchical_params_gather"]:
            del zero["mics_hierarchical_params_gather"]
        return out

    def to_json(self, indent: int | None = 2) -> str:
        """The resolved config as JSON; `load_config(cfg.to_json(), world_size=cfg.world_ranks) == cfg`."""
        return json.dumps(self.to_dict(), indent=indent)
