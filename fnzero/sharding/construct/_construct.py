"""`fnzero.shard`: lay a model out for a ZeRO stage, from a built model, a meta model or a factory."""

from __future__ import annotations

import copy
import os
import re
from typing import Any, Callable, Iterable

import torch
from torch import nn

from ..._errors import ConfigError, ShardingError
from ..._state import StateMesh
from ..pp import PipelineInfo, PipelineModule
from ..tp import PLANS, TPRule, parallelize, rules_from_config, TPLayout, vocab_parallel_cross_entropy
from ..comm import (
    Mesh, mesh_from_config, zero_groups_of, CommQuantization, Collectives, ProcessGroupCollectives,
    default_collectives, CheckedCollectives, RecordingCollectives,
)
from ..ep import EPLayout, replace_for_autoep, split_for_ep, wanted_ep_size
from ..sp import split_for_sp
from ..zero import checked_quantization, shard_policy, ShardPlan, make_plan, unit_predicate, ambient, hook_unit
from ._initial import Cuts, InitialValues, initial_from_meta, initial_from_model, is_released
from ._materialize import build_on_meta, is_meta_model
from ._module import ShardedModule

__all__ = ["shard"]


def _job_watchdog(world: Collectives, config):
    """The job's collective watchdog (None in a simulated world), its timeout set from `config`."""
    watchdog = world.watchdog if isinstance(world, ProcessGroupCollectives) else None
    if watchdog is not None and config is not None:
        watchdog.set_timeout(config.watchdog.timeout_seconds)
    return watchdog


def shard(
    model: nn.Module,
    stage: int | None = None,
    config: Any = None,
    *,
    wrap: Callable[[str, nn.Module], bool] | Iterable[type] | None = None,
    comm: Collectives | None = None,
    device: torch.device | str | None = None,
    debug_collectives: bool = False,
    init_seed: int | None = None,
    mesh: Mesh | None = None,
    tp_plan: list[TPRule] | None = None,
    comm_quantization: CommQuantization | None = None,
    build_state: Callable[..., Any] | None = None,
) -> ShardedModule:
    """Lay out `model`'s parameters for ZeRO `stage` over the ranks of `comm` (default: the
    torch.distributed default group, or one process). `stage` overrides the config's
    `zero_optimization.stage`. See `specs/sharding.md`.

    `model`: a module, one built on the meta device, or a zero-argument factory `shard` calls
    there; a meta model is initialised shard by shard from `init_seed` (default: torch's initial
    seed on rank 0), the same values at any world size (`specs/sharding.md` §Meta construction).
    `device`: where the shards go (default: the accelerator if any). `wrap`: the stage-3 units.
    `mesh` (`fnzero.make_mesh`) or the config's `tensor_parallel`, `pipeline`, `expert_parallel` and
    `sequence_parallel_size` add tensor, pipeline, expert and sequence parallelism (`specs/mesh.md`); `tp_plan`: `TPRule`s replacing
    the model's AutoTP plan; `model` may be a `fnzero.pipeline.PipelineModule`.
    `debug_collectives=True` (or FNZERO_DEBUG_COLLECTIVES=1) checks before each collective that
    every rank issues the same one. `comm_quantization`: ZeRO++'s quantized collectives, replacing
    the config's (`specs/collectives.md` §Quantized collectives). `build_state`: what
    `sm.init_state` runs (`fnzero.shard` gives the state layer's). Returns a `ShardedModule`.

    >>> import torch, fnzero
    >>> cfg = fnzero.load_config({"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW"}})
    >>> sm = fnzero.shard(torch.nn.Linear(3, 2), stage=0, config=cfg)
    >>> state = sm.init_state()
    >>> sm.apply(state.params, torch.ones(1, 3)).shape
    torch.Size([1, 2])
    """
    policy = shard_policy(config, stage)
    comm = comm if comm is not None else default_collectives()
    debug = debug_collectives or os.environ.get("FNZERO_DEBUG_COLLECTIVES") == "1"
    model, mesh, pipe, wrap, ep = _this_ranks_model(model, comm, mesh, config, policy, debug, wrap)
    meta = is_meta_model(model)
    world = comm  # every rank of the job: a meta model's seed is the same on all of them
    whole, comm, tp_layout, ep_layout = _split_for_parallelism(model, comm, mesh, ep, config, tp_plan, debug, pipe, meta)
    watchdog = _job_watchdog(world, config)
    axes = _zero_axes(comm, mesh, policy, config, debug)
    comm = axes.data
    # Before any storage is released: a model refused here is still the user's, whole.
    sp_layout = (split_for_sp(model, _observed(mesh.sp, config, debug), _summed_cross_entropy(tp_layout),
                              pipeline=pipe is not None) if mesh is not None and mesh.sp else None)
    device = _device_for(model, device, meta)
    _check_params_on_nvme(policy)
    # Frozen parameters are sharded with the trainable ones at stage 3 (`specs/sharding.md` §Frozen
    # parameters), except tensor-parallel slices, which stay whole by name.
    plan = make_plan(model, comm.world_size, policy.placement, wrap=wrap, persistence_threshold=policy.persistence_threshold,
                     shard_frozen=tp_layout is None, expert_modules=ep_layout.modules if ep_layout else (),
                     ep=ep_layout.size if ep_layout else 1)
    initial, frozen, buffers = _initial_values(model, whole, plan, comm, world, device, policy, tp_layout, ep_layout,
                                               meta, init_seed)
    sm = ShardedModule(model, plan, axes.replace(tp=tp_layout, pp=pipe, ep=ep_layout, sp=sp_layout), policy, config,
                       device, initial,
                       frozen, buffers, watchdog=watchdog, quantization=checked_quantization(policy, comm_quantization),
                       build_state=build_state)
    _guard_and_route(model, plan, sm)
    return sm


def _this_ranks_model(model, comm: Collectives, mesh: Mesh | None, config: Any, policy, debug: bool, wrap):
    """(module, mesh, pipeline info or None, unit predicate, ep size) of what this rank shards: a
    factory's model built on meta, AutoEP's experts replaced, a pipeline's stage cut out."""
    pipe = None
    if not isinstance(model, (nn.Module, PipelineModule)):
        if not callable(model):
            raise ShardingError(f"fnzero.shard expects a torch.nn.Module or a zero-argument factory, got {type(model).__name__}")
        model = build_on_meta(model)
    mesh, ep = _mesh_for_experts(model, comm, mesh, config, policy)
    if isinstance(model, PipelineModule):
        model, mesh, pipe, wrap = _stage_for_pp(model, comm, mesh, config, policy, debug, wrap, ep)
        replace_for_autoep(model, config, mesh.shape.ep)  # the stage's Hugging Face MoE blocks, if any
    if is_released(model):
        raise ShardingError("this model was given to fnzero.shard already (its parameters are released); build a fresh model")
    return model, mesh, pipe, wrap, ep


def _split_for_parallelism(model: nn.Module, comm: Collectives, mesh: Mesh | None, ep: int, config: Any,
                           tp_plan: list[TPRule] | None, debug: bool, pipe: PipelineInfo | None, meta: bool):
    """This rank's model split over its tp and ep ranks: (a meta model's whole copy, initialised
    whole then cut, or None; the data-parallel collectives; the tp layout; the ep layout)."""
    whole = None
    if meta and (mesh is not None or (config is not None and config.tensor_parallel.size > 1)):
        whole = copy.deepcopy(model)
    comm, tp_layout = _split_for_tp(model, comm, mesh, config, tp_plan, debug, pipe)
    return whole, comm, tp_layout, _split_for_ep(model, mesh, ep, config, debug, meta)


def _summed_cross_entropy(tp_layout: TPLayout | None):
    """The summed cross-entropy of a vocabulary-split LM head's logits, for the sequence axis' loss; None
    (torch's) without one."""
    if tp_layout is None or tp_layout.vocab_head is None:
        return None
    start, comm = tp_layout.vocab_start(), tp_layout.comm
    return lambda logits, targets, ignore_index: vocab_parallel_cross_entropy(logits, targets, start, comm,
                                                                              ignore_index, "sum")


def _device_for(model: nn.Module, device: torch.device | str | None, meta: bool) -> torch.device:
    """Where the shards go: `device`, else a built model's own device, else the accelerator if any."""
    params0 = list(model.parameters())
    if device is None:
        device = default_device() if meta or not params0 else params0[0].device
    return torch.device(device)


def _check_params_on_nvme(policy) -> None:
    # load_config has checked the rest of `offload_param: nvme` (with the optimizer on nvme, one path);
    # only a stage passed to `shard` can still differ from the config's.
    if policy.offload_param == "nvme" and not policy.placement.params:
        raise ShardingError(
            f"zero_optimization.offload_param device 'nvme' needs sharded parameters, stage 3 (this run is "
            f"stage {policy.placement.stage})"
        )


def _initial_values(model: nn.Module, whole: nn.Module | None, plan: ShardPlan, comm: Collectives, world: Collectives,
                    device: torch.device, policy, tp_layout: TPLayout | None, ep_layout: EPLayout | None, meta: bool,
                    init_seed: int | None):
    """(`InitialValues`, frozen parameters, buffers) of this rank: replayed from a meta model, else
    taken from the built model's storage, which is released."""
    checksums: dict[str, torch.Tensor] = {}
    if meta:
        # Experts the split names apart (the DeepSpeed layer's) replay on the split model by their
        # global names; stacked ones, like tensor-parallel slices, are initialised whole and cut.
        cut = tp_layout is not None or (ep_layout is not None and bool(ep_layout.stacked))
        initial, frozen, buffers, uninitialised = initial_from_meta(
            whole if cut else model, plan, comm.rank, device, policy.compute_dtype,
            _init_seed(init_seed, world, device), Cuts(tp_layout, ep_layout) if cut else None, model if cut else None)
    else:
        initial, frozen, buffers, uninitialised = initial_from_model(
            model, plan, comm.rank, device, policy.compute_dtype, checksums if comm.world_size > 1 else None)
    from ..._ext import trim_freed_memory

    trim_freed_memory()  # the model's parameters were freed: do not keep their pages
    return InitialValues(initial, uninitialised, checksums), frozen, buffers


def _guard_and_route(model: nn.Module, plan: ShardPlan, sm: ShardedModule) -> None:
    """Refuse `load_state_dict` and direct calls on the sharded model; route its units to the apply run."""
    model.register_load_state_dict_pre_hook(_refuse_load_state_dict)
    model.register_forward_pre_hook(_refuse_direct_calls(plan))
    hooked = set()  # each module whose trainable or frozen unit is sharded, once
    for u in (*plan.units, *plan.frozen_units):
        if u.placement.params and u.module != "" and u.module not in hooked:
            hooked.add(u.module)
            hook_unit(model.get_submodule(u.module), u, sm._backward_runs)


def _mesh_for_experts(model, comm: Collectives, mesh: Mesh | None, config: Any, policy) -> tuple[Mesh | None, int]:
    """AutoEP's experts replaced where asked; (the mesh: given, or the config's with the ep size and
    MiCS/hpZ groups, None for a pipeline, which makes its own; the ep size)."""
    zero_groups = zero_groups_of(config, policy.placement.optimizer, policy.placement.params)
    pipeline = isinstance(model, PipelineModule)
    if not pipeline:  # Hugging Face MoE blocks' experts, split later (`specs/mesh.md §Expert parallelism`)
        replace_for_autoep(model, config, mesh.shape.ep if mesh is not None else 1)
    ep = wanted_ep_size(None if pipeline else model, config)
    sp = config.sequence_parallel_size if config is not None else 1
    if mesh is None and (ep > 1 or zero_groups != (0, 1) or sp > 1) and not pipeline:
        mesh = mesh_from_config(comm, config, ep=ep, zero_groups=zero_groups)
    elif mesh is not None and zero_groups != (0, 1) and zero_groups != (mesh.shape.mics, mesh.shape.hpz):
        raise ConfigError(f"the config asks for zero_optimization.mics_shard_size {zero_groups[0]} and "
                          f"zero_hpz_partition_size {zero_groups[1]} but the mesh given has mics {mesh.shape.mics} and hpz "
                          f"{mesh.shape.hpz}; make the mesh with fnzero.make_mesh(comm, mics=..., hpz=...) alike")
    return mesh, ep


def _zero_axes(comm: Collectives, mesh: Mesh | None, policy, config: Any, debug: bool) -> StateMesh:
    """The state's mesh of ZeRO's axes: the collectives it shards over (the MiCS shard group, else
    `comm`), and the MiCS replica and hpZ groups if any (`specs/mesh.md` §MiCS, §hpZ), observed."""
    if mesh is None or (mesh.mics is None and mesh.hpz is None):
        return StateMesh(_observed(comm, config, debug))
    if policy.offload_optimizer is not None or policy.offload_param is not None:
        key = "offload_optimizer" if policy.offload_optimizer is not None else "offload_param"
        feature = "mics_shard_size" if mesh.mics is not None else "zero_hpz_partition_size"
        raise ConfigError(f"zero_optimization.{feature} with zero_optimization.{key}: MiCS and hpZ are not built "
                          "for offloaded state; remove one")
    replicas = _observed(mesh.mics_replicas, config, debug) if mesh.mics is not None else None
    hpz = _observed(mesh.hpz, config, debug) if mesh.hpz is not None else None
    return StateMesh(_observed(mesh.mics if mesh.mics is not None else comm, config, debug), replicas, hpz)


def _stage_for_pp(pipe: PipelineModule, comm: Collectives, mesh: Mesh | None, config: Any, policy,
                  debug: bool, wrap, ep: int = 1) -> tuple[nn.Module, Mesh, PipelineInfo, Callable[[str, nn.Module], bool]]:  # fmt: skip
    """(this rank's stage as a module, the mesh, the stage's `PipelineInfo`, its unit predicate) of
    a pipeline model; a weight tied across stages is a unit of its own, laid out alike on each."""
    if mesh is None:
        zero_groups = zero_groups_of(config, policy.placement.optimizer, policy.placement.params)
        mesh = mesh_from_config(comm, config, pp=pipe.num_stages, ep=ep, zero_groups=zero_groups)
    stages = mesh.shape.pp
    if pipe.num_stages not in (None, stages):
        raise ConfigError(f"the PipelineModule asks for {pipe.num_stages} stages (num_stages) but the mesh has {stages}")
    if stages > 1 and policy.placement.grads:
        raise ConfigError(
            f"ZeRO stage {policy.placement.stage} with {stages} pipeline stages: ZeRO-2 and ZeRO-3 are incompatible "
            "with pipeline parallelism (as in DeepSpeed: every micro-batch's backward would reduce-scatter its "
            "gradients); use stage 0 or 1")
    dp_cfg = config.world_size if config is not None else None
    if config is not None and config.world_ranks == mesh.shape.world_size and dp_cfg != mesh.shape.batch_dp:
        raise ConfigError(
            f"the config's batch sizes were resolved for {dp_cfg} data-parallel ranks but this mesh has "
            f"{mesh.shape.batch_dp} "
            f"({stages} pipeline stages); set pipeline.stages to {stages} in the config so the batch triad counts "
            "data-parallel ranks only")
    interval = (config.pipeline.activation_checkpoint_interval or None) if config is not None else None
    seed_layers = config is not None and config.pipeline.seed_layers
    stage_id = mesh.coords["pp"]
    module = pipe.stage(stage_id, stages, interval, seed_layers=seed_layers)
    info = PipelineInfo(stage_id, stages, _observed(mesh.pp, config, debug), pipe.loss_fn, tuple(module.chunks),
                        mesh.world, module.ties)
    return module, mesh, info, _with_tied_units(module, wrap, {t.module for t in info.ties if t.module is not None})


def _with_tied_units(stage: nn.Module, wrap, tied: set[str]) -> Callable[[str, nn.Module], bool]:
    """A stage's unit predicate: `wrap`'s units (default: its `unit_paths`) and each tied weight's module."""
    chosen = set(stage.unit_paths)
    pred = unit_predicate(wrap) if wrap is not None else (lambda path, m: path in chosen)
    return lambda path, m: pred(path, m) or path in tied


def _split_for_tp(model: nn.Module, comm: Collectives, mesh: Mesh | None, config: Any,
                  tp_plan: list[TPRule] | None, debug: bool,
                  pipe: PipelineInfo | None = None) -> tuple[Collectives, TPLayout | None]:  # fmt: skip
    """AutoTP over the mesh's tp ranks, if any: (the data-parallel collectives, the tp layout or None)."""
    tp_cfg = config.tensor_parallel if config is not None else None
    if mesh is None and tp_cfg is not None and tp_cfg.size > 1:
        mesh = mesh_from_config(comm, config)
    if mesh is None:
        return comm, None
    if mesh.shape.tp == 1:
        return mesh.dp, None
    # A pipeline stage cut from a model takes the model's built-in plan (its names are the model's).
    rules = list(tp_plan) if tp_plan is not None else rules_from_config(tp_cfg, getattr(model, "plan_source", model))
    if pipe is not None:  # a weight tied across stages stays whole over tp: its copies must match element for element
        rules = [TPRule(f"^{re.escape(t.module)}$", "skip") for t in pipe.ties if t.module is not None] + rules
    if not rules:
        kind = getattr(getattr(model, "config", None), "model_type", None) or type(model).__name__
        preset = getattr(tp_cfg, "preset_model", None)
        if preset is not None:
            kind = (f"tensor_parallel.preset_model {preset!r} (one of DeepSpeed's presets; fnzero's built-in "
                    f"plans are {', '.join(sorted(PLANS))})")
        raise ConfigError(
            f"tensor parallelism over {mesh.shape.tp} ranks: fnzero has no built-in AutoTP plan for {kind}; give "
            "tensor_parallel.partition_config.layer_specs (patterns over parameter names, partition_type row or "
            "column) or shard(..., tp_plan=[TPRule(...)])"
        )
    vocab = tp_cfg.vocab_parallel_lm_head if tp_cfg is not None else None
    # The tp axis' traffic is recorded apart from dp's (`sm.tp.comm.records`), and checked too.
    return mesh.dp, parallelize(model, rules, _observed(mesh.tp, config, debug), vocab_parallel=vocab)


def _split_for_ep(model: nn.Module, mesh: Mesh | None, ep: int, config: Any, debug: bool,
                  meta: bool) -> EPLayout | None:
    """Each `ExpertGroup` keeps this rank's experts over the mesh's ep axis; the layout, or None."""
    mesh_ep = mesh.shape.ep if mesh is not None else 1
    if ep > 1 and mesh_ep != ep:
        raise ConfigError(f"the model's MoE layers ask for expert-parallel size {ep} but the mesh given has ep {mesh_ep}; "
                          f"make the mesh with fnzero.make_mesh(comm, ep={ep})")
    if mesh_ep == 1:
        return None
    layout = split_for_ep(model, _observed(mesh.ep, config, debug), _observed(mesh.expert_dp, config, debug))
    if layout is None:
        raise ConfigError(f"the mesh has {mesh_ep} expert-parallel ranks but the model has no experts to split (no "
                          "fnzero.moe.MoE layer, and no Hugging Face MoE block AutoEP replaced)")
    return layout


def _observed(comm: Collectives, config: Any, debug: bool) -> Collectives:
    """`comm` recorded (the config's comms_logger) and checked across ranks (debug_collectives)."""
    logger = config.comms_logger if config is not None else None
    if logger is not None and logger.enabled and not isinstance(comm, RecordingCollectives):
        comm = RecordingCollectives(comm)
    return CheckedCollectives(comm) if debug else comm


def _refuse_load_state_dict(module, *args, **kwargs) -> None:
    """Refuse `load_state_dict`: it would copy into meta placeholders and keep nothing (torch only warns)."""
    raise ShardingError(
        "this model was given to fnzero.shard: its parameters are meta placeholders and the values live in "
        "the TrainState, so load_state_dict into it keeps nothing. Load weights with "
        "sm.init_state(pretrained=...) or a checkpoint, and copy a state out with sm.load_into(fresh_model, state)"
    )


def _refuse_direct_calls(plan: ShardPlan) -> Callable[..., None]:
    """A forward pre-hook refusing direct calls (`model(x)` would fail on meta placeholders deep in
    torch); calls inside an apply run of this plan (`sm.apply`, remat) and compiled traces pass."""

    def hook(module: nn.Module, args: tuple) -> None:
        if torch.compiler.is_compiling():
            return
        run = ambient().run
        if run is not None and run.plan is plan:
            return
        raise ShardingError(
            f"this {type(module).__name__} was given to fnzero.shard: its parameters are meta placeholders and the "
            "values live in the TrainState, so it cannot be called directly. Run it with sm.apply(params, ...) "
            "(state.params, or in a loss function the params the step passes), or copy the weights into a fresh "
            "module with sm.load_into(fresh_model, state) and call that"
        )

    return hook


def default_device() -> torch.device:
    """Where a meta model's shards go when `shard` is not told: the current accelerator, else the host."""
    acc = torch.accelerator.current_accelerator()
    if acc is not None and torch.accelerator.is_available():
        return torch.device(acc.type, torch.accelerator.current_device_index())
    return torch.device("cpu")


def _init_seed(seed: int | None, comm: Collectives, device: torch.device) -> int:
    """The seed of a meta model's initialisation, the same on every rank: rank 0's unless given."""
    if seed is not None:
        return int(seed)
    seed = torch.initial_seed() & ((1 << 62) - 1)
    if comm.world_size > 1:
        seed = int(comm.broadcast(torch.tensor([seed], dtype=torch.int64, device=device), src=0)[0])
    return seed
