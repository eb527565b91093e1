"""DeepSpeed-compatible configuration for fnzero: `load_config` and `hf_auto_values` (specs/config.md).

This layer never asks torch.distributed: without `world_size` the batch triad is resolved for a
world of 1; `fnzero.load_config` and `fnzero.hf_auto_values` pass the running world's size.
"""

from __future__ import annotations

from ._auto import AutoValues, hf_auto_values
from ._autotuning import AutotuningConfig, ModelInfoConfig
from ._expert import ExpertParallelConfig
from ._load import load_config, read_config
from ._models import Config
from ._noop import ConfigWarning
from ._optim_models import (
    OPTIMIZER_TYPES, AdagradParams, AdamParams, AdamWParams, LambParams, LionParams, MuonParams,
    OneBitAdamParams, OneBitLambParams, OptimizerConfig, OptimizerParams, SGDParams, ZeroOneAdamParams,
)
from ._sched_models import (
    SCHEDULER_TYPES, LRRangeTestParams, OneCycleParams, SchedulerConfig, SchedulerParams, WarmupCosineLRParams,
    WarmupDecayLRParams, WarmupLRParams,
)
from ._sections import (
    ActivationCheckpointingConfig, AioConfig, BF16Config, CheckpointConfig, CommsLoggerConfig, CompileConfig,
    CsvMonitorConfig, DataTypesConfig, FlopsProfilerConfig, FP16Config, ParallelWriteConfig, TensorboardConfig,
    ThroughputTimerConfig, TimersConfig, TorchAutocastConfig, WatchdogConfig,
)
from ._zero import LeafModuleConfig, OffloadOptimizerConfig, OffloadParamConfig, ZeroConfig


# What fnzero's other packages use of this package: they import it from here, its face, and
# never from its private modules (`specs/architecture.md` §Package faces).
from ._noop import no_effect_table, warn_no_effect
from ._parse import read_source
from ._problems import Problems, join_path, listed, split_by_hint
from ._translate import validate_into
from ._types import Bool, Int, Model, Str, describe

__all__ = [
    "load_config", "read_config", "Config", "ConfigWarning", "hf_auto_values", "AutoValues",
    "FP16Config", "BF16Config", "TorchAutocastConfig", "ZeroConfig", "OffloadOptimizerConfig", "OffloadParamConfig",
    "OptimizerConfig", "SchedulerConfig", "AioConfig", "ActivationCheckpointingConfig", "CommsLoggerConfig",
    "DataTypesConfig", "FlopsProfilerConfig", "TensorboardConfig", "CsvMonitorConfig", "CheckpointConfig",
    "ParallelWriteConfig", "WatchdogConfig", "CompileConfig", "TimersConfig", "ThroughputTimerConfig", "LeafModuleConfig",
    "OptimizerParams", "AdamParams", "AdamWParams", "SGDParams", "AdagradParams", "LambParams", "LionParams",
    "MuonParams", "OneBitAdamParams", "ZeroOneAdamParams", "OneBitLambParams", "OPTIMIZER_TYPES", "ExpertParallelConfig",
    "AutotuningConfig", "ModelInfoConfig",
    "SchedulerParams", "WarmupLRParams", "WarmupDecayLRParams", "WarmupCosineLRParams", "OneCycleParams",
    "LRRangeTestParams", "SCHEDULER_TYPES",
]
