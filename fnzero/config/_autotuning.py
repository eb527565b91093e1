"""`autotuning`: DeepSpeed 0.19.8's autotuner block (autotuning/config.py, autotuning/constants.py),
with its keys and defaults. Only `fnzero autotune` (and `fnzero launch --autotuning`) act on it, as
only DeepSpeed's launcher does; a training run that is one of the autotuner's trials (`metric_path`
set) has its `Monitor` measure the profile steps and write them there (`specs/autotune.md`)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from ._types import Bool, Model, PosInt, Str

__all__ = ["AutotuningConfig", "ModelInfoConfig", "autotuning_rules"]


class ModelInfoConfig(Model):
    """`autotuning.model_info`: what DeepSpeed's model-info profile run measures; `num_params`, when
    given, lets the planner prune before any job runs."""

    profile: Bool = Field(False, description="DeepSpeed: only profile the model and exit; no effect in fnzero.")
    num_params: PosInt | None = Field(None, description="Trainable parameters; null = measured by the first trial.")
    hidden_size: PosInt | None = Field(None, description="Hidden size; no effect in fnzero.")
    num_layers: PosInt | None = Field(None, description="Layers; no effect in fnzero.")


class AutotuningConfig(Model):
    """`autotuning`: what `fnzero autotune` explores and how it measures and ranks trials."""

    enabled: Bool = Field(False, description="Tune when launched with `fnzero launch --autotuning` / `fnzero autotune`.")
    fast: Bool = Field(True, description="DeepSpeed's fast mode (micro-batch sizes per stage only); fnzero always "
                       "tunes only stage x micro-batch x offload.")
    results_dir: Str = Field("autotuning_results", min_length=1, description="Results table and optimal config.")
    exps_dir: Str = Field("autotuning_exps", min_length=1, description="One directory per trial.")
    overwrite: Bool = Field(True, description="Rerun trials whose results exist (false: reuse them).")
    start_profile_step: PosInt = Field(3, description="Steps up to and including this one are warm-up.")
    end_profile_step: PosInt = Field(5, description="The trial measures steps start+1..end, then ends.")
    metric: Literal["throughput", "latency", "flops"] = Field("throughput", description="What the best trial maximises "
                                                            "(throughput, FLOP/s) or minimises (latency).")
    metric_path: Str | None = Field(None, description="Set by the autotuner in a trial's config: where its "
                                    "Monitor writes the measured metrics.")
    tuner_type: Literal["gridsearch", "random", "model_based"] = Field("gridsearch", description="Trial order.")
    tuner_early_stopping: PosInt = Field(5, description="Stop after this many trials without a better one.")
    tuner_num_trials: PosInt = Field(50, description="Run at most this many trials.")
    arg_mappings: dict[str, Str] | None = Field(None, description="Config key -> the script's argument that "
                                                "carries it (e.g. train_micro_batch_size_per_gpu -> --batch-size).")
    model_info: ModelInfoConfig = Field(default_factory=ModelInfoConfig, description="The model's size.")
    model_info_path: Str | None = Field(None, description="DeepSpeed's model-info output; no effect in fnzero.")
    mp_size: PosInt = Field(1, description="DeepSpeed's model-parallel size; fnzero reads "
                            "tensor_parallel.autotp_size (no effect).")
    max_train_batch_size: PosInt | None = Field(None, description="Largest train_batch_size tried.")
    min_train_batch_size: PosInt = Field(1, description="Smallest train_batch_size tried.")
    max_train_micro_batch_size_per_gpu: PosInt = Field(1024, description="Largest micro-batch tried.")
    min_train_micro_batch_size_per_gpu: PosInt = Field(1, description="Smallest micro-batch tried.")
    num_tuning_micro_batch_sizes: PosInt = Field(3, description="Micro-batch sizes tried, spread geometrically "
                                                 "from min to max.")


def autotuning_rules(at: AutotuningConfig) -> list[str]:
    """The block's impossible ranges, one problem each, naming the keys (checked enabled or not)."""
    out = []
    if at.end_profile_step <= at.start_profile_step:
        out.append(f"`autotuning.end_profile_step` ({at.end_profile_step}) must be greater than "
                   f"`autotuning.start_profile_step` ({at.start_profile_step}): no step would be measured")
    lo, hi = at.min_train_micro_batch_size_per_gpu, at.max_train_micro_batch_size_per_gpu
    if lo > hi:
        out.append(f"`autotuning.min_train_micro_batch_size_per_gpu` ({lo}) is greater than "
                   f"`autotuning.max_train_micro_batch_size_per_gpu` ({hi}): no micro-batch size to try")
    if at.max_train_batch_size is not None and at.min_train_batch_size > at.max_train_batch_size:
        out.append(f"`autotuning.min_train_batch_size` ({at.min_train_batch_size}) is greater than "
                   f"`autotuning.max_train_batch_size` ({at.max_train_batch_size}): no batch size to try")
    return out

