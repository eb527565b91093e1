"""`ShardedModule`: a model plus a ShardPlan, with a pure `apply` and the initial state (made by
`fnzero.shard`, `_construct.py`)."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import warnings
from typing import Any

import optree
import torch
from torch import nn

from .._errors import ShardingError
from .._offload._params import is_placeholder, placeholder, read_shard
from ._policy import ShardPolicy
from .._state import Sharding, TrainState
from ._collectives import Collectives
from ._plan import ShardPlan, UnitPlan
from ._runtime import ACTIVE_RUN, UNIT_COMPILER, ApplyRun, GatherSchedule, route_unit_forward, unit_views

__all__ = ["ShardedModule", "optimizer_view", "full_unit", "PretrainedWarning"]


def full_unit(unit: UnitPlan, t: torch.Tensor, comm) -> torch.Tensor:
    """A unit's full padded buffer from either the full buffer itself or this rank's shard."""
    if t.numel() == unit.padded_numel:
        return t
    if t.numel() == unit.shard_numel:
        return comm.all_gather(t)
    raise ShardingError(
        f"unit {unit.name!r}: a buffer of {t.numel()} elements is neither the full unit "
        f"({unit.padded_numel}) nor a shard ({unit.shard_numel})"
    )


def optimizer_view(plan: ShardPlan, rank: int, params: dict[str, torch.Tensor], elementwise: bool = True):
    """What the optimizer updates when params are the master copy (fp32 training), by each unit's
    placement: the whole unit where the optimizer state is replicated, the shard itself where
    parameters are sharded, else this rank's slice of the replicated buffer. Slices are views.

    Non-elementwise optimizers (Lamb) need whole tensors; they get per-parameter views where the
    optimizer state is replicated.
    """
    out = {}
    for u in plan.units:
        t = params[u.name]
        if not u.placement.optimizer:
            if elementwise:
                out[u.name] = t
            else:
                out.update(unit_views(u, t))
        elif u.placement.params:
            out[u.name] = t
        else:
            lo, hi = u.shard_range(rank)
            out[u.name] = t[lo:hi]
    return out


class ShardedModule:
    """A model whose trainable parameters are laid out by a ShardPlan.

    `apply(params, *args, **kwargs)` runs the model's forward with the parameters in `params` (the
    `params` field of a TrainState, or the differentiable aliases `train_step` hands to the loss);
    `init_state()` builds this rank's initial TrainState; `gather(...)` consolidates full parameters
    in `model.state_dict()` naming. The model is owned by the ShardedModule after `shard`: its
    parameter storage is released (replaced by meta placeholders) and stage-3 units' forwards are
    routed through `apply`.
    """

    def __init__(self, module: nn.Module, plan: ShardPlan, comm: Collectives, policy: ShardPolicy, config, device):
        self.module = module
        self.plan = plan
        self.comm = comm
        self.policy = policy
        self.config = config
        self.sharding = Sharding(plan, comm, device)
        self._initial: dict[str, torch.Tensor] | None = None
        # Stage-3 prefetch order, learned from the last step (a performance cache, not state).
        self._schedule = GatherSchedule(policy.prefetch_numel, policy.max_live_numel)
        self._frozen: dict[str, torch.Tensor] = {}
        self._buffers: dict[str, torch.Tensor] = {}
        # `offload_param: nvme`: the NVMe store that stage-3 shards are read from (set by init_state).
        self._param_store = None
        self._units_routed = False  # see `_route_units`
        self.pretrained_report = None  # set by `init_state(pretrained=...)`
        # A meta model's tensors its init code did not write: pretrained weights must supply them.
        self._uninitialised: list[str] = []
        # The apply runs whose parameters are bound for a backward pass right now (`_backward.py`).
        self._backward_runs: list[ApplyRun] = []

    # ---------------------------------------------------------------------------------------------
    def apply(self, params: dict[str, torch.Tensor], *args: Any, **kwargs: Any) -> Any:
        """Run the model's forward with `params` (one flat buffer or shard per unit). Pure: the
        module's own attributes are restored on return, and nothing in `params` is modified.

        In 16-bit training, floating-point tensor arguments are cast to the compute dtype (as
        FSDP's `cast_forward_inputs`), so callers pass the same batch at any precision."""
        plan = self.plan
        cd = self.policy.compute_dtype
        if cd is not None:
            args, kwargs = optree.tree_map(
                lambda x: x.to(cd) if isinstance(x, torch.Tensor) and x.is_floating_point() else x,
                (args, kwargs),
                none_is_leaf=True,
            )
        missing = [u.name for u in plan.units if u.name not in params]
        if missing:
            raise ShardingError(f"params lack units {missing}; pass state.params (or the params given to the loss)")
        if not torch.compiler.is_compiling() and UNIT_COMPILER.get() is not None:
            self._route_units()
        if torch.compiler.is_compiling() and not plan.any_sharded_params:
            # Under torch.compile (`fnzero.jit`) with no stage-3 units there is nothing to gather and
            # no saved tensor to re-gather: bind the views and let the whole forward be one graph.
            return self._call(self._tensors((u, params[u.name]) for u in plan.units), args, kwargs)
        return self._apply_gathering(params, args, kwargs)

    def _route_units(self) -> None:
        """Once: route every gathered unit module's forward through `UNIT_COMPILER` (stage-3
        sharded units are routed already, by the wrapper that gathers them)."""
        if self._units_routed:
            return
        for u in self.plan.units:
            if u.module != "" and not self.plan.params_sharded(u):
                route_unit_forward(self.module.get_submodule(u.module), self._backward_runs)
        self._units_routed = True

    def _tensors(self, fulls) -> dict[str, torch.Tensor]:
        """What the module's forward reads, by state_dict name: the views of each (unit, full
        buffer[, stage-3 runtime]) in `fulls`, the frozen parameters and the buffers."""
        tensors: dict[str, torch.Tensor] = {}
        for u, full, *rt in fulls:
            tensors.update(unit_views(u, full, *rt))
        tensors.update(self._frozen)
        tensors.update(self._buffers)
        return tensors

    def _call(self, tensors: dict[str, torch.Tensor], args: tuple, kwargs: dict) -> Any:
        ac = self.policy.autocast_dtype
        if ac is None:
            return torch.func.functional_call(self.module, tensors, args, kwargs, tie_weights=False, strict=False)
        # `torch_autocast` (DeepSpeed's engine does the same around forward): the parameters stay
        # in their dtype, autocast-eligible ops compute in the autocast dtype.
        device_type = self.sharding.device.type
        with torch.autocast(device_type, dtype=None if ac == "default" else ac):
            return torch.func.functional_call(self.module, tensors, args, kwargs, tie_weights=False, strict=False)

    def _apply_gathering(self, params: dict[str, torch.Tensor], args: tuple, kwargs: dict) -> Any:
        run, tensors, stack = self._begin_run(params)
        try:
            out = self._call(tensors, args, kwargs)
        finally:
            self._end_run(stack)
        run.bind_in_backward(self.module, tensors, out)
        run.finish_forward(out)
        return out

    @torch.compiler.disable
    def _begin_run(self, params: dict[str, torch.Tensor]) -> tuple[ApplyRun, dict[str, torch.Tensor], Any]:
        """Gather what the root needs, make the run current, enter its saved-tensor hooks."""
        plan = self.plan
        run = ApplyRun(plan, self.comm, params, self._schedule if self.policy.prefetch_numel > 0 else None,
                       shard_store=self._param_store, backward_runs=self._backward_runs)
        fulls, live = [], []
        for u in plan.units:
            if plan.params_sharded(u) and u.module != "":
                continue  # gathered when its forward runs
            full, rt = run.gather_unit(u)
            live.append((full, rt))
            fulls.append((u, full, rt))
        tensors = self._tensors(fulls)
        stack = contextlib.ExitStack()
        token = ACTIVE_RUN.set(run)
        stack.callback(ACTIVE_RUN.reset, token)
        run.bindings.append(("tensors", self.module, tensors))
        try:
            stack.enter_context(run.saved_tensor_hooks())
            stack.enter_context(_live_all(run, live))
        except BaseException:
            stack.close()
            raise
        return run, tensors, stack

    @torch.compiler.disable
    def _end_run(self, stack: Any) -> None:
        stack.close()

    __call__ = apply
    # Eager under torch.compile (it sets up gathering and saved-tensor hooks); the module's
    # forward it calls is still compiled (`specs/jit.md`).
    _apply_gathering = torch.compiler.disable(
        _apply_gathering, recursive=False,
        reason="fnzero ZeRO-3: apply gathers the root unit and installs the saved-tensor re-gather hooks (eager)",
    )

    # ---------------------------------------------------------------------------------------------
    def init_state(self, pretrained: str | os.PathLike | None = None, *, allow_unexpected: bool = False) -> TrainState:
        """This rank's initial TrainState, built from the model's parameters at `shard` time.

        `pretrained`: a safetensors file, or a directory written by transformers' `save_pretrained`
        (`model.safetensors`, or shards with `model.safetensors.index.json`), or by `fnzero
        export`. Its tensors replace the initial values, each rank reading only the bytes of the
        elements it holds, cast to the training dtype (`specs/checkpoint-format.md` §Pretrained).
        Every name, shape and file is checked before any data is read: a tensor the model lacks
        is an error listing them all (unless `allow_unexpected`), a shape mismatch names the
        tensor, and a truncated file names the file. Parameters the files lack keep the model's
        own initialisation and are listed in a `PretrainedWarning`; `sm.pretrained_report` says
        what was loaded and how many bytes this rank read.

        The initial buffers are handed over, not copied, so a model's memory is held once; call
        `fnzero.shard` again for a second independent initial state.
        """
        from .. import optim as _optim  # local: optim depends on nothing here, but keeps import order simple

        if self._initial is None:
            raise ShardingError(
                "init_state() hands the model's initial parameters over to the state and can be called once; "
                "shard the model again for another initial state (or copy a state with fnzero.tree_clone)"
            )
        if self.config is None or getattr(self.config, "optimizer", None) is None:
            raise ShardingError(
                "init_state() needs an optimizer: pass config= with an `optimizer` block to fnzero.shard"
            )
        if pretrained is not None:
            self._load_pretrained(pretrained, allow_unexpected)
        loaded = set(self.pretrained_report.loaded) if pretrained is not None else set()
        unset = [n for n in self._uninitialised if n not in loaded]
        if unset:
            raise ShardingError(
                f"model built on the meta device: its init code left {len(unset)} tensor(s) uninitialised"
                f"{' and the pretrained weights lack them' if pretrained is not None else ''}: "
                f"{', '.join(unset[:8])}{' ...' if len(unset) > 8 else ''}. fnzero initialises a meta model with "
                "each module's reset_parameters() and the model's _init_weights(module) (Hugging Face's hook); give "
                "these modules one of them, load them with init_state(pretrained=...), or build the model on a real device"
            )
        initial, self._initial = self._initial, None
        opt = _optim.from_config(self.config)
        plan, rank = self.plan, self.comm.rank
        cd = self.policy.compute_dtype or plan.param_dtype
        params = {name: t.to(cd) for name, t in initial.items()}
        offload = self.policy.offload_optimizer
        host = torch.device("cpu")
        # A separate fp32 master copy exists for 16-bit training, and for offload when the
        # parameters live on an accelerator (the master then stays on the host).
        separate_master = cd != plan.param_dtype or cd in (torch.float16, torch.bfloat16)
        separate_master = separate_master or (offload is not None and self.sharding.device.type != "cpu")
        if separate_master:
            master_dtype = torch.float32 if plan.param_dtype in (torch.float16, torch.bfloat16) else plan.param_dtype
            master = {
                k: v.to(device=host if offload else v.device, dtype=master_dtype, copy=True)
                for k, v in optimizer_view(plan, rank, initial, elementwise=True).items()
            }
            opt_target = master
            if not opt.elementwise and not plan.placement.optimizer:
                opt_target = {}
                for u in plan.units:
                    opt_target.update(unit_views(u, master[u.name]))
        else:
            master = None
            opt_target = optimizer_view(plan, rank, params, opt.elementwise)
        if not opt.elementwise and plan.placement.optimizer:
            raise ShardingError(
                f"optimizer {self.config.optimizer.type} is not elementwise (it normalises per tensor) and "
                "cannot update flat shards; use it at ZeRO stage 0"
            )
        from .._loss_scale import init_loss_scale
        from .._policy import step_policy

        sp = step_policy(self.config)
        if offload == "nvme":
            opt_state = self._nvme_init(optimizer_view(plan, rank, initial, elementwise=True))
            master = None  # on disk, with the moments
            if self.policy.offload_param == "nvme":
                # The shards are read from the store's master file when gathered (`_params.py`).
                params = {
                    u.name: placeholder(u.shard_numel, cd, self.sharding.device) if plan.params_sharded(u) else params[u.name]
                    for u in plan.units
                }
                opt_state = dataclasses.replace(opt_state, holds_params=True)
                self._param_store = opt_state.store
        else:
            opt_state = opt.init(opt_target)
        return TrainState(
            params=params,
            master=master,
            opt_state=opt_state,
            frozen=dict(self._frozen),
            buffers=dict(self._buffers),
            step=torch.zeros((), dtype=torch.int64),
            loss_scale=init_loss_scale(sp.loss_scale),
            sharding=self.sharding,
        )

    def _load_pretrained(self, path, allow_unexpected: bool) -> None:
        from ..checkpoint._pretrained import load_pretrained

        persistent = {n for n, _ in self.module.named_buffers()} - _non_persistent_buffers(self.module)
        frozen, buffers = dict(self._frozen), dict(self._buffers)  # entries replaced, not written into
        base_prefix = getattr(self.module, "base_model_prefix", "") or ""
        load = load_pretrained(path, self.plan, self.comm.rank, self._initial, frozen, buffers, persistent,
                               allow_unexpected=allow_unexpected, base_prefix=str(base_prefix))  # checked: nothing read yet
        try:
            self.pretrained_report = load.run()
        except BaseException:
            self._initial = None  # partly overwritten: never hand it out
            raise
        self._frozen, self._buffers = frozen, buffers
        if self.pretrained_report.missing:
            missing = self.pretrained_report.missing
            warnings.warn(
                f"pretrained weights {os.fspath(path)!r} lack {len(missing)} tensor(s), which keep the model's own "
                f"initialisation: {', '.join(missing[:12])}{' ...' if len(missing) > 12 else ''}",
                PretrainedWarning, stacklevel=3,
            )

    def _nvme_init(self, master_view: dict[str, torch.Tensor]):
        """ZeRO-Infinity: the fp32 master shards and zero moments go to files under nvme_path."""
        from .._offload._cpu import host_optimizer_from_config
        from .._offload._nvme import NvmeOptimizerStore
        from .._offload._state import NvmeOptState

        z = self.config.zero_optimization
        oo = z.offload_optimizer
        kind = host_optimizer_from_config(self.config).kind
        aio = self.config.aio.model_dump() if getattr(self.config, "aio", None) is not None else None
        master = {k: v.detach().to(device="cpu", dtype=torch.float32) for k, v in master_view.items()}
        store = NvmeOptimizerStore.create(
            oo.nvme_path, master, optimizer=kind, sub_group_size=max(1, int(z.sub_group_size)),
            buffer_count=max(2, int(oo.buffer_count)), aio=_aio_kwargs(aio), rank=self.comm.rank,
        )
        import atexit

        # Scratch files of this run: removed when the process ends (a killed process leaves them;
        # fnzero._offload.stale_stores finds and removes those).
        atexit.register(store.close)
        return NvmeOptState(count=torch.zeros((), dtype=torch.int64), store=store)

    # ---------------------------------------------------------------------------------------------
    def gather(self, params: dict[str, torch.Tensor] | TrainState, *, dtype: torch.dtype | None = None,
               rank0_only: bool = False) -> dict[str, torch.Tensor]:
        """Consolidated trainable parameters, `model.state_dict()` names (tied names included), on
        every rank (or only rank 0 with `rank0_only`: the others take part in the gathers and get
        an empty dict). Given a TrainState, its master weights are used when it has them."""
        if isinstance(params, TrainState):
            src = params.master if params.master is not None else params.params
        else:
            src = params
        out = {}
        for u in self.plan.units:
            shard = src[u.name].detach()
            if self._param_store is not None and is_placeholder(shard):
                shard = read_shard(self._param_store, u.name, shard)
            full = full_unit(u, shard, self.comm)
            if full.numel() != u.padded_numel:
                full = self.comm.all_gather(full)
            if rank0_only and self.comm.rank != 0:
                continue
            for name, t in unit_views(u, full).items():
                out[name] = t.to(dtype) if dtype is not None else t.clone()
        return out

    def state_dict(self, state: TrainState, *, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        """Like `model.state_dict()`: trainable, frozen parameters and buffers, consolidated."""
        out = self.gather(state, dtype=dtype)
        for name, t in {**state.frozen, **state.buffers}.items():
            out[name] = t.to(dtype) if (dtype is not None and t.is_floating_point()) else t.clone()
        return out


class PretrainedWarning(UserWarning):
    """`init_state(pretrained=...)`: some of the model's tensors are not in the files."""


def _non_persistent_buffers(model: nn.Module) -> set[str]:
    out = set()
    for path, m in model.named_modules():
        for leaf in getattr(m, "_non_persistent_buffers_set", ()):
            out.add(f"{path}.{leaf}" if path else leaf)
    return out


def _aio_kwargs(aio: dict | None) -> dict | None:
    """The config's aio block in the names the store takes (DeepSpeed renamed thread_count)."""
    if aio is None:
        return None
    keys = {"block_size", "queue_depth", "thread_count", "single_submit", "overlap_events"}
    out = {k: v for k, v in aio.items() if k in keys and v is not None}
    if "thread_count" not in out and aio.get("intra_op_parallelism") is not None:
        out["thread_count"] = aio["intra_op_parallelism"]
    return out


class _live_all:
    def __init__(self, run: ApplyRun, live):
        self.run, self.live, self.stack = run, live, None

    def __enter__(self):
        self.stack = contextlib.ExitStack()
        for full, rt in self.live:
            self.stack.enter_context(self.run.live(full, rt))
        return self

    def __exit__(self, *exc):
        return self.stack.__exit__(*exc)
