"""Running a sharded module: turning per-unit flat buffers into the parameters a forward sees.

[Note: stage 3 as a differentiable gather]
`GatherUnit` all-gathers a unit's shard in forward and reduce-scatters its gradient in backward; saved
views of the gathered buffer are re-gathered for backward (`specs/sharding.md` §Apply, "Saved tensors")."""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import nn

from ..._errors import ShardingError
from ._ambient import ambient
from ._backward import BackwardBinding, UnitBinder, swap_tensors
from ._frozen import release_after_backward
from ._gather import GatherSchedule, GatherUnit, Regather, UnitRuntime, unit_views
from ..comm import quantizing
from ._param_store import NO_SOURCES, ShardSources
from ._plan import ShardPlan, UnitPlan, comm_for
from ._residency import prefetch_held, start_planned

__all__ = ["ApplyRun", "GatherSchedule", "unit_views", "swap_tensors"]


class ApplyRun:
    """One call of `ShardedModule.apply`: which buffers are gathered right now, and the hooks that
    keep gathered parameters out of autograd's saved tensors."""

    def __init__(self, plan: ShardPlan, comm, params: dict[str, torch.Tensor], schedule: "GatherSchedule | None" = None,
                 sources: ShardSources = NO_SOURCES, backward_runs: "list[ApplyRun] | None" = None,
                 frozen: dict[str, torch.Tensor] | None = None, expert_comm=None, quantization=None, mesh=None):
        self.plan = plan
        self.comm = comm
        self.quantization = quantization  # `CommQuantization` or None: the codecs of what units' collectives carry
        self.expert_comm = expert_comm  # expert units' gathers (`comm_for`)
        self.hpz = mesh.hpz if mesh is not None else None  # hpZ: backward re-gathers over it (`UnitRuntime`)
        self.num_replicas = mesh.num_replicas if mesh is not None else 1  # MiCS: copies of each shard
        self.params = params
        self.frozen = frozen if frozen is not None else {}  # frozen unit name -> shard (the module's constants)
        self.schedule = schedule
        self.sources = sources  # where placeholder shards are read from (`offload_param: nvme`, `_param_store.py`)
        self._live: dict[int, UnitRuntime] = {}
        self.rts: dict[str, UnitRuntime] = {}
        self.frts: dict[str, UnitRuntime] = {}  # the frozen units' runtimes (same names as `rts`)
        self.order: list[str] = []  # stage-3 units (by name) in the order this forward gathered them
        self._bwd_prev: dict[str, str] | None = None
        self.deferred_regather: str | None = None  # see `finish_forward`
        # Units whose saved views are kept rather than re-gathered in backward (`specs/sharding.md`
        # §Apply, "Kept for backward"); a performance cache: a wrong guess costs a gather or a buffer.
        self.keep: frozenset[str] = schedule.kept_units(self._numel) if schedule is not None else frozenset()
        # Parameter bindings in force right now, outermost first: ("tensors", module, {name: t})
        # for the root, ("unit", name, module) for a gathered stage-3 unit. `fnzero.remat`
        # snapshots them so recomputation in backward sees the same parameters.
        self.bindings: list[tuple] = []
        self._units_entered: list[contextlib.ExitStack] = []  # what `exit_unit` undoes, innermost last
        # Bound again while backward runs (`bind_in_backward`); `backward_runs`: the runs bound right
        # now, shared with the stage-3 units' hooks, which find their run there in a recomputation.
        self.backward: BackwardBinding | None = None
        self.backward_runs = backward_runs if backward_runs is not None else []
        # For recomputations on a thread where the ambient context is unset (`_unit_hooks.unit_compiler`).
        context = ambient()
        self.unit_compiler = context.unit_compiler
        # Units held gathered across the forwards of a decode (`_residency.py`): no-grad runs only.
        self.held = context.held if not torch.is_grad_enabled() else None
        if self.held is not None:
            start_planned(self)
        if context.step_runs is not None:
            context.step_runs.append(self)

    def release(self) -> None:
        """Drop every reference this run holds, once its backward has run: a run and its units'
        runtimes form a cycle, which would keep the parameters it was given alive until the cycle
        collector runs (27.4M GPT, stage 3, 2 ranks: 631 MiB peak above baseline against 461)."""
        if self.backward is not None:
            self.backward.release()
            self.backward = None
        for rt in (*self.rts.values(), *self.frts.values()):
            rt.run = rt.pending = rt.bwd_pending = rt.bwd_full = rt.shard = rt.binder = rt.secondary = None
        self.rts.clear()
        self.frts.clear()
        self._live.clear()
        self.bindings.clear()
        self.params, self.frozen = {}, {}

    def drop_regathered(self) -> None:
        """Free the frozen units' copies re-gathered for backward (the backward pass is over; a
        unit whose inputs needed no gradient had nothing else to free it: `_frozen.py`)."""
        for rt in self.frts.values():
            rt.bwd_full = None

    # -- the parts of a unit: its trainable and its frozen buffer ---------------------------------
    def _runtime(self, unit: UnitPlan, frozen: bool = False) -> UnitRuntime:
        table, held = (self.frts, self.frozen) if frozen else (self.rts, self.params)
        rt = table.get(unit.name)
        if rt is None:
            comm, hpz = self._unit_comms(unit, frozen)
            rt = table[unit.name] = UnitRuntime(unit, held[unit.name], comm, self, self.sources.of(frozen), hpz, frozen)
        return rt

    def _unit_comms(self, unit: UnitPlan, frozen: bool):
        """The unit's collectives (`comm_for`) and hpZ's group for backward's re-gathers (or None),
        quantized where `quantization` says (`specs/collectives.md` §Quantized collectives)."""
        comm, q = comm_for(unit, self.comm, self.expert_comm), self.quantization
        if q is None:
            return comm, self.hpz
        weights = q.frozen_weights if frozen else q.weights
        return quantizing(comm, weights, None if frozen else q.gradients), quantizing(self.hpz, weights, None)

    def sharded_parts(self, name: str) -> list[tuple[UnitPlan, bool]]:
        """(unit, is frozen) for each part of unit `name` held as a shard and gathered in forward."""
        parts = [(self.plan.trainable_unit(name), False), (self.plan.frozen_unit(name), True)]
        return [(u, f) for u, f in parts if u is not None and self.plan.params_sharded(u)]

    def _numel(self, name: str) -> int:
        return sum(u.padded_numel for u in (self.plan.trainable_unit(name), self.plan.frozen_unit(name)) if u)

    def _packed(self, name: str) -> bool:
        """Whether autograd saved views of some part of unit `name` (re-gathered in backward)."""
        return any(rt.packed for rt in (self.rts.get(name), self.frts.get(name)) if rt is not None)

    # -- prefetch ---------------------------------------------------------------------------------
    def prefetch_forward(self, name: str) -> None:
        """Start gathering the unit that followed `name` in the last forward (both its parts); under
        a holder, the next one not held, into the next forward past the last unit."""
        if self.schedule is None:
            return
        if self.held is not None:
            prefetch_held(self, name)
            return
        nxt = self.schedule.next_unit(name)
        if nxt is None or nxt in self.rts or nxt in self.frts:
            return
        n = self._numel(nxt)
        if n > self.schedule.prefetch_numel or self._numel(name) + n > self.schedule.max_live_numel:
            return
        for unit, frozen in self.sharded_parts(nxt):
            rt = self._runtime(unit, frozen)
            rt.pending = rt.start_gather()

    def prefetch_backward(self, name: str) -> None:
        """Start re-gathering the unit whose backward comes next: the one before `name` among the
        units this forward gathered and autograd kept views of (known once forward is done)."""
        if self.schedule is None:
            return
        self._start_regather(name)  # the other part of this unit, if autograd saved views of it
        if self._bwd_prev is None:
            packed = [n for n in self.order if self._packed(n)]
            self._bwd_prev = {b: a for a, b in zip(packed, packed[1:])}
        self._start_regather(self._bwd_prev.get(name))

    def _start_regather(self, name: str | None) -> None:
        for rt in (self.rts.get(name), self.frts.get(name)) if name is not None else ():
            if rt is None or not rt.packed or rt.bwd_full is not None or rt.bwd_pending is not None:
                continue
            rt.bwd_pending = rt.start_backward_gather()

    @torch.compiler.disable
    def bind_in_backward(self, module: nn.Module, root_tensors: dict[str, torch.Tensor], out: Any) -> None:
        """Bind this run's parameters again once backward reaches `out` (the apply's result), until
        that backward ends: recomputation inside the model reads them (`_backward.py`)."""
        outputs = _grad_outputs(out)
        if not outputs:
            return
        binders = []
        for name in dict.fromkeys(u.name for u in (*self.plan.units, *self.plan.frozen_units) if u.module != ""):
            parts = self.sharded_parts(name)
            if not parts:
                continue
            binder = UnitBinder([u for u, _ in parts], module, lambda parts=parts: self._bind_for_backward(parts))
            for u, frozen in parts:
                self._runtime(u, frozen).binder = binder
            binders.append(binder)
        self.backward = BackwardBinding(module, root_tensors, binders, self, self.backward_runs)
        for t in outputs:
            t.register_hook(self.backward.enter_until_backward_ends)

    def _gather_for_backward(self, unit: UnitPlan) -> torch.Tensor:
        with torch.enable_grad():
            return GatherUnit.apply(self.params[unit.name], self._runtime(unit), True)

    def _bind_for_backward(self, parts) -> tuple[dict[bool, torch.Tensor], dict[str, torch.Tensor]]:
        """Each part's buffer gathered for backward (is frozen -> buffer) and their views."""
        fulls, views = {}, {}
        for unit, frozen in parts:
            rt = self._runtime(unit, frozen)
            full = fulls[frozen] = rt.regather() if frozen else self._gather_for_backward(unit)
            views.update(unit_views(unit, full, rt))
        return fulls, views

    @property
    def _in_backward(self) -> bool:
        """Whether this run is bound for a backward pass right now (a recomputation is calling it)."""
        return self.backward is not None and self.backward.active

    def _full_in_backward(self, rt: UnitRuntime, frozen: bool) -> torch.Tensor:
        """A recomputation in backward calls the unit again: the buffer bound for backward serves."""
        if rt.binder is None:
            return rt.regather() if frozen else self._gather_for_backward(rt.unit)
        if not rt.binder.bound:
            rt.binder.bind()
        return rt.binder.fulls[frozen]

    @torch.compiler.disable
    def finish_forward(self, out: Any) -> None:
        if self.held is not None and self.held.plans_all:
            # No order recorded: under a holder of every unit some ranks run no forward (`fnzero.generate`),
            # and a recorded order decides later gathers (prefetch, units kept): every rank keeps its own alike.
            return
        if self.schedule is not None and self.order:
            self.schedule.record_forward(self.order)
            # The first re-gather starts with the output's gradient, not during the loss (the
            # forward's peak): `specs/sharding.md` §Apply, "The forward→backward turn".
            if self.order[-1] in self.keep and not self._packed(self.order[-1]):
                packed = [n for n in self.order if self._packed(n)]
                if not packed:
                    return
                outputs = _grad_outputs(out)
                if not outputs:  # no tensor to hook: start it now, as before the turn was deferred
                    self._start_regather(packed[-1])
                    return
                self.deferred_regather = packed[-1]
                for t in outputs:
                    t.register_hook(self._start_deferred_regather)

    @torch.compiler.disable
    def _start_deferred_regather(self, grad: torch.Tensor) -> None:
        name, self.deferred_regather = self.deferred_regather, None
        self._start_regather(name)

    # -- saved-tensor hooks ---------------------------------------------------------------------
    # Under torch.compile autograd calls these for every tensor a compiled graph saves; dynamo
    # must not try to trace them (a graph break per saved tensor), hence `disable`.
    @torch.compiler.disable
    def _pack(self, t: torch.Tensor) -> Any:
        if not self._live:
            return t
        try:
            ptr = t.untyped_storage().data_ptr()
        except (RuntimeError, NotImplementedError):  # tensor subclasses without storage
            return t
        rt = self._live.get(ptr)
        if rt is None or rt.unit.name in self.keep:
            return t
        rt.packed = True
        return Regather(rt, t.storage_offset(), tuple(t.shape), tuple(t.stride()))

    @staticmethod
    @torch.compiler.disable
    def _unpack(x: Any) -> torch.Tensor:
        if isinstance(x, Regather):
            return x.rt.regather().as_strided(x.size, x.stride, x.offset)
        return x

    def saved_tensor_hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    # -- gathering --------------------------------------------------------------------------------
    @contextlib.contextmanager
    def rebind(self, bindings: list[tuple]):
        """Re-establish `bindings` (a snapshot taken in forward) for a recomputation."""
        with contextlib.ExitStack() as stack:
            for kind, a, b in bindings:
                if kind == "tensors":
                    stack.enter_context(swap_tensors(a, b))
                else:
                    stack.enter_context(swap_tensors(b, self._local_views(a, prefetch=False)))
            yield

    def gather_unit(self, unit: UnitPlan, prefetch: bool = True) -> tuple[torch.Tensor, UnitRuntime | None]:
        """The unit's full flat buffer, differentiable with respect to `self.params[unit.name]`."""
        p = self.params[unit.name]
        if not self.plan.params_sharded(unit):
            return p, None
        if p.numel() != unit.shard_numel:
            raise ShardingError(
                f"unit {unit.name!r}: expected a shard of {unit.shard_numel} elements at stage 3, got "
                f"{p.numel()}; was this state made by another plan or world size?"
            )
        rt = self._runtime(unit)
        if self._in_backward:
            return self._full_in_backward(rt, False), rt
        if prefetch:
            self.order.append(unit.name)
        full = GatherUnit.apply(p, rt)
        if prefetch:
            self.prefetch_forward(unit.name)
        return full, rt

    def gather_frozen(self, unit: UnitPlan) -> tuple[torch.Tensor, UnitRuntime | None]:
        """A frozen unit's full flat buffer (no gradient flows to it), gathered where it is sharded."""
        p = self.frozen[unit.name]
        if not self.plan.params_sharded(unit):
            return p, None
        rt = self._runtime(unit, frozen=True)
        return (self._full_in_backward(rt, True) if self._in_backward else rt.gather()), rt

    def gather_parts(self, name: str, prefetch: bool = True) -> list[tuple[UnitPlan, torch.Tensor, UnitRuntime]]:
        """Unit `name`'s sharded parts gathered: (unit, full buffer, runtime) each. With `prefetch`
        (a forward), the unit is recorded in this forward's order and the next one prefetched."""
        out = []
        for unit, frozen in self.sharded_parts(name):
            if frozen:
                out.append((unit, *self.gather_frozen(unit)))
            else:
                out.append((unit, *self.gather_unit(unit, prefetch=False)))
        if prefetch and not self._in_backward:
            self.order.append(name)
            self.prefetch_forward(name)
        return out

    def _local_views(self, name: str, prefetch: bool = True, stack: contextlib.ExitStack | None = None):
        """Unit `name`'s gathered parameters by names relative to its module (marked live on `stack`)."""
        local = {}
        for unit, full, rt in self.gather_parts(name, prefetch):
            if stack is not None:
                stack.enter_context(self.live(full, rt))
            prefix = unit.module + "."
            local.update({n[len(prefix):]: t for n, t in unit_views(unit, full, rt).items()})
        return local

    @contextlib.contextmanager
    def live(self, full: torch.Tensor, rt: UnitRuntime | None):
        """Mark `full` as a gathered buffer for the duration of a forward region."""
        if rt is None:
            yield
            return
        ptr = full.untyped_storage().data_ptr()
        self._live[ptr] = rt
        try:
            yield
        finally:
            self._live.pop(ptr, None)

    # -- a unit's forward: `_unit_hooks.py` calls these from the unit module's forward hooks ------
    # Gathering and binding stay eager under torch.compile (`specs/jit.md`): dynamo skips these
    # frames whole, and compiles the unit's own `forward`, which runs between them.
    @torch.compiler.disable
    def enter_unit(self, name: str, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """Gather unit `name` and bind its views into `module` until `exit_unit`; the forward's
        (args, kwargs): a frozen part's tensor inputs pass through its release (`_frozen.py`)."""
        stack = contextlib.ExitStack()
        self.bindings.append(("unit", name, module))
        try:
            local = self._local_views(name, stack=stack)
            stack.enter_context(swap_tensors(module, local))
            frt = self.frts.get(name)
            if frt is not None and frt.unit.name not in self.keep:
                args, kwargs = release_after_backward(args, kwargs, frt.release_after_backward)
        except BaseException:
            stack.close()
            self.bindings.pop()
            raise
        self._units_entered.append(stack)
        return args, kwargs

    @torch.compiler.disable
    def exit_unit(self) -> None:
        """The unit entered last is done: its placeholders back, its buffer released."""
        stack = self._units_entered.pop()
        try:
            stack.close()
        finally:
            self.bindings.pop()

    def exit_units(self) -> None:
        """Exit every unit still entered (a forward interrupted past its hooks' reach), last first."""
        while self._units_entered:
            self.exit_unit()


def _grad_outputs(out: Any) -> list[torch.Tensor]:
    """The tensors of `out` that require grad (torch's pytree also opens HF's ModelOutput)."""
    return [t for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad]
