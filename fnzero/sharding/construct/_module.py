"""`ShardedModule`: a model plus a ShardPlan, with a pure `apply` and the initial state (made by
`fnzero.shard`, `_construct.py`)."""

from __future__ import annotations

import contextlib
import os
from typing import Any, Callable, Collection

import optree
import torch
from torch import nn

from ..._errors import ShardingError
from ..._state import Sharding, StateMesh, TrainState
from ..comm import Collectives
from ._initial import InitialValues, is_released
from ..zero import (
    ShardSource, ShardSources, held, sources_of, ShardPolicy, ROOT_UNIT, ShardPlan, UnitPlan, comm_for,
    non_persistent_buffers, ambient, within, ApplyRun, GatherSchedule, unit_views, compile_unit_calls,
)
from ._holding import HoldsGatheredUnits
from ..tp import vocab_parallel_cross_entropy
from ..sp import tiled_causal_lm_loss
from ...optim import config_optimizer

__all__ = ["ShardedModule", "full_unit"]


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


class ShardedModule(HoldsGatheredUnits):
    """A model whose trainable parameters are laid out by a ShardPlan (made by `fnzero.shard`, which
    releases the model's parameter storage: `specs/sharding.md` §Apply): `apply` runs the forward with
    `params`, `init_state` builds this rank's initial TrainState, `gather` consolidates parameters."""

    def __init__(self, module: nn.Module, plan: ShardPlan, mesh: StateMesh, policy: ShardPolicy, config, device,
                 initial: InitialValues | None = None, frozen: dict[str, torch.Tensor] | None = None,
                 buffers: dict[str, torch.Tensor] | None = None, watchdog=None, quantization=None,
                 build_state: Callable[..., TrainState] | None = None):
        self.module, self.plan, self.policy, self.config = module, plan, policy, config
        # What `init_state` runs: the state layer's `init_state`, above this one, which `fnzero.shard`
        # hands over (`specs/architecture.md` §Layers): a parameter, so no import runs upward.
        self._build_state = build_state
        self.sharding = Sharding(plan, mesh, device, watchdog, quantization,
                                 config_optimizer(config, module))  # the optimizer with the model's facts it reads
        self._initial = initial  # handed over to the first TrainState (`init_state`)
        # Stage-3 prefetch order, learned from the last step (a performance cache, not state).
        self._schedule = GatherSchedule(policy.prefetch_numel, policy.max_live_numel, policy.max_reuse_distance)
        self._frozen: dict[str, torch.Tensor] = dict(frozen or {})
        self._frozen_unit_names = frozenset(u.name for u in plan.frozen_units)  # keys of shards in `_frozen`
        self._buffers: dict[str, torch.Tensor] = dict(buffers or {})
        self._units_hooked = False  # see `_hook_unit_compiles`
        self.pretrained_report = None  # set by `init_state(pretrained=...)`
        # The apply runs whose parameters are bound for a backward pass right now (`sharding/zero/_backward.py`).
        self._backward_runs: list[ApplyRun] = []

    # The mesh's axes, read from the state's sharding (its only source): `comm` the ranks ZeRO shards
    # over; `tp`, `pp`, `ep` the tensor-parallel layout, pipeline stage, expert-parallel layout, or None.
    @property
    def comm(self) -> Collectives:
        return self.sharding.mesh.data

    @property
    def tp(self):
        return self.sharding.mesh.tp

    @property
    def pp(self):
        return self.sharding.mesh.pp

    @property
    def ep(self):
        return self.sharding.mesh.ep

    @property
    def sp(self):
        """The sequence axis (`SPLayout`: give it to `fnzero.shard_sequence`), None without one."""
        return self.sharding.mesh.sp

    # ---------------------------------------------------------------------------------------------
    def apply(self, params: dict[str, torch.Tensor], *args: Any, **kwargs: Any) -> Any:
        """Run the model's forward with `params` (one flat buffer or shard per unit: a TrainState's
        `params`, or the aliases `train_step` hands the loss). Pure: nothing in `params` is modified.
        Floating-point arguments are cast to the compute dtype (as FSDP's `cast_forward_inputs`)."""
        return self._run(params, None, args, kwargs)

    def call(self, params: dict[str, torch.Tensor], fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """`fn(model, *args, **kwargs)` with `params` bound, as `apply` runs the forward (flax's
        `apply(..., method=)`): for a computation that is not the model's forward, such as its
        decoder and then its head a few tokens at a time (`causal_lm_loss`)."""
        return self._run(params, fn, args, kwargs)

    def causal_lm_loss(self, params: dict[str, torch.Tensor], batch: dict[str, Any], *, tiles: int | str = "auto",
                       ignore_index: int = -100) -> torch.Tensor:
        """A transformers causal LM's loss on `batch` (`input_ids`, `labels` or `shift_labels`, and the
        model's other inputs) with the logits computed `tiles` runs of tokens at a time, each
        recomputed in backward: never whole, as DeepSpeed's `TiledFusedLogitsLoss` (`"auto"`: the
        vocabulary over the hidden size, so a tile's logits are about the hidden states' size). The
        mean over the valid labels, exactly; with a sequence axis, this rank's share of its group's
        mean; the vocabulary-parallel cross-entropy for a split head (`specs/mesh.md` §Sequence)."""
        return self._run(params, tiled_causal_lm_loss, (), {
            **batch, "tiles": tiles, "layout": self.sp, "ignore_index": ignore_index,
            "cross_entropy": lambda logits, y: self.cross_entropy(logits, y, ignore_index=ignore_index,
                                                                   reduction="sum")})

    def _run(self, params: dict[str, torch.Tensor], fn, args: tuple, kwargs: dict) -> Any:
        plan = self.plan
        cd = self.policy.compute_dtype
        if cd is not None:
            args, kwargs = optree.tree_map(
                lambda x: x.to(cd) if isinstance(x, torch.Tensor) and x.is_floating_point() else x,
                (args, kwargs),
                none_is_leaf=True,
            )
        if not torch.compiler.is_compiling():
            plan.check_params(params, "the params given to apply")
        if not torch.compiler.is_compiling() and ambient().unit_compiler is not None:
            self._hook_unit_compiles()
        if torch.compiler.is_compiling() and not plan.any_sharded_params:
            # Under torch.compile (`fnzero.jit`) with no stage-3 units there is nothing to gather and
            # no saved tensor to re-gather: bind the views and let the whole forward be one graph.
            held = [(u, params[u.name]) for u in plan.units] + [(u, self._frozen[u.name]) for u in plan.frozen_units]
            return self._call(self._tensors(held), args, kwargs, fn)
        return self._apply_gathering(params, args, kwargs, fn)

    def _hook_unit_compiles(self) -> None:
        """Once, at the first `fnzero.jit(scope="units")` step: hook each unit module so that its forward
        runs compiled while such a step runs (`sharding/zero/_unit_hooks.py`)."""
        if self._units_hooked:
            return
        for module in dict.fromkeys(u.module for u in (*self.plan.units, *self.plan.frozen_units)):
            if module != "":
                compile_unit_calls(self.module.get_submodule(module), self._backward_runs)
        self._units_hooked = True

    def _tensors(self, fulls) -> dict[str, torch.Tensor]:
        """What the forward reads, by state_dict name: the views of each (unit, full[, runtime]) in
        `fulls`, the frozen parameters held whole and the buffers."""
        tensors: dict[str, torch.Tensor] = {}
        for u, full, *rt in fulls:
            tensors.update(unit_views(u, full, *rt))
        # Frozen tensors held whole, by name: every entry but the frozen units' shards (int8 inference
        # adds its scales here, `inference/_int8.py`), and the other names of tied ones.
        units = self._frozen_unit_names
        tensors.update({n: t for n, t in self._frozen.items() if n not in units})
        tensors.update({alias: self._frozen[n] for alias, n in self.plan.frozen_aliases if n in self._frozen})
        tensors.update(self._buffers)
        return tensors

    def _call(self, tensors: dict[str, torch.Tensor], args: tuple, kwargs: dict, fn=None) -> Any:
        module = self.module
        if fn is not None:  # functional_call binds a module's tensors around its forward: one that calls fn
            module, args = _Calling(module), (fn, *args)
            tensors = {f"model.{n}": t for n, t in tensors.items()}
        ac = self.policy.autocast_dtype
        if ac is None:
            return torch.func.functional_call(module, tensors, args, kwargs, tie_weights=False, strict=False)
        # `torch_autocast` (DeepSpeed's engine does the same around forward): the parameters stay
        # in their dtype, autocast-eligible ops compute in the autocast dtype.
        device_type = self.sharding.device.type
        with torch.autocast(device_type, dtype=None if ac == "default" else ac):
            return torch.func.functional_call(module, tensors, args, kwargs, tie_weights=False, strict=False)

    def _apply_gathering(self, params: dict[str, torch.Tensor], args: tuple, kwargs: dict, fn=None) -> Any:
        run, tensors, stack = self._begin_run(params)
        try:
            out = self._call(tensors, args, kwargs, fn)
        finally:
            self._end_run(run, stack)
        run.bind_in_backward(self.module, tensors, out)
        run.finish_forward(out)
        return out

    @torch.compiler.disable
    def _begin_run(self, params: dict[str, torch.Tensor]) -> tuple[ApplyRun, dict[str, torch.Tensor], Any]:
        """Gather what the root needs, make the run current, enter its saved-tensor hooks."""
        plan = self.plan
        run = self._new_run(params)
        # Units kept gathered (persistent, or stages 0-2) as they are held; the root's sharded
        # parts gathered for the whole forward; the other sharded units when their forward runs.
        fulls = [(u, params[u.name], None) for u in plan.units if not plan.params_sharded(u)]
        fulls += [(u, self._frozen[u.name], None) for u in plan.frozen_units if not plan.params_sharded(u)]
        root = run.gather_parts(ROOT_UNIT)
        fulls += root
        live = [(full, rt) for _, full, rt in root]
        tensors = self._tensors(fulls)
        stack = contextlib.ExitStack()
        run.bindings.append(("tensors", self.module, tensors))
        try:
            stack.enter_context(within(run=run))
            stack.enter_context(run.saved_tensor_hooks())
            for full, rt in live:
                stack.enter_context(run.live(full, rt))
        except BaseException:
            stack.close()
            raise
        return run, tensors, stack

    def _new_run(self, params: dict[str, torch.Tensor]) -> ApplyRun:
        return ApplyRun(self.plan, self.comm, params, self._schedule if self.policy.prefetch_numel > 0 else None,
                        sources=sources_of(self.sharding), backward_runs=self._backward_runs, frozen=self._frozen,
                        expert_comm=self.sharding.expert_comm, quantization=self.sharding.quantization,
                        mesh=self.sharding.mesh)  # its MiCS replicas and hpZ group

    @torch.compiler.disable
    def _end_run(self, run: ApplyRun, stack: Any) -> None:
        with stack:  # closed whatever happens
            run.exit_units()  # none, unless the forward was interrupted past the units' hooks

    __call__ = apply
    # Eager under torch.compile (it sets up gathering and saved-tensor hooks); the module's
    # forward it calls is still compiled (`specs/jit.md`).
    _apply_gathering = torch.compiler.disable(
        _apply_gathering, recursive=False,
        reason="fnzero ZeRO-3: apply gathers the root unit and installs the saved-tensor re-gather hooks (eager)",
    )

    # ---------------------------------------------------------------------------------------------
    def init_state(self, pretrained: str | os.PathLike | None = None, *, allow_unexpected: bool = False,
                   optimizer=None, check_ranks_equal: bool = True,
                   adapters: str | os.PathLike | None = None) -> TrainState:
        """This rank's initial TrainState, built from the model's parameters at `shard` time; the
        initial buffers are handed over, not copied, so call `fnzero.shard` again for a second one.

        `pretrained`: a safetensors file or a `save_pretrained`/`fnzero export` directory whose
        tensors replace the initial values, every name and shape checked first (a tensor the model
        lacks is an error unless `allow_unexpected`; `specs/checkpoint-format.md` §Pretrained);
        `sm.pretrained_report` says what was loaded. `adapters`: a PEFT adapter directory read over
        the adapters' initial values (`specs/peft.md` §Resume). `optimizer`: an `Optimizer` or chain
        instead of the config's (give the same one to `fnzero.train_step`). `check_ranks_equal`:
        refuse ranks whose initial weights differ (False for a template state a load replaces next;
        `specs/sharding.md` §Step).
        """
        if self._build_state is None:
            raise ShardingError(
                "this module was laid out by fnzero.sharding.shard, which builds no state; shard it with "
                "fnzero.shard (or fnzero.state.shard), whose modules build their TrainState with init_state()"
            )
        return self._build_state(self, pretrained, allow_unexpected=allow_unexpected, optimizer=optimizer,
                                 check_ranks_equal=check_ranks_equal, adapters=adapters)

    def initial_values(self) -> InitialValues:
        """What the first TrainState is built from, until `hand_over_initial` gives it away."""
        if self._initial is None:
            raise ShardingError(
                "init_state() hands the model's initial parameters over to the state and can be called once; "
                "shard the model again for another initial state (or copy a state with fnzero.tree_clone)"
            )
        return self._initial

    def hand_over_initial(self) -> InitialValues:
        """The initial values, given away: the ShardedModule keeps no reference to them."""
        initial, self._initial = self.initial_values(), None
        return initial

    def drop_initial(self) -> None:
        """Forget the initial values (a failed pretrained load left them partly overwritten)."""
        self._initial = None

    def replace_constants(self, frozen: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor]) -> None:
        """New values for the frozen parameters and buffers `apply` binds (pretrained weights)."""
        self._frozen, self._buffers = dict(frozen), dict(buffers)

    def read_shards_from(self, *, params: ShardSource | None = None, frozen: ShardSource | None = None) -> None:
        """`offload_param: nvme`: the placeholder shards of trainable (`params`) and frozen units are
        read from these sources (`sharding/zero/_param_store.py`); a source not given is kept. Set
        while the first state is made: every state of this model shares the sharding carrying them."""
        old = sources_of(self.sharding)
        self.sharding.shard_sources = ShardSources(params=params or old.params, frozen=frozen or old.frozen)

    @property
    def constants(self) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """Copies of the (frozen parameters, buffers) dicts `apply` binds: the state's own."""
        return dict(self._frozen), dict(self._buffers)

    # ---------------------------------------------------------------------------------------------
    def gather(self, params: dict[str, torch.Tensor] | TrainState, *, dtype: torch.dtype | None = None,
               rank0_only: bool = False, names: Collection[str] | None = None) -> dict[str, torch.Tensor]:
        """Consolidated trainable parameters by `model.state_dict()` name (tied names included), on
        every rank (`rank0_only`: the others get an empty dict); a TrainState's master weights when
        it has them. `names`: only these, gathering only the units holding them (same on every rank)."""
        if isinstance(params, TrainState):
            src = params.master if params.master is not None else params.params
        else:
            src = params
        out = {}
        for u in self.plan.units:
            if names is not None and not u.is_expert and not any(n in names for s in u.slots for n in (s.name, *s.aliases)):
                continue
            unit_comm = comm_for(u, self.comm, self.sharding.expert_comm)
            full = full_unit(u, held(src[u.name], sources_of(self.sharding).params, u.name), unit_comm)
            if full.numel() != u.padded_numel:
                full = unit_comm.all_gather(full)
            views = self.ep.unit_from_every_rank(u, full) if u.is_expert else unit_views(u, full)
            if rank0_only and (self.comm.rank != 0 or (self.sharding.replicas is not None and self.sharding.replicas.rank)):
                continue  # (MiCS: the first shard group's rank 0 is the job's)
            for name, t in views.items():
                if names is not None and name not in names:
                    continue
                if self.tp is not None:
                    t = self.tp.gather_full(name, t)  # collective over the tensor-parallel ranks
                out[name] = t.to(dtype) if dtype is not None else t.clone()
        return out

    def cross_entropy(self, logits: torch.Tensor, target: torch.Tensor, *, ignore_index: int = -100,
                      reduction: str = "mean") -> torch.Tensor:  # fmt: skip
        """`torch.nn.functional.cross_entropy` of the logits (vocabulary last): the vocabulary-parallel
        one, which never gathers the logits, when tensor parallelism split the LM head."""
        if self.tp is not None and self.tp.vocab_head is not None:
            return vocab_parallel_cross_entropy(logits, target, self.tp.vocab_start(), self.tp.comm, ignore_index,
                                                reduction)  # fmt: skip
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1),
                                                 ignore_index=ignore_index, reduction=reduction)  # fmt: skip
        return loss.view(target.shape) if reduction == "none" else loss

    def state_dict(self, state: TrainState, *, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        """Like `model.state_dict()`: trainable, frozen parameters and buffers, consolidated."""
        out = self.gather(state, dtype=dtype)
        out.update(self._whole_frozen(state.frozen, dtype))
        whole = {n: state.frozen[n] for n in self.plan.frozen}
        whole.update({alias: state.frozen[n] for alias, n in self.plan.frozen_aliases})
        if self.ep is not None:
            out.update(self.ep.whole_from_every_rank(whole))
        for name, t in {**whole, **state.buffers}.items():
            if self.tp is not None and name in state.frozen:
                t = self.tp.gather_full(name, t)  # a frozen split parameter: collective over the tp ranks
            out[name] = t.to(dtype) if (dtype is not None and t.is_floating_point()) else t.clone()
        return out

    def _whole_frozen(self, frozen: dict[str, torch.Tensor], dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
        """The frozen units' parameters, whole, by state_dict name (tied names included)."""
        out, source = {}, sources_of(self.sharding).frozen
        for u in self.plan.frozen_units:
            full = full_unit(u, held(frozen[u.name], source, u.name), comm_for(u, self.comm, self.sharding.expert_comm))
            views = self.ep.unit_from_every_rank(u, full) if u.is_expert else unit_views(u, full)
            for name, t in views.items():
                out[name] = t.to(dtype) if dtype is not None else t.clone()
        return out

    def load_into(self, model: nn.Module, state: TrainState, *, strict: bool = True) -> nn.Module:
        """Write `state`'s consolidated weights (the master where it has one), frozen parameters and
        persistent buffers into `model`, a fresh module of the same architecture, in its dtypes.
        Collective. `strict`: keys missing on either side are one `ShardingError`, `model` untouched.
        Returns `model`."""
        if is_released(model):
            raise ShardingError(
                "load_into: this model was given to fnzero.shard, so its parameters are placeholders; "
                "build a fresh one of the same architecture (e.g. MyModel(config)) and load into that"
            )
        full = self.state_dict(state)
        target = model.state_dict()
        missing = [k for k in target if k not in full]
        transient = non_persistent_buffers(model)
        unexpected = [k for k in full if k not in target and k not in transient]
        shapes = [f"{k}: {tuple(full[k].shape)} vs {tuple(target[k].shape)}" for k in target
                  if k in full and full[k].shape != target[k].shape]
        if shapes:
            raise ShardingError(f"load_into: shapes differ between the state and the model: {'; '.join(shapes[:3])}")
        if strict and (missing or unexpected):
            raise ShardingError(
                f"load_into: the model and the state differ: model keys not in the state {missing[:5]}"
                f"{' ...' if len(missing) > 5 else ''}, state keys not in the model {unexpected[:5]}"
                f"{' ...' if len(unexpected) > 5 else ''} (another architecture? strict=False loads the common keys)"
            )
        model.load_state_dict({k: full[k] for k in target if k in full}, strict=False)
        return model


class _Calling(nn.Module):
    """`fn(model, ...)` as a forward, so that `torch.func.functional_call` binds the model's tensors
    (named `model.<name>` here) around any function, not only the model's own forward."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, fn, *args, **kwargs):
        return fn(self.model, *args, **kwargs)
