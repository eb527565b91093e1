"""Dynamic-default resolution and the cross-field rules DeepSpeed ignores silently.

Each rule returns one message naming the keys involved and the fix (specs/config.md §Cross-field
rules); DeepSpeed asserts some at runtime and quietly ignores others.
"""

from __future__ import annotations

import os

from ._autotuning import autotuning_rules
from ._expert import expert_rules
from ._models import Config
from ._optim_models import ONEBIT_TYPES
from ._sched_models import OneCycleParams, WarmupLRParams

__all__ = ["resolve", "cross_checks", "quantized_comm_rules", "zero_world_rule"]


def resolve(cfg: Config) -> Config:
    """Replace DeepSpeed's dynamic defaults (null) with the concrete value they mean."""
    zero = cfg.zero_optimization
    update: dict[str, object] = {}
    if zero.overlap_comm is None:
        # As DeepSpeed 0.19.8 (`overlap_comm_valid`): true at stage 3, false below. Overlap never
        # changes results; fnzero's examples set it true at every stage, where it is faster.
        update["zero_optimization"] = zero.model_copy(update={"overlap_comm": zero.stage == 3})
    sched = cfg.scheduler
    if (
        sched is not None and isinstance(sched.params, WarmupLRParams)
        and sched.params.warmup_max_lr is None and cfg.optimizer is not None
    ):
        # DeepSpeed's WarmupLR warms up to the optimizer's lr when warmup_max_lr is unset.
        params = sched.params.model_copy(update={"warmup_max_lr": cfg.optimizer.params.lr})
        update["scheduler"] = sched.model_copy(update={"params": params})
    return cfg.model_copy(update=update) if update else cfg


def cross_checks(cfg: Config) -> list[str]:
    """Every cross-field problem in a field-valid config."""
    # Long: one self-contained rule per cross-key constraint, each naming its keys.
    out: list[str] = []
    stage = cfg.zero_optimization.stage
    out.extend(quantized_comm_rules(cfg))
    out.extend(autotuning_rules(cfg.autotuning))
    if cfg.fp16.enabled and cfg.bf16.enabled:
        out.append("`fp16.enabled` and `bf16.enabled` are both true; enable at most one precision")
    if (cfg.pipeline.size or 1) > 1 and stage >= 2:
        out.append(
            f"`zero_optimization.stage` is {stage} with `pipeline.stages` {cfg.pipeline.stages}: ZeRO-2 and ZeRO-3 are "
            "incompatible with pipeline parallelism (as in DeepSpeed: every micro-batch's backward would reduce-scatter "
            "its gradients, multiplying the data-parallel traffic by the micro-batch count); use stage 0 or 1")
    if not cfg.zero_optimization.compute_grad_norm:
        # As DeepSpeed 0.19.8: its compute_grad_norm_valid, and its stage-1/2 optimizer's check on clipping.
        why = (f"`zero_optimization.stage` is {stage}, and DeepSpeed allows it only at stage 1 or 2"
               if stage not in (1, 2) else
               f"`gradient_clipping` is {cfg.gradient_clipping!r}, and clipping needs the norm (DeepSpeed asks for 0)"
               if cfg.gradient_clipping > 0 else None)
        if why:
            out.append(f"`zero_optimization.compute_grad_norm` is false, but {why}; remove it (fnzero always "
                       "computes the norm)")
    off_opt = cfg.zero_optimization.offload_optimizer
    off_par = cfg.zero_optimization.offload_param
    if off_par is not None and off_par.device != "none" and stage < 3:
        out.append(
            f"`zero_optimization.offload_param.device` is {off_par.device!r} but `zero_optimization.stage` is {stage}; "
            "parameter offload needs stage 3 (DeepSpeed silently ignores it below), so set stage 3 or remove offload_param"
        )
    if off_opt is not None and off_opt.device != "none" and stage == 0:
        out.append(
            f"`zero_optimization.offload_optimizer.device` is {off_opt.device!r} but `zero_optimization.stage` is 0; "
            "optimizer offload needs stage 1, 2 or 3, so raise the stage or remove offload_optimizer"
        )
    if off_opt is not None and off_opt.ratio < 1.0 and stage != 3:
        out.append(
            f"`zero_optimization.offload_optimizer.ratio` is {off_opt.ratio!r} but partial offload needs "
            f"`zero_optimization.stage` 3 (got {stage}); set ratio 1.0 or stage 3"
        )
    if (off_par is not None and off_par.device == "nvme" and off_opt is not None and off_opt.device == "nvme"
            and off_par.nvme_path and off_opt.nvme_path
            and os.path.realpath(off_par.nvme_path) != os.path.realpath(off_opt.nvme_path)):
        # With the optimizer on NVMe, its master file already holds every trainable shard, and fnzero
        # reads them from there (specs/offload.md §Parameters); with the optimizer on the host or in
        # device memory the shards have files of their own under offload_param.nvme_path.
        out.append(
            f"`zero_optimization.offload_param.nvme_path` {off_par.nvme_path!r} differs from "
            f"`zero_optimization.offload_optimizer.nvme_path` {off_opt.nvme_path!r}; with the optimizer on nvme "
            "fnzero keeps parameter shards in the optimizer's master file, so give both the same directory"
        )
    for name, block in (("offload_optimizer", off_opt), ("offload_param", off_par)):
        if block is not None and block.device == "nvme" and not block.nvme_path:
            out.append(
                f"`zero_optimization.{name}.device` is 'nvme' but `zero_optimization.{name}.nvme_path` is not set; "
                "add nvme_path (a directory on the NVMe drive)"
            )
    sched = cfg.scheduler
    if sched is not None:
        params = sched.params
        if isinstance(params, WarmupLRParams) and params.warmup_max_lr is not None and params.warmup_max_lr < params.warmup_min_lr:
            out.append(
                f"`scheduler.params.warmup_max_lr` {params.warmup_max_lr!r} is below `scheduler.params.warmup_min_lr` "
                f"{params.warmup_min_lr!r}; swap them"
            )
        if (
            isinstance(params, OneCycleParams) and params.cycle_momentum
            and cfg.optimizer is not None and cfg.optimizer.type in ("SGD", "Adagrad", "Muon")
        ):
            out.append(
                f"`scheduler.params.cycle_momentum` is true but optimizer {cfg.optimizer.type} has no betas to cycle "
                "(DeepSpeed silently turns it off); set cycle_momentum false"
            )
    if cfg.optimizer is not None and cfg.optimizer.type == "Muon":
        out.extend(_muon_rules(cfg, stage))
    out.extend(onebit_rules(cfg))
    out.extend(expert_rules(cfg.expert_parallel, cfg.tensor_parallel.size, cfg.tensor_parallel.preset_model))
    return out


def quantized_comm_rules(cfg: Config) -> list[str]:
    """ZeRO++'s quantized collectives where the stage moves what they quantize (specs/collectives.md
    §Quantized collectives): DeepSpeed reads `zero_quantized_weights` in its stage-3 partitioning only,
    and silently ignores it below; fnzero refuses instead."""
    z, out = cfg.zero_optimization, []
    for key, needs in (("zero_quantized_weights", 3), ("zero_quantized_nontrainable_weights", 3),
                       ("zero_quantized_gradients", 2)):
        if getattr(z, key) and z.stage < needs:
            out.append(f"`zero_optimization.{key}` is true but `zero_optimization.stage` is {z.stage}; it quantizes "
                       f"what stage {needs}{' or 3' if needs == 2 else ''} moves, so raise the stage or remove it")
    return out


def _muon_rules(cfg: Config, stage: int) -> list[str]:
    """What fnzero's Muon does not run (specs/optim.md §Muon): every stage works through the
    whole-matrix optimizer partition, but not beside what cuts matrices another way."""
    out = []
    off_opt = cfg.zero_optimization.offload_optimizer
    if off_opt is not None and off_opt.device != "none":
        out.append(
            f"`optimizer.type` is Muon with `zero_optimization.offload_optimizer.device` {off_opt.device!r}: the "
            "offloaded step runs a host kernel over flat shards of the master weights, and Muon orthogonalises whole "
            "matrices (no host kernel computes it); remove offload_optimizer"
        )
    if cfg.tensor_parallel.size > 1:
        out.append(
            f"`optimizer.type` is Muon with `tensor_parallel.autotp_size` {cfg.tensor_parallel.size}: each rank holds "
            "column or row slices of the matrices Muon orthogonalises whole; set autotp_size 1 for Muon"
        )
    if cfg.expert_parallel.size > 1 and stage > 0:
        out.append(
            f"`optimizer.type` is Muon with `expert_parallel.autoep_size` {cfg.expert_parallel.size} at "
            f"`zero_optimization.stage` {stage}: the whole-matrix optimizer partition covers the dense units, not "
            "the experts' (sharded over their expert-data-parallel ranks); use stage 0 with expert parallelism"
        )
    return out


def zero_world_rule(cfg: Config) -> list[str]:
    """MiCS's shard groups and hpZ's groups divide the data-parallel ranks (`specs/mesh.md §MiCS`,
    `specs/mesh.md §hpZ`); checked when the config knows its world. The ranks per node are the
    mesh's to check, where the launcher's LOCAL_WORLD_SIZE is known."""
    z, dp = cfg.zero_optimization, cfg.world_size
    sizes = (("mics_shard_size", z.mics_shard_size), ("zero_hpz_partition_size", z.zero_hpz_partition_size))
    return [f"`zero_optimization.{key}` {v} must divide the data-parallel world size {dp}: each of its groups is "
            f"{v} adjacent data-parallel ranks, so use a divisor of {dp}" for key, v in sizes if v > 1 and dp % v]


def onebit_rules(cfg: Config) -> list[str]:
    """What 1-bit Adam, 0/1 Adam and 1-bit LAMB cannot run with (specs/optim.md §1-bit optimizers): they
    exchange whole momenta over the data-parallel ranks themselves, from each rank's own gradients."""
    kind = cfg.optimizer.type if cfg.optimizer is not None else None
    if kind not in ONEBIT_TYPES:
        return []
    out = []
    head = f"`optimizer.type` is {kind}"
    if cfg.zero_optimization.stage > 0:
        out.append(f"{head} with `zero_optimization.stage` {cfg.zero_optimization.stage}: it exchanges whole momenta "
                   "and runs at stage 0 only (as DeepSpeed, which asserts it is not compatible with ZeRO); set stage 0")
    if kind == "OneBitLamb" and cfg.fp16.enabled and cfg.fp16.loss_scale > 0:
        out.append(f"{head} with `fp16.loss_scale` {cfg.fp16.loss_scale!r}: 1-bit LAMB needs dynamic loss scaling "
                   "(DeepSpeed asserts it); set loss_scale 0")
    for key, on in (("tensor_parallel.autotp_size", cfg.tensor_parallel.size > 1),
                    ("pipeline.stages", (cfg.pipeline.size or 1) > 1),
                    ("expert_parallel.enabled", cfg.expert_parallel.enabled),
                    ("sequence_parallel_size", cfg.sequence_parallel_size > 1)):
        if on:
            out.append(f"{head} with `{key}`: its compressed exchange averages whole momenta over every data-parallel "
                       "rank, which tensor, pipeline and expert parallelism split and sequence parallelism's ranks "
                       "would each count as a sample; remove one of them")
    return out
