"""The first TrainState of a sharded model (`ShardedModule.init_state`), built above the sharding,
optimizer, offload and checkpoint layers it joins, so sharding imports none of them
(`specs/architecture.md`); `sm` is read by its attributes only."""

from __future__ import annotations

import dataclasses
import os
import warnings

import torch

from .._errors import ShardingError
from .._state import TrainState
from ..checkpoint import load_adapters, hf_renames, load_pretrained
from ..config import ConfigWarning
from ..sharding import (
    PretrainedWarning, frozen_checksum_key, ShardSource, placeholder, unit_views, optimizer_view, param_pieces,
)
from ..offload import store_shards
from ._loss_scale import init_loss_scale
from ._owner_update import owner_layout, owner_tree
from ._policy import scaler_for, step_policy
from ._optimizer import exchanging_optimizer_refused, optimizer_or_config

__all__ = ["init_state", "initial_params"]


def init_state(sm, pretrained: str | os.PathLike | None = None, *,
               allow_unexpected: bool = False, optimizer=None, check_ranks_equal: bool = True,
               adapters: str | os.PathLike | None = None) -> TrainState:
    """This rank's initial TrainState from `sm`'s initial values (see `ShardedModule.init_state`)."""
    sm.initial_values()  # raises when handed over already
    if optimizer is None and (sm.config is None or sm.config.optimizer is None):
        raise ShardingError(
            "init_state() needs an optimizer: pass config= with an `optimizer` block to fnzero.shard, or optimizer="
        )
    # Before any file is read: a bad optimizer fails first.
    opt = optimizer_or_config(optimizer, sm.config, sm.comm.rank, sm.sharding.config_optimizer)
    plan = sm.plan
    kind = sm.config.optimizer.type if optimizer is None else "optimizer="
    if opt.exchanges_gradients and any(u.placement.grads or u.placement.optimizer for u in plan.units):
        raise exchanging_optimizer_refused(f"this model is sharded at ZeRO stage {plan.placement.stage}")
    if not opt.elementwise and sm.tp is not None:
        raise ShardingError(
            f"optimizer {kind} is not elementwise (it normalises per tensor) and cannot update tensor-parallel "
            "slices; use it without tensor parallelism"
        )
    if not opt.elementwise and plan.placement.optimizer:
        owner_layout(plan, opt)  # what the whole-tensor partition refuses, before any file is read
    initial = initial_params(sm, pretrained, allow_unexpected=allow_unexpected, check_ranks_equal=check_ranks_equal,
                             adapters=adapters, stacklevel=5)
    params, master, opt_state = _params_and_optimizer(sm, initial, opt)
    if sm.policy.offload_param == "cpu" and sm.sharding.device.type != "cpu":
        _frozen_to_host(sm)
    frozen, buffers = sm.constants
    return TrainState(
        params=params,
        master=master,
        opt_state=opt_state,
        frozen=frozen,
        buffers=buffers,
        step=torch.zeros((), dtype=torch.int64),
        loss_scale=init_loss_scale(scaler_for(step_policy(sm.config).loss_scale, sm.plan.placement)),
        sharding=sm.sharding,
    )


def initial_params(sm, pretrained: str | os.PathLike | None = None, *, allow_unexpected: bool = False,
                   check_ranks_equal: bool = True, adapters: str | os.PathLike | None = None,
                   stacklevel: int = 4) -> dict[str, torch.Tensor]:
    """The model's initial parameters, handed over from `sm` (unit name -> flat buffer or shard, in the
    plan's dtype), with `pretrained` loaded and every rank's build checked: what a state needs before
    any optimizer is involved (an inference state has none). `stacklevel`: the frame a
    `PretrainedWarning` points at, as `warnings.warn` counts from the loader below this function (3:
    this function's caller; 4, the default: its caller's caller)."""
    sm.initial_values()  # raises when handed over already
    # PEFT adapters (`specs/peft.md` §Resume) are checked first: a mismatch is found before the base is read.
    read_adapters = None if adapters is None else load_adapters(adapters, sm.module, sm.plan, sm.comm.rank,
                                                                sm.initial_values().params, tp=sm.tp)
    if pretrained is not None:
        _load_pretrained(sm, pretrained, allow_unexpected, stacklevel)
    loaded = set(sm.pretrained_report.loaded) if pretrained is not None else set()
    if read_adapters is not None:
        loaded |= _read_adapters(sm, *read_adapters)
    unset = [n for n in sm.initial_values().uninitialised if n not in loaded]
    if unset:
        raise ShardingError(
            f"model built on the meta device: its init code left {len(unset)} tensor(s) uninitialised"
            f"{' and the pretrained weights lack them' if pretrained is not None else ''}: "
            f"{', '.join(unset[:8])}{' ...' if len(unset) > 8 else ''}. fnzero initialises a meta model with "
            "each module's reset_parameters() and the model's _init_weights(module) (Hugging Face's hook); give "
            "these modules one of them, load them with init_state(pretrained=...), or build the model on a real device"
        )
    if check_ranks_equal:
        _check_ranks_start_equal(sm, loaded)
    return sm.hand_over_initial().params


def _frozen_to_host(sm) -> None:
    """`offload_param: cpu` on an accelerator: the frozen shards, which no optimizer holds, live in
    host memory and are copied to the device for their gathers (`offload/_host_params.py`). The
    trainable shards of a training state stay in device memory: the step's reduce-scatter and
    optimizer work on them there (a LoRA model's adapters, a small part)."""
    store_shards(sm, where="cpu")
    trainable = [u.name for u in sm.plan.units if u.placement.params]
    if trainable:
        warnings.warn(ConfigWarning(
            f"zero_optimization.offload_param device 'cpu' on {sm.sharding.device.type}: the frozen parameter shards "
            f"are held in host memory, but the {len(trainable)} trainable sharded unit(s) stay in device memory "
            "(host-resident trainable shards are not implemented; offload_param device 'nvme' moves them off the "
            "device)"), stacklevel=4)


def _check_ranks_start_equal(sm, loaded: set[str]) -> None:
    """Every rank built its own copy of the model; one built under another seed would make each
    rank's shard come from its own init, and the first step train a patchwork. Compare each
    unit's checksum (taken by `shard` from the whole unit) with rank 0's, in one small
    all-gather, and name the ranks and units that differ. Units read whole from pretrained files
    are not compared. (Raising rather than broadcasting rank 0's model: at stage 3 each rank
    kept only its shard, so there is nothing left to broadcast, and a silent repair would hide
    a seed bug that also shows in dropout and data order.)"""
    sums = sm.initial_values().checksums
    keyed = [(u.name, u) for u in sm.plan.units] + [(frozen_checksum_key(u), u) for u in sm.plan.frozen_units]
    names = [(k, u.is_expert) for k, u in keyed if k in sums and not all(s.name in loaded for s in u.slots)]
    # Expert units hold other experts on each ep rank: compared among the ranks holding the same ones.
    groups = [(sm.comm, "rank", [k for k, expert in names if not expert])]
    if sm.sharding.expert_comm is not None:
        groups.append((sm.sharding.expert_comm, "expert-data-parallel rank", [k for k, expert in names if expert]))
    if sm.sharding.replicas is not None:  # MiCS: every shard group holds the same units (`specs/mesh.md §MiCS`)
        groups.append((sm.sharding.replicas, "MiCS replica rank", [k for k, _ in names]))
    for comm, who, keys in groups:
        _compare_checksums(comm, who, keys, sums, len(names))


def _compare_checksums(comm, who: str, names: list[str], sums: dict[str, torch.Tensor], total: int) -> None:
    """Raise naming the ranks of `comm` whose checksums of `names` differ from its rank 0's."""
    world = comm.world_size
    if world == 1 or not names:
        return
    every = comm.all_gather(torch.stack([sums[n] for n in names]).reshape(-1)).view(world, len(names), 2)
    differ = {r: [n for i, n in enumerate(names) if not torch.equal(every[r, i], every[0, i])] for r in range(1, world)}
    differ = {r: units for r, units in differ.items() if units}
    if differ:
        ranks = "; ".join(f"{who} {r} in {units[:4]}{' ...' if len(units) > 4 else ''}" for r, units in differ.items())
        raise ShardingError(
            f"the ranks built different initial weights: {ranks} (of {total} units) differ from {who} 0's. "
            "Each rank's shard would come from its own init and the first step would train a patchwork. Build the "
            "model under the same seed on every rank (torch.manual_seed(seed) before constructing it), build it on "
            "the meta device (fnzero seeds its init), or load pretrained weights"
        )


def _params_and_optimizer(sm, initial: dict[str, torch.Tensor], opt):
    """The compute-dtype parameters, the fp32 master copy (None where the parameters are it) and
    the optimizer state over what this rank updates (`optimizer_view`)."""
    plan, rank = sm.plan, sm.comm.rank
    cd = sm.policy.compute_dtype or plan.param_dtype
    offload, params_on_nvme = sm.policy.offload_optimizer, sm.policy.offload_param == "nvme"
    if offload == "nvme":
        opt_state = opt.init(optimizer_view(plan, rank, initial, elementwise=True))  # files under nvme_path
        if params_on_nvme:
            # The store's master file holds every trainable shard already (fp32), so the shards are
            # read from it when gathered (`sharding/zero/_param_store.py`): one copy on disk, and no copy-out in
            # the step; the frozen ones, which no optimizer holds, go to a parameter store. No
            # compute-dtype copy is made of a shard that lives on disk (2Ψ/N bytes at 16 bits).
            params = {
                u.name: placeholder(u.shard_numel, cd, sm.sharding.device) if u.placement.params
                else initial[u.name].to(cd) for u in plan.units
            }
            opt_state = dataclasses.replace(opt_state, holds_params=True)
            sm.read_shards_from(params=ShardSource(opt_state.store, "master"))
            store_shards(sm)
            return params, None, opt_state
        return {name: t.to(cd) for name, t in initial.items()}, None, opt_state  # the master is on disk
    # A separate fp32 master copy exists for 16-bit training, for offload when the parameters live
    # on an accelerator (the master then stays on the host), and when the parameters live in files
    # (`offload_param: nvme`: the optimizer updates its own copy, and the step writes the new
    # parameters into their files).
    params = {name: t.to(cd) for name, t in initial.items()}
    separate_master = cd != plan.param_dtype or cd in (torch.float16, torch.bfloat16) or params_on_nvme
    separate_master = separate_master or (offload is not None and sm.sharding.device.type != "cpu")
    if not separate_master:
        return params, None, _init_optimizer(sm, opt, optimizer_view(plan, rank, params, opt.elementwise))
    master_dtype = torch.float32 if plan.param_dtype in (torch.float16, torch.bfloat16) else plan.param_dtype
    master = {
        k: v.to(device=torch.device("cpu") if offload else v.device, dtype=master_dtype, copy=True)
        for k, v in optimizer_view(plan, rank, initial, elementwise=True).items()
    }
    target = master
    if not opt.elementwise and not plan.placement.optimizer:
        target = {}
        for u in plan.units:
            target.update(unit_views(u, master[u.name]))
    opt_state = _init_optimizer(sm, opt, target)
    if params_on_nvme:  # every sharded shard, trainable and frozen, in a parameter store; placeholders here
        params = store_shards(sm, params)
    return params, master, opt_state


def _init_optimizer(sm, opt, target: dict[str, torch.Tensor]):
    """`opt`'s initial state over `target` (what the step updates); a non-elementwise optimizer at
    stages 1-3 over its whole-tensor partition's tree (`_owner_update.py`: a collective)."""
    plan = sm.plan
    if opt.elementwise or not plan.placement.optimizer:
        return opt.init(target)
    layout = owner_layout(plan, opt)
    (tree,) = owner_tree(layout, sm.comm, param_pieces(plan, sm.comm.rank, target))
    return layout.optimizer.init(tree)


def _load_pretrained(sm, path, allow_unexpected: bool, stacklevel: int) -> None:
    """Pretrained weights into the initial values, frozen parameters and buffers; checked before
    any byte is read, and the initial values dropped if reading fails partway."""
    persistent = {n for n, _ in sm.module.named_buffers()} - set(sm.plan.saved.non_persistent)
    frozen, buffers = sm.constants  # entries replaced, not written into
    base_prefix = getattr(sm.module, "base_model_prefix", "") or ""
    load = load_pretrained(path, sm.plan, sm.comm.rank, sm.initial_values().params, frozen, buffers, persistent,
                           allow_unexpected=allow_unexpected, base_prefix=str(base_prefix), tp=sm.tp,
                           rename=hf_renames(sm.module), ep=sm.ep)  # checked: nothing read yet
    try:
        sm.pretrained_report = load.run()
    except BaseException:
        sm.drop_initial()  # partly overwritten: never hand it out
        raise
    sm.replace_constants(frozen, buffers)
    missing = sm.pretrained_report.missing
    if missing:
        warnings.warn(
            f"pretrained weights {os.fspath(path)!r} lack {len(missing)} tensor(s), which keep the model's own "
            f"initialisation: {', '.join(missing[:12])}{' ...' if len(missing) > 12 else ''}"
            + _adapters_note(sm.pretrained_report.adapters),
            PretrainedWarning, stacklevel=stacklevel,
        )


def _read_adapters(sm, names: list[str], read) -> set[str]:
    try:
        read()
    except BaseException:
        sm.drop_initial()  # partly overwritten: never hand it out
        raise
    return set(names)


def _adapters_note(adapters: list[str]) -> str:
    # A PEFT model's adapters are in no base model's file: their own init is expected, not a gap.
    return f" (and {len(adapters)} adapter tensor(s), which PEFT initialised, as expected)" if adapters else ""
