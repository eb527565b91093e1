"""Every default equals DeepSpeed 0.19.8's (specs/config.md §Keys), and the issue #16 part 4 behaviours:
warnings for accepted keys without effect, one short "auto" message, hf_auto_values, base64 syntax errors.

The tables below are written out by hand from the DeepSpeed 0.19.8 sources named in each comment
(paths under deepspeed/); they are deliberately not derived from fnzero's models, so changing a
default in fnzero fails here until the table (and specs/config.md) says why.
"""

from __future__ import annotations

import base64
import json
import sys
import warnings

import pytest

from fnzero._errors import ConfigError
from fnzero.config import (
    OPTIMIZER_TYPES, SCHEDULER_TYPES, AutoValues, ConfigWarning, OffloadOptimizerConfig, OffloadParamConfig,
    hf_auto_values, load_config,
)

MINIMAL = {"train_batch_size": 8}

DEEPSPEED_0_19_8 = {
    # runtime/constants.py TRAIN_BATCH_SIZE_DEFAULT / TRAIN_MICRO_BATCH_SIZE_PER_GPU_DEFAULT /
    # GRADIENT_ACCUMULATION_STEPS_DEFAULT are None: derived from the one given (8 = 8 x 1 x world 1).
    "train_batch_size": 8,
    "train_micro_batch_size_per_gpu": 8,
    "gradient_accumulation_steps": 1,
    "gradient_clipping": 1.0,  # runtime/constants.py GRADIENT_CLIPPING_DEFAULT
    "steps_per_print": None,  # runtime/constants.py STEPS_PER_PRINT_DEFAULT
    "wall_clock_breakdown": False,  # runtime/constants.py WALL_CLOCK_BREAKDOWN_DEFAULT
    "memory_breakdown": False,  # runtime/constants.py MEMORY_BREAKDOWN_DEFAULT
    "prescale_gradients": False,  # runtime/constants.py PRESCALE_GRADIENTS_DEFAULT
    "gradient_predivide_factor": 1.0,  # runtime/constants.py GRADIENT_PREDIVIDE_FACTOR_DEFAULT
    "dump_state": False,  # runtime/constants.py DUMP_STATE_DEFAULT
    "zero_allow_untested_optimizer": False,  # runtime/constants.py ZERO_ALLOW_UNTESTED_OPTIMIZER_DEFAULT
    "zero_force_ds_cpu_optimizer": True,  # runtime/constants.py ZERO_FORCE_DS_CPU_OPTIMIZER_DEFAULT
    # runtime/config.py DeepSpeedConfig.__init__: absent, the triad's world is not divided (as by 1)
    "sequence_parallel_size": 1,
    "communication_data_type": None,  # runtime/constants.py COMMUNICATION_DATA_TYPE_DEFAULT
    "seq_parallel_communication_data_type": "fp32",  # runtime/constants.py SEQ_PARALLEL_COMMUNICATION_DATA_TYPE_DEFAULT
    "optimizer": None,  # runtime/constants.py OPTIMIZER_TYPE_DEFAULT
    "scheduler": None,  # runtime/constants.py SCHEDULER_TYPE_DEFAULT
    # runtime/precision_config.py DeepSpeedFP16Config fields
    "fp16.enabled": False,
    "fp16.auto_cast": False,
    "fp16.loss_scale": 0.0,
    "fp16.initial_scale_power": 16,
    "fp16.loss_scale_window": 1000,
    "fp16.hysteresis": 2,
    "fp16.consecutive_hysteresis": False,
    "fp16.min_loss_scale": 1,  # typed int there: a fractional value is refused
    # runtime/precision_config.py DeepSpeedBF16Config fields (constants.py's unused
    # BFLOAT16_IMMEDIATE_GRAD_UPDATE_DEFAULT = True is not what the model applies)
    "bf16.enabled": False,
    "bf16.immediate_grad_update": False,
    "bf16.check_grad_overflow": True,
    "torch_autocast.enabled": False,  # runtime/constants.py TORCH_AUTOCAST_ENABLED_DEFAULT
    "torch_autocast.dtype": None,  # runtime/config.py get_torch_autocast_dtype: None when absent
    "torch_autocast.lower_precision_safe_modules": None,  # runtime/config.py get_lower_precision_safe_modules
    # runtime/zero/config.py DeepSpeedZeroConfig fields
    "zero_optimization.stage": 0,
    "zero_optimization.contiguous_gradients": True,
    "zero_optimization.reduce_scatter": True,
    "zero_optimization.reduce_bucket_size": 500_000_000,
    "zero_optimization.allgather_partitions": True,
    "zero_optimization.allgather_bucket_size": 500_000_000,
    "zero_optimization.overlap_comm": False,  # None, resolved by overlap_comm_valid to stage == 3 (stage 0 here)
    "zero_optimization.load_from_fp32_weights": True,
    "zero_optimization.elastic_checkpoint": False,
    "zero_optimization.offload_optimizer": None,
    "zero_optimization.offload_param": None,
    "zero_optimization.sub_group_size": 1_000_000_000,
    "zero_optimization.stage3_max_live_parameters": 1_000_000_000,  # max_live_parameters
    "zero_optimization.stage3_max_reuse_distance": 1_000_000_000,  # max_reuse_distance
    "zero_optimization.stage3_prefetch_bucket_size": 50_000_000,  # prefetch_bucket_size
    "zero_optimization.stage3_param_persistence_threshold": 100_000,  # param_persistence_threshold
    "zero_optimization.stage3_model_persistence_threshold": sys.maxsize,  # model_persistence_threshold
    "zero_optimization.stage3_gather_16bit_weights_on_model_save": False,  # gather_16bit_weights_on_model_save
    "zero_optimization.ignore_unused_parameters": True,
    "zero_optimization.legacy_stage1": False,
    "zero_optimization.round_robin_gradients": False,
    "zero_optimization.zero_hpz_partition_size": 1,
    "zero_optimization.zero_quantized_weights": False,
    "zero_optimization.zero_quantized_nontrainable_weights": False,
    "zero_optimization.zero_quantized_gradients": False,
    "zero_optimization.memory_efficient_linear": True,
    "zero_optimization.use_multi_rank_bucket_allreduce": True,
    "zero_optimization.compute_grad_norm": True,
    "zero_optimization.parameter_alignment": False,
    "zero_optimization.pipeline_loading_checkpoint": False,
    "zero_optimization.override_module_apply": True,
    "zero_optimization.log_trace_cache_warnings": False,
    "zero_optimization.enable_sanity_checks": False,
    "zero_optimization.save_muon_momentum_buffer_in_memory": False,
    "zero_optimization.stage3_module_granularity_threshold": 0,  # module_granularity_threshold
    "zero_optimization.stage3_use_all_reduce_for_fetch_params": False,  # use_all_reduce_for_fetch_params
    "zero_optimization.stage3_allgather_sequential": False,  # allgather_sequential
    # runtime/zero/leaf_module_config.py DeepSpeedZeroLeafModuleConfig (DEFAULT_LEAF_MODULE_CLASSES ...)
    "zero_optimization.leaf_module.classes": [
        "transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock",
        "transformers.models.qwen2_moe.modeling_qwen2_moe.Qwen2MoeSparseMoeBlock",
        "transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock",
    ],
    "zero_optimization.leaf_module.names": [],
    "zero_optimization.leaf_module.name_suffixes": [],
    # runtime/swap_tensor/constants.py AIO_*_DEFAULT (thread_count is AIO_INTRA_OP_PARALLELISM_DEFAULT)
    "aio.block_size": 1_048_576,
    "aio.queue_depth": 8,
    "aio.thread_count": 1,
    "aio.single_submit": False,
    "aio.overlap_events": True,
    "aio.use_gds": False,
    # runtime/activation_checkpointing/config.py ACT_CHKPT_*_DEFAULT
    "activation_checkpointing.partition_activations": False,
    "activation_checkpointing.contiguous_memory_optimization": False,
    "activation_checkpointing.cpu_checkpointing": False,
    "activation_checkpointing.number_checkpoints": None,
    "activation_checkpointing.synchronize_checkpoint_boundary": False,
    "activation_checkpointing.profile": False,
    "data_types.grad_accum_dtype": None,  # runtime/constants.py GRAD_ACCUM_DTYPE_DEFAULT
    # autotuning/constants.py AUTOTUNING_*_DEFAULT and MODEL_INFO_*_DEFAULT (autotuning/config.py reads them)
    "autotuning.enabled": False, "autotuning.fast": True, "autotuning.results_dir": "autotuning_results",
    "autotuning.exps_dir": "autotuning_exps", "autotuning.overwrite": True, "autotuning.start_profile_step": 3,
    "autotuning.end_profile_step": 5, "autotuning.metric": "throughput", "autotuning.metric_path": None,
    "autotuning.tuner_type": "gridsearch", "autotuning.tuner_early_stopping": 5, "autotuning.tuner_num_trials": 50,
    "autotuning.arg_mappings": None, "autotuning.model_info.profile": False, "autotuning.model_info.num_params": None,
    "autotuning.model_info.hidden_size": None, "autotuning.model_info.num_layers": None,
    "autotuning.model_info_path": None, "autotuning.mp_size": 1, "autotuning.max_train_batch_size": None,
    "autotuning.min_train_batch_size": 1, "autotuning.max_train_micro_batch_size_per_gpu": 1024,
    "autotuning.min_train_micro_batch_size_per_gpu": 1, "autotuning.num_tuning_micro_batch_sizes": 3,
    # comm/constants.py COMMS_LOGGER_*_DEFAULT
    "comms_logger.enabled": False,
    "comms_logger.verbose": False,
    "comms_logger.prof_all": True,
    "comms_logger.debug": False,
    "comms_logger.prof_ops": [],
    # profiling/constants.py FLOPS_PROFILER_*_DEFAULT
    "flops_profiler.enabled": False,
    "flops_profiler.recompute_fwd_factor": 0.0,
    "flops_profiler.profile_step": 1,
    "flops_profiler.module_depth": -1,
    "flops_profiler.top_modules": 1,
    "flops_profiler.detailed": True,
    "flops_profiler.output_file": None,
    # monitor/config.py TensorBoardConfig / CSVConfig fields
    "tensorboard.enabled": False,
    "tensorboard.output_path": "",
    "tensorboard.job_name": "DeepSpeedJobName",
    "csv_monitor.enabled": False,
    "csv_monitor.output_path": "",
    "csv_monitor.job_name": "DeepSpeedJobName",
    # runtime/constants.py CHECKPOINT_TAG_VALIDATION_DEFAULT is ValidationMode.WARN ("WARN"; DeepSpeed
    # upper-cases what it reads, fnzero stores "Warn"), LOAD_UNIVERSAL_CHECKPOINT_DEFAULT,
    # USE_NODE_LOCAL_STORAGE_CHECKPOINT_DEFAULT, CHECKPOINT_PARALLEL_WRITE_PIPELINE_STAGE_DEFAULT
    "checkpoint.tag_validation": "Warn",
    "checkpoint.load_universal": False,
    "checkpoint.use_node_local_storage": False,
    "checkpoint.parallel_write.pipeline_stage": False,
    # runtime/tensor_parallel/config.py TPTrainingConfig (and its TPConfig under `tp`); `dtype` is
    # torch.float16 there, written as DeepSpeed's JSON spelling here
    "tensor_parallel.autotp_size": 0,
    "tensor_parallel.tp_overlap_comm": False,
    "tensor_parallel.vocab_parallel_lm_head": None,
    "tensor_parallel.vocab_parallel_ce_backend": "torch",
    "tensor_parallel.tensor_parallel.tp_size": 1,
    "tensor_parallel.tensor_parallel.tp_grain_size": 1,
    "tensor_parallel.tensor_parallel.mpu": None,
    "tensor_parallel.tensor_parallel.tp_group": None,
    "tensor_parallel.injection_policy_tuple": None,
    "tensor_parallel.partition_config": None,
    "tensor_parallel.preset_model": None,
    "tensor_parallel.keep_module_on_host": False,
    "tensor_parallel.replace_with_kernel_inject": False,
    "tensor_parallel.dtype": "fp16",
    # runtime/config.py get_pipeline_config (use_reentrant is set to True by PipelineEngine when
    # absent; fnzero keeps null for "unset")
    "pipeline.stages": "auto",
    "pipeline.partition": "best",
    "pipeline.seed_layers": False,
    "pipeline.activation_checkpoint_interval": 0,
    "pipeline.pipe_partitioned": True,
    "pipeline.grad_partitioned": True,
    "pipeline.use_reentrant": None,
    # module_inject/auto_ep_config.py parse_autoep_config (the dict.get defaults; runtime/config.py
    # get_expert_parallel_config builds AutoEPConfig(), the same values, when the block is absent).
    # expert_w3: absent, as DeepSpeed's _UNSET (the preset's name): to_json leaves it out.
    "expert_parallel.enabled": False,
    "expert_parallel.autoep_size": 1,
    "expert_parallel.expert_tensor_parallel_size": 1,
    "expert_parallel.validate_folding_routing": False,
    "expert_parallel.async_split_plan": False,
    "expert_parallel.preset_model": None,
    "expert_parallel.moe_layer_pattern": None,
    "expert_parallel.expert_pattern": None,
    "expert_parallel.router_pattern": None,
    "expert_parallel.use_grouped_mm": True,
    "expert_parallel.disable_triton_grouped_mm": False,
    "expert_parallel.route_norm": None,
    "expert_parallel.route_scale": 1.0,
    "expert_parallel.score_apply": "auto",
    "expert_parallel.combine_impl": "auto",
    "expert_parallel.row_weighting_impl": "auto",
    "expert_parallel.gate_up_impl": "separate",
    "expert_parallel.comm_backend": "comm",
    "expert_parallel.comm_num_sm": 12,
    "expert_parallel.comm_qp_margin": 4,
    "expert_parallel.comm_max_tokens_per_rank": 0,
    "expert_parallel.num_expert_groups": None,
    "expert_parallel.num_limited_groups": None,
    "expert_parallel.score_func": "auto",
    "expert_parallel.top_k": "auto",
    "expert_parallel.load_balance_coeff": None,
    "expert_parallel.routed_scaling_factor": "auto",
    "expert_parallel.expert_w1": None,
    "expert_parallel.expert_w2": None,
    "expert_parallel.num_experts_attr": None,
    "expert_parallel.top_k_attr": None,
    "expert_parallel.has_shared_experts": None,
    "expert_parallel.shared_experts_pattern": None,
    "expert_parallel.shared_experts_gate_pattern": None,
    "expert_parallel.expert_activation": None,
    # compile/config.py CompileConfig fields
    "compile.deepcompile": False,
    "compile.autoep_non_moe": False,
    "compile.free_activation": False,
    "compile.free_activation_threshold": 10 * 1024 * 1024,
    "compile.offload_activation": False,
    "compile.offload_activation_pin_memory": True,
    "compile.offload_opt_states": False,
    "compile.double_buffer": True,
    "compile.symmetric_memory": False,
    "compile.debug_log": False,
    "compile.offload_parameters": False,
    "compile.sync_before_reduce": False,
    "compile.sync_after_reduce": False,
    "compile.sync_before_allgather": False,
    "compile.sync_after_allgather": False,
    "compile.keep_int_input_tensors": True,
    "compile.keep_all_input_tensors": False,
    "compile.passes": None,
    # utils/config.py DeepSpeedThroughputTimerConfig (read from timers.throughput)
    "timers.throughput.enabled": True,
    "timers.throughput.synchronized": True,
}

# Resolved defaults fnzero does not follow: none (overlap_comm resolves as runtime/zero/config.py
# overlap_comm_valid does, to `stage == 3`). Keys of fnzero's own, which DeepSpeed has not (and
# ignores): the collective watchdog (specs/collectives.md §Watchdog).
DIVERGENCES: dict = {"watchdog.timeout_seconds": 300.0}

OFFLOAD_OPTIMIZER = {  # runtime/zero/offload_config.py DeepSpeedZeroOffloadOptimizerConfig fields
    "device": "none", "nvme_path": None, "buffer_count": 4, "pin_memory": True, "pipeline_read": False,
    "pipeline_write": False, "fast_init": False, "ratio": 1.0, "super_offload": False, "cpuadam_cores_perc": 0.8,
}
OFFLOAD_PARAM = {  # runtime/zero/offload_config.py DeepSpeedZeroOffloadParamConfig fields
    "device": "none", "nvme_path": None, "buffer_count": 5, "buffer_size": 100_000_000, "max_in_cpu": 1_000_000_000,
    "pin_memory": True,
}

_ADAM = {  # ops/adam/fused_adam.py FusedAdam, ops/adam/cpu_adam.py DeepSpeedCPUAdam __init__ defaults
    "lr": 1e-3, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0, "bias_correction": True, "amsgrad": False,
    "torch_adam": False,  # runtime/engine.py: optimizer_parameters.pop(TORCH_ADAM_PARAM, False)
    "fp32_optimizer_states": True,  # ops/adam/cpu_adam.py DeepSpeedCPUAdam
    "adam_w_mode": True,  # runtime/config.py ADAM_W_MODE_DEFAULT
}
_ONEBIT = {"lr": 1e-3, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0, "bias_correction": True,
           "eps_inside_sqrt": False, "max_grad_norm": 0.0, "amsgrad": False, "cuda_aware": False,
           "comm_backend_name": "nccl"}
OPTIMIZER_DEFAULTS = {
    "Adam": _ADAM,
    "AdamW": _ADAM,
    # runtime/engine.py falls through to torch.optim.SGD (torch 2.x defaults)
    "SGD": {"lr": 1e-3, "momentum": 0.0, "dampening": 0.0, "weight_decay": 0.0, "nesterov": False},
    # torch.optim.Adagrad without offload, ops/adagrad/cpu_adagrad.py DeepSpeedCPUAdagrad with it
    "Adagrad": {"lr": 1e-2, "eps": 1e-10, "weight_decay": 0.0, "lr_decay": 0.0, "initial_accumulator_value": 0.0},
    "Lamb": {  # ops/lamb/fused_lamb.py FusedLamb
        "lr": 1e-3, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0, "bias_correction": True,
        "max_grad_norm": 0.0, "max_coeff": 10.0, "min_coeff": 0.01,
    },
    "Lion": {"lr": 1e-3, "betas": [0.9, 0.999], "weight_decay": 0.0},  # ops/lion/fused_lion.py FusedLion
    # runtime/zero/muon/original_muon.py MuonWithAuxAdam's group defaults; engine.py `_muon_half_defaults`
    "Muon": {
        "lr": 0.02, "muon_lr": 0.02, "adam_lr": 3e-4, "momentum": 0.95, "weight_decay": 0.0, "ns_method": "gram",
        "betas": [0.9, 0.95], "eps": 1e-10, "adam_w_mode": True, "torch_adam": False, "per_head_muon": False,
    },
    # The mirror's runtime/fp16/onebit/adam.py, zoadam.py, lamb.py constructors (0.19.8 removed them)
    "OneBitAdam": {**_ONEBIT, "freeze_step": 100000},
    "ZeroOneAdam": {**_ONEBIT, "var_freeze_step": 100000, "var_update_scaler": 16, "local_step_scaler": 32678,
                    "local_step_clipper": 16},
    "OneBitLamb": {**_ONEBIT, "freeze_step": 100000, "max_coeff": 10.0, "min_coeff": 0.01, "coeff_beta": 0.9,
                   "factor_max": 4.0, "factor_min": 0.5, "factor_threshold": 0.1},
}

# runtime/lr_schedules.py constructors; the values given are the ones DeepSpeed requires (no default).
_REQUIRED = {"WarmupDecayLR": {"total_num_steps": 5000}, "WarmupCosineLR": {"total_num_steps": 5000},
             "OneCycle": {"cycle_min_lr": 1e-4, "cycle_max_lr": 1e-3}}
SCHEDULER_DEFAULTS = {
    "WarmupLR": {  # WarmupLR.__init__; warmup_max_lr None = the optimizer's lr
        "warmup_min_lr": 0.0, "warmup_max_lr": None, "warmup_num_steps": 1000, "warmup_type": "log",
        "last_batch_iteration": -1,
    },
    "WarmupDecayLR": {  # WarmupDecayLR.__init__
        "total_num_steps": 5000, "warmup_min_lr": 0.0, "warmup_max_lr": 0.001, "warmup_num_steps": 1000,
        "warmup_type": "log", "last_batch_iteration": -1,
    },
    "WarmupCosineLR": {  # WarmupCosineLR.__init__
        "total_num_steps": 5000, "warmup_min_ratio": 0.0, "warmup_num_steps": 1000, "cos_min_ratio": 0.0001,
        "warmup_type": "log", "last_batch_iteration": -1,
    },
    "OneCycle": {  # OneCycle.__init__
        "cycle_min_lr": 1e-4, "cycle_max_lr": 1e-3, "decay_lr_rate": 0.0, "cycle_first_step_size": 2000,
        "cycle_second_step_size": None, "cycle_first_stair_count": 0, "cycle_second_stair_count": None,
        "decay_step_size": 0, "cycle_momentum": True, "cycle_min_mom": 0.8, "cycle_max_mom": 0.9,
        "decay_mom_rate": 0.0, "last_batch_iteration": -1,
    },
    "LRRangeTest": {  # LRRangeTest.__init__
        "lr_range_test_min_lr": 1e-3, "lr_range_test_step_size": 2000, "lr_range_test_step_rate": 1.0,
        "lr_range_test_staircase": False, "last_batch_iteration": -1,
    },
}


def _flatten(tree: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in tree.items():
        path = f"{prefix}.{key}" if prefix else key
        if isinstance(value, dict):
            out.update(_flatten(value, path))
        else:
            out[path] = value
    return out


# specs/config.md §Keys: the DeepSpeed 0.19.8 column
def test_every_resolved_default_is_deepspeed_0_19_8s():
    got = _flatten(load_config(MINIMAL, world_size=1).to_dict())
    want = {**DEEPSPEED_0_19_8, **DIVERGENCES}
    assert sorted(got) == sorted(want), "a key was added or removed: give it a row (and its DeepSpeed source) above"
    wrong = {k: (got[k], want[k]) for k in want if got[k] != want[k] or type(got[k]) is not type(want[k])}
    assert not wrong, f"defaults differ from DeepSpeed 0.19.8 (got, want): {wrong}"


def test_offload_block_defaults():
    assert OffloadOptimizerConfig().model_dump(mode="json") == OFFLOAD_OPTIMIZER
    assert OffloadParamConfig().model_dump(mode="json") == OFFLOAD_PARAM
    c = load_config({**MINIMAL, "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}}})
    assert c.zero_optimization.offload_optimizer.model_dump(mode="json") == {**OFFLOAD_OPTIMIZER, "device": "cpu"}


@pytest.mark.parametrize("kind", sorted(OPTIMIZER_TYPES))
def test_optimizer_param_defaults(kind):
    c = load_config({**MINIMAL, "optimizer": {"type": kind}})
    assert c.to_dict()["optimizer"] == {"type": kind, "params": OPTIMIZER_DEFAULTS[kind], "legacy_fusion": False}


@pytest.mark.parametrize("kind", sorted(SCHEDULER_TYPES))
def test_scheduler_param_defaults(kind):
    c = load_config({**MINIMAL, "scheduler": {"type": kind, "params": _REQUIRED.get(kind, {})}})
    assert c.to_dict()["scheduler"] == {"type": kind, "params": SCHEDULER_DEFAULTS[kind]}


# specs/config.md §Keys, legend W: accepted, no effect, one ConfigWarning when set
NO_EFFECT = [
    ("fp16.auto_cast", {"fp16": {"enabled": True, "auto_cast": True}}),
    ("dump_state", {"dump_state": True}),
    ("bf16.check_grad_overflow", {"bf16": {"enabled": True, "check_grad_overflow": False}}),
    ("zero_optimization.ignore_unused_parameters", {"zero_optimization": {"stage": 3, "ignore_unused_parameters": False}}),
    ("zero_optimization.offload_optimizer.ratio",
     {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "ratio": 0.3}}}),
    ("comms_logger.verbose", {"comms_logger": {"enabled": True, "verbose": True}}),
    ("comms_logger.debug", {"comms_logger": {"enabled": True, "debug": True}}),
    ("comms_logger.prof_all", {"comms_logger": {"enabled": True, "prof_all": False}}),
    ("comms_logger.prof_ops", {"comms_logger": {"enabled": True, "prof_ops": ["all_reduce"]}}),
    ("autotuning.enabled", {"autotuning": {"enabled": True}}),
    ("autotuning.fast", {"autotuning": {"fast": False}}),
    ("autotuning.mp_size", {"autotuning": {"mp_size": 2}}),
    ("autotuning.model_info_path", {"autotuning": {"model_info_path": "info.json"}}),
    ("autotuning.model_info.profile", {"autotuning": {"model_info": {"profile": True}}}),
    ("autotuning.model_info.hidden_size", {"autotuning": {"model_info": {"hidden_size": 64}}}),
    ("autotuning.model_info.num_layers", {"autotuning": {"model_info": {"num_layers": 2}}}),
    ("aio.single_submit", {"aio": {"single_submit": True}}),
    ("aio.overlap_events", {"aio": {"overlap_events": False}}),
    ("checkpoint.tag_validation", {"checkpoint": {"tag_validation": "fail"}}),
    ("optimizer.params.torch_adam", {"optimizer": {"type": "Muon", "params": {"torch_adam": True}}}),
    ("optimizer.params.cuda_aware", {"optimizer": {"type": "OneBitAdam", "params": {"cuda_aware": True}}}),
    ("optimizer.params.comm_backend_name", {"optimizer": {"type": "ZeroOneAdam", "params": {"comm_backend_name": "mpi"}}}),
    ("optimizer.params.bias_correction", {"optimizer": {"type": "OneBitLamb", "params": {"bias_correction": False}}}),
    ("optimizer.params.eps_inside_sqrt", {"optimizer": {"type": "OneBitAdam", "params": {"eps_inside_sqrt": True}}}),
    ("optimizer.params.max_grad_norm", {"optimizer": {"type": "OneBitAdam", "params": {"max_grad_norm": 1.0}}}),
]


@pytest.mark.parametrize("key,extra", NO_EFFECT, ids=[k for k, _ in NO_EFFECT])
def test_key_without_effect_warns_once(key, extra):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        load_config({**MINIMAL, **extra})
    mine = [w for w in caught if issubclass(w.category, ConfigWarning)]
    assert len(mine) == 1, [str(w.message) for w in caught]
    message = str(mine[0].message)
    assert f"`{key}`" in message and "no effect in fnzero" in message
    assert mine[0].filename == __file__  # points at the caller of load_config


def test_defaults_and_explicit_defaults_do_not_warn():
    explicit = {"fp16": {"auto_cast": False}, "dump_state": False, "aio": {"single_submit": False, "overlap_events": True},
                "comms_logger": {"verbose": False, "debug": False, "prof_all": True, "prof_ops": []},
                "checkpoint": {"tag_validation": "WARN", "load_universal": False, "use_node_local_storage": False},
                "zero_optimization": {"stage": 3, "ignore_unused_parameters": True,
                                      "offload_optimizer": {"device": "cpu", "ratio": 1.0, "pin_memory": False}}}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_config(MINIMAL)
        load_config({**MINIMAL, **explicit})


def test_a_refused_config_does_not_also_warn():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(ConfigError, match="ratio"):
            load_config({**MINIMAL, "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "ratio": 0.5}}})


# specs/config.md §"auto": a HuggingFace ZeRO-3 config, with "auto" where HF's DeepSpeed docs put it
HF_ZERO3 = """{
  "fp16": {"enabled": "auto", "loss_scale": 0, "loss_scale_window": 1000, "initial_scale_power": 16,
           "hysteresis": 2, "min_loss_scale": 1},
  "bf16": {"enabled": "auto"},
  "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
  "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                "warmup_num_steps": "auto", "total_num_steps": "auto"}},
  "zero_optimization": {
    "stage": 3,
    "offload_optimizer": {"device": "cpu", "pin_memory": true},
    "offload_param": {"device": "cpu", "pin_memory": true},
    "overlap_comm": true,
    "contiguous_gradients": true,
    "sub_group_size": 1e9,
    "reduce_bucket_size": "auto",
    "stage3_prefetch_bucket_size": "auto",
    "stage3_param_persistence_threshold": "auto",
    "stage3_max_live_parameters": 1e9,
    "stage3_max_reuse_distance": 1e9,
    "stage3_gather_16bit_weights_on_model_save": true
  },
  "gradient_accumulation_steps": "auto",
  "gradient_clipping": "auto",
  "steps_per_print": 2000,
  "train_batch_size": "auto",
  "train_micro_batch_size_per_gpu": "auto",
  "wall_clock_breakdown": false
}"""
HF_AUTO_KEYS = [
    "bf16.enabled", "fp16.enabled", "gradient_accumulation_steps", "gradient_clipping", "optimizer.params.betas",
    "optimizer.params.eps", "optimizer.params.lr", "optimizer.params.weight_decay", "scheduler.params.total_num_steps",
    "scheduler.params.warmup_max_lr", "scheduler.params.warmup_min_lr", "scheduler.params.warmup_num_steps",
    "train_batch_size", "train_micro_batch_size_per_gpu", "zero_optimization.reduce_bucket_size",
    "zero_optimization.stage3_param_persistence_threshold", "zero_optimization.stage3_prefetch_bucket_size",
]


def test_many_autos_are_one_short_message_naming_each_key_once():
    with pytest.raises(ConfigError) as info:
        load_config(HF_ZERO3, world_size=4)
    text = str(info.value)
    assert len(info.value.errors) == 1 and len(text.splitlines()) <= 25, text
    listed = [k.strip() for k in "".join(text.splitlines()[1:-1]).split(",")]
    assert sorted(listed) == sorted(HF_AUTO_KEYS), text  # every key once, nothing else
    assert "hf_auto_values(" in text and "hidden_size=" in text and "total_steps=" in text


def test_hf_auto_values_resolve_a_typical_hf_zero3_config():
    auto = hf_auto_values(lr=2e-5, betas=(0.9, 0.95), eps=1e-6, weight_decay=0.01, warmup_steps=0.1, total_steps=1000,
                          micro_batch_size=4, gradient_accumulation_steps=2, max_grad_norm=0.5, bf16=True,
                          hidden_size=1024, world_size=4)
    c = load_config(HF_ZERO3, world_size=4, auto=auto)
    assert (c.train_batch_size, c.train_micro_batch_size_per_gpu, c.gradient_accumulation_steps) == (32, 4, 2)
    assert c.gradient_clipping == 0.5 and c.precision == "bf16" and c.fp16.enabled is False
    p = c.optimizer.params
    assert (p.lr, p.betas, p.eps, p.weight_decay) == (2e-5, (0.9, 0.95), 1e-6, 0.01)
    s = c.scheduler.params
    # transformers: warmup_min_lr 0, warmup_max_lr = learning_rate, get_warmup_steps = ceil(0.1 * 1000)
    assert (s.warmup_min_lr, s.warmup_max_lr, s.warmup_num_steps, s.total_num_steps) == (0.0, 2e-5, 100, 1000)
    z = c.zero_optimization
    # transformers trainer_config_finalize: hidden^2, 0.9 * hidden^2, 10 * hidden
    assert (z.reduce_bucket_size, z.stage3_prefetch_bucket_size, z.stage3_param_persistence_threshold) == (
        1024 * 1024, 943_718, 10_240)
    assert c.steps_per_print == 2000 and z.stage3_gather_16bit_weights_on_model_save is True


def test_hf_auto_values_leave_explicit_and_absent_keys_alone():
    auto = hf_auto_values(lr=1e-4, micro_batch_size=2, hidden_size=64, total_steps=10)
    c = load_config({"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0.25,
                     "optimizer": {"type": "Adam", "params": {"lr": "auto", "eps": 1e-6}}}, world_size=1, auto=auto)
    assert c.gradient_clipping == 0.25 and c.optimizer.params.eps == 1e-6 and c.optimizer.params.lr == 1e-4
    assert c.scheduler is None and c.zero_optimization.reduce_bucket_size == 500_000_000
    # A plain dict is strict: the same explicit conflict is an error naming both values.
    with pytest.raises(ConfigError, match="supplies 0.5"):
        load_config({"train_batch_size": 2, "gradient_clipping": 0.25}, auto={"gradient_clipping": 0.5})
    merged = auto | {"gradient_clipping": 2.0}
    assert isinstance(merged, AutoValues) and merged["gradient_clipping"] == 2.0 and merged["optimizer.params.lr"] == 1e-4


def test_hf_auto_values_without_total_steps_leave_that_auto_named():
    auto = hf_auto_values(lr=1e-4, micro_batch_size=2, hidden_size=64, warmup_steps=10, world_size=1)
    with pytest.raises(ConfigError) as info:
        load_config(HF_ZERO3, world_size=1, auto=auto)
    assert info.value.errors == [
        '`scheduler.params.total_num_steps` is "auto": HuggingFace\'s Trainer fills such placeholders in; fnzero has no '
        'trainer, so pass the value, e.g. load_config(..., auto={"scheduler.params.total_num_steps": <value>}) '
        "(or auto=fnzero.config.hf_auto_values(...))"
    ]


def test_hf_auto_values_check_their_arguments():
    with pytest.raises(ConfigError) as info:
        hf_auto_values(lr=-1.0, micro_batch_size=0, warmup_steps=0.5, bf16=True, fp16=True, hidden_size=2.5)
    text = str(info.value)
    for name in ("`lr`", "`micro_batch_size`", "`hidden_size`", "`bf16` and `fp16`"):
        assert name in text, text


# specs/config.md §Sources: base64 text is parsed like a file
@pytest.mark.parametrize("encode", [base64.b64encode, base64.urlsafe_b64encode])
@pytest.mark.parametrize("text,where", [
    ('{\n  "train_batch_size": 8\n  "steps_per_print": 1\n}', "line 3, column 3"),
    ('  "train_batch_size": 8\n}', "line 1, column 21"),  # lost its opening brace: "Extra data"
    ('\ufeff{"train_batch_size": 8,, }', "line 1, column 26"),  # a byte-order mark (dropped, as for files), then a stray comma
])
def test_base64_syntax_error_names_line_and_column(encode, text, where):
    encoded = encode(text.encode("utf-8")).decode("ascii")
    with pytest.raises(ConfigError) as info:
        load_config(encoded)
    assert where in str(info.value) and "(base64)" in str(info.value), str(info.value)


def test_base64_config_still_loads_and_paths_are_not_base64():
    good = base64.b64encode(json.dumps({"train_batch_size": 4}).encode()).decode()
    assert load_config(good).train_batch_size == 4
    with pytest.raises(ConfigError, match="does not exist"):
        load_config("configs/ds_zero3.json")


def test_docstring_examples_run():
    import doctest

    from fnzero.config import _auto, _load

    for module in (_auto, _load):
        result = doctest.testmod(module)
        assert result.attempted and not result.failed, module.__name__
