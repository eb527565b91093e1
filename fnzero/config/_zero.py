"""`zero_optimization` and its `offload_optimizer` / `offload_param` blocks.

Defaults are DeepSpeed 0.19.8's deepspeed/runtime/zero/config.py and offload_config.py (pinned by
tests/test_config_defaults.py). Keys that only tune DeepSpeed's own kernels or bucketing are
accepted so existing configs load; what fnzero does with each is documented in specs/config.md.
"""

from __future__ import annotations

import sys
from typing import Annotated, Literal

from pydantic import Field

from ._types import Bool, Float, Int, Model, NonNegInt, Str, StrList, before, lowered

__all__ = ["ZeroConfig", "OffloadOptimizerConfig", "OffloadParamConfig", "LeafModuleConfig"]

Device = Literal["none", "cpu", "nvme"]


class OffloadOptimizerConfig(Model):
    """`zero_optimization.offload_optimizer`: keep optimizer state (and its step) off the accelerator."""

    device: Device = Field("none", description="Where optimizer state lives: none, cpu or nvme.")
    nvme_path: Str | None = Field(None, description="Directory on an NVMe drive; required when device is nvme.")
    pin_memory: Bool = Field(
        True, description="Page-locked host memory (DeepSpeed's default true); no effect: fnzero's host buffers are pageable."
    )
    buffer_count: NonNegInt = Field(4, description="Number of NVMe swap buffers.")
    fast_init: Bool = Field(False, description="Fast optimizer initialisation when offloading to NVMe; no effect in fnzero.")
    ratio: Annotated[Float, Field(ge=0.0, le=1.0)] = Field(
        1.0, description="Fraction of optimizer state to offload (stage 3 only); fnzero offloads all (warns below 1.0)."
    )
    pipeline_read: Bool = Field(False, description="Overlap NVMe reads with the optimizer step (scheduling hint).")
    pipeline_write: Bool = Field(False, description="Overlap NVMe writes with the optimizer step (scheduling hint).")
    super_offload: Bool = Field(False, description="DeepSpeed's CPU offload for Superchips (stage 3); no effect in fnzero.")
    cpuadam_cores_perc: Annotated[Float, Field(ge=0.0, le=1.0)] = Field(
        0.8, description="Share of CPU cores DeepSpeed's super_offload Adam uses; no effect in fnzero.")

    _device = before(lowered, "device")


class OffloadParamConfig(Model):
    """`zero_optimization.offload_param`: keep stage-3 parameter shards off the accelerator."""

    device: Device = Field("none", description="Where parameter shards live: none, cpu or nvme.")
    nvme_path: Str | None = Field(None, description="Directory on an NVMe drive; required when device is nvme.")
    pin_memory: Bool = Field(
        True, description="Page-locked host memory for the host shards of device cpu on an accelerator (DeepSpeed's default "
                          "true); no effect otherwise."
    )
    buffer_count: NonNegInt = Field(5, description="Number of NVMe swap buffers; no effect (each shard is read and written whole).")
    buffer_size: NonNegInt = Field(100_000_000, description="Elements per NVMe swap buffer; no effect in fnzero.")
    max_in_cpu: NonNegInt = Field(1_000_000_000, description="Parameter elements kept in host memory with NVMe; no effect in fnzero.")

    _device = before(lowered, "device")


# DeepSpeed 0.19.8's DEFAULT_LEAF_MODULE_CLASSES (runtime/zero/leaf_module_config.py).
LEAF_MODULE_CLASSES = (
    "transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock",
    "transformers.models.qwen2_moe.modeling_qwen2_moe.Qwen2MoeSparseMoeBlock",
    "transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock",
)


def _one_or_list(value: object) -> object:
    # DeepSpeed's leaf-module lists take a single string as a list of one.
    return [value] if isinstance(value, str) else value


class LeafModuleConfig(Model):
    """`zero_optimization.leaf_module`: modules DeepSpeed's stage 3 gathers whole, without hooks inside."""

    classes: StrList = Field(LEAF_MODULE_CLASSES, description="Qualified class names of leaf modules.")
    names: StrList = Field((), description="Module names (as in named_modules) of leaf modules.")
    name_suffixes: StrList = Field((), description="Suffixes of module names of leaf modules.")

    _lists = before(_one_or_list, "classes", "names", "name_suffixes")


class ZeroConfig(Model):
    """`zero_optimization`: which ZeRO stage to run and how to bucket its collectives."""

    stage: Annotated[Int, Field(ge=0, le=3)] = Field(
        0, description="0 off, 1 shard optimizer state, 2 also gradients, 3 also parameters."
    )
    contiguous_gradients: Bool = Field(True, description="Copy gradients into one contiguous buffer as produced.")
    reduce_scatter: Bool = Field(True, description="Average gradients with reduce-scatter instead of all-reduce.")
    reduce_bucket_size: Annotated[Int, Field(gt=0)] = Field(
        500_000_000, description="Elements reduced per gradient bucket (> 0, as DeepSpeed 0.19.8: 0 is refused there).")
    allgather_partitions: Bool = Field(True, description="Gather updated shards with all-gather, not broadcasts.")
    allgather_bucket_size: NonNegInt = Field(500_000_000, description="Elements all-gathered per bucket.")
    overlap_comm: Bool | None = Field(
        None, description="Overlap gradient reduction with backward; null resolves to `stage == 3`, as DeepSpeed."
    )
    load_from_fp32_weights: Bool = Field(True, description="Rebuild fp32 master weights from the fp32 copy on load.")
    elastic_checkpoint: Bool = Field(False, description="Legacy elastic checkpoints (accepted, no effect).")
    offload_optimizer: OffloadOptimizerConfig | None = Field(None, description="Optimizer-state offload; null = none.")
    offload_param: OffloadParamConfig | None = Field(None, description="Parameter offload (stage 3 only); null = none.")
    sub_group_size: NonNegInt = Field(1_000_000_000, description="Elements per optimizer-step tile.")
    stage3_max_live_parameters: NonNegInt = Field(1_000_000_000,
                                                  description="Max gathered parameter elements resident.")
    stage3_max_reuse_distance: NonNegInt = Field(1_000_000_000, description="Keep a gathered parameter if reused within this.")
    stage3_prefetch_bucket_size: NonNegInt = Field(50_000_000,
                                                   description="Elements prefetched ahead of use at stage 3.")
    stage3_param_persistence_threshold: NonNegInt = Field(100_000, description="Parameters smaller than this stay unsharded.")
    stage3_model_persistence_threshold: NonNegInt = Field(
        sys.maxsize, description="Upper bound on total unsharded parameter elements at stage 3."
    )
    stage3_gather_16bit_weights_on_model_save: Bool = Field(
        False, description="Gather full 16-bit weights when saving the model (alias stage3_gather_fp16_weights_on_model_save)."
    )
    ignore_unused_parameters: Bool = Field(
        True, description="DeepSpeed fails on parameters without a gradient when false; fnzero never fails (warns when false)."
    )
    legacy_stage1: Bool = Field(False, description="DeepSpeed's old stage-1 implementation (accepted, no effect).")
    round_robin_gradients: Bool = Field(False, description="Round-robin gradient copies to host (scheduling hint).")
    zero_hpz_partition_size: NonNegInt = Field(
        1, description="ZeRO++ hpZ: stage 3 keeps a secondary parameter partition within groups of this many adjacent "
        "ranks (on one node), which backward re-gathers from; 0 or 1 = off (specs/mesh.md §hpZ).")
    mics_shard_size: Int = Field(
        -1, description="MiCS: shard the model state within groups of this many adjacent ranks and replicate across "
        "the groups; -1 or 0 = off (specs/mesh.md §MiCS). DeepSpeed 0.19.8 removed MiCS; its last source's meaning.")
    mics_hierarchical_params_gather: Bool = Field(
        False, description="MiCS's two-level (inter-node, then intra-node) parameter all-gather: accepted, no effect "
        "(one all-gather over the shard group gathers the same values).")
    zero_quantized_weights: Bool = Field(
        False, description="ZeRO++ qwZ: stage 3's parameter all-gathers carry int8 blocks with float32 scales.")
    zero_quantized_nontrainable_weights: Bool = Field(
        False, description="ZeRO++: frozen parameters' stage-3 all-gathers quantized too (kept in full precision).")
    zero_quantized_gradients: Bool = Field(
        False, description="ZeRO++ qgZ: gradient reduce-scatters (stages 2, 3) as int8 all-to-alls, summed in fp32.")
    memory_efficient_linear: Bool = Field(True, description="Memory-efficient linear at stage 3 (accepted, no effect).")
    # DeepSpeed 0.19.8 fields that tune its own implementation (accepted, no effect: specs/config.md §Keys).
    use_multi_rank_bucket_allreduce: Bool = Field(True, description="Combine ranks' reduce buckets into one all-reduce.")
    compute_grad_norm: Bool = Field(
        True, description="Compute the global gradient norm; false needs stage 1 or 2 and gradient_clipping 0, as "
        "DeepSpeed. fnzero always computes it.")
    parameter_alignment: Bool = Field(False, description="Align each parameter in DeepSpeed's stage-1/2 flat buffers.")
    pipeline_loading_checkpoint: Bool = Field(False, description="DeepSpeed's pipelined stage-3 checkpoint load.")
    override_module_apply: Bool = Field(True, description="DeepSpeed patches nn.Module.apply at stage 3; fnzero never does.")
    log_trace_cache_warnings: Bool = Field(False, description="Log DeepSpeed's stage-3 trace-cache warnings.")
    enable_sanity_checks: Bool = Field(False, description="DeepSpeed's internal stage-3 sanity checks.")
    save_muon_momentum_buffer_in_memory: Bool = Field(False, description="DeepSpeed's Muon buffer placement at "
                                                       "ZeRO 1-3 (fnzero keeps each matrix's momentum with its owner).")
    stage3_module_granularity_threshold: Int = Field(
        0, description="DeepSpeed fetches modules finer than this whole (alias module_granularity_threshold).")
    stage3_use_all_reduce_for_fetch_params: Bool = Field(
        False, description="Fetch stage-3 parameters with all-reduce (alias use_all_reduce_for_fetch_params).")
    stage3_allgather_sequential: Bool = Field(
        False, description="Gather stage-3 parameters one by one, without buckets (alias allgather_sequential).")
    leaf_module: LeafModuleConfig = Field(default_factory=LeafModuleConfig, description="DeepSpeed's stage-3 leaf modules.")
