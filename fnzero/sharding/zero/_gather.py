"""A unit's parameters gathered for one forward and backward: the differentiable gather
(`GatherUnit`), the per-unit runtime that re-gathers for backward (`UnitRuntime`), the views
of a flat buffer as parameters (`unit_views`) and the prefetch order (`GatherSchedule`). The
apply run that drives them is `_runtime.py` (its note explains the scheme)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch

from ._param_store import ShardSource, held
from ._plan import UnitPlan

if TYPE_CHECKING:  # annotations only: the binder holds these runtimes, not the reverse
    from ._backward import UnitBinder
    from ._residency import HeldUnits

__all__ = ["GatherSchedule", "GatherUnit", "Regather", "RunOfUnits", "UnitRuntime", "unit_views"]


class RunOfUnits(Protocol):
    """What a unit's runtime reads of the apply run it belongs to (`_runtime.ApplyRun`, which
    imports this module: the runtime knows its run only through these)."""

    keep: frozenset[str]  # units kept gathered from forward to backward (not re-gathered)
    deferred_regather: str | None  # the unit whose re-gather waits for the output's gradient
    num_replicas: int  # MiCS: copies of each shard
    held: "HeldUnits | None"  # gathered buffers kept across no-grad forwards (`_residency.py`)

    def prefetch_backward(self, name: str) -> None: ...


def unit_views(unit: UnitPlan, full: torch.Tensor, rt: "UnitRuntime | None" = None) -> dict[str, torch.Tensor]:
    """Parameter views (state_dict names, aliases included) into a unit's full flat buffer. With `rt`
    (stage 3, in a forward) the re-gathered copy is dropped once autograd assembles the unit's flat
    gradient (`specs/sharding.md` §Apply, saved tensors)."""
    pieces = torch.split(full, unit.split_sizes)
    if rt is not None and pieces and pieces[0].grad_fn is not None:
        pieces[0].grad_fn.register_prehook(rt.release_regathered)
    out = {}
    for slot, piece in zip(unit.slots, pieces):
        t = piece.view(slot.shape)
        out[slot.name] = t
        for alias in slot.aliases:
            out[alias] = t
    return out


class UnitRuntime:
    """Per-apply, per-unit bookkeeping for stage 3: the shard, a prefetched gather, and the buffer
    re-gathered for backward; with hpZ (`hpz`, `specs/mesh.md §hpZ`) from the secondary shard the
    forward's gather kept."""

    __slots__ = ("unit", "key", "shard", "comm", "run", "pending", "bwd_full", "bwd_pending", "packed", "source",
                 "binder", "hpz", "secondary")

    def __init__(self, unit: UnitPlan, shard: torch.Tensor, comm, run: RunOfUnits, source: ShardSource | None = None,
                 hpz=None, frozen: bool = False):
        self.unit = unit
        self.key = (unit.name, frozen)  # names the unit's part in `run.held`
        self.shard = shard
        self.comm = comm
        self.run = run
        self.source = source  # `offload_param: nvme`: where a placeholder shard's values are read from
        self.pending = None  # forward prefetch in flight
        self.bwd_full = None
        self.bwd_pending = None  # backward prefetch in flight
        self.packed = False  # autograd saved a view of this unit's parameters
        self.binder: UnitBinder | None = None  # binds the unit for recomputation in backward (`_backward.py`)
        self.hpz = hpz  # hpZ's group, or None
        self.secondary: torch.Tensor | None = None  # this rank's hpZ part of the buffer, from the forward's gather

    def shard_values(self) -> torch.Tensor:
        """What this rank contributes to a gather: the shard, or its values read from NVMe."""
        return held(self.shard, self.source, self.unit.name)

    def start_gather(self):
        """This unit's forward gather, started (waited by `gather`, in this forward or the next)."""
        return self.comm.all_gather_async(self.shard_values(), label=self.unit.name)

    def gather(self) -> torch.Tensor:
        held = self.run.held
        if held is not None:  # a no-grad forward under a holder: no backward comes, nothing re-gathers
            full = held.get(self.key, self.shard)
            if full is None:
                pending = self.pending if self.pending is not None else held.take_pending(self.key, self.shard)
                self.pending = None
                full = (pending if pending is not None else self.start_gather()).wait()
                held.offer(self.key, full, self.shard)
            return full
        if self.pending is not None:
            full, self.pending = self.pending.wait(), None
        else:
            full = self.start_gather().wait()
        if self.hpz is not None and self.unit.name not in self.run.keep:  # a kept unit is not re-gathered
            per = self.unit.padded_numel // self.hpz.world_size
            self.secondary = full[self.hpz.rank * per:(self.hpz.rank + 1) * per].clone()
        return full

    def start_backward_gather(self):
        """The re-gather for backward, started: from the hpZ secondary shards if kept, else the shards."""
        if self.secondary is not None:
            return self.hpz.all_gather_async(self.secondary, label=self.unit.name)
        return self.start_gather()

    def release_regathered(self, grad_outputs):
        self.bwd_full = None

    def release_after_backward(self) -> None:
        """A frozen unit's backward is done (`_frozen.py`): free its re-gathered copy, unbind it."""
        self.bwd_full = None
        if self.binder is not None:
            self.binder.unbind()

    def regather(self) -> torch.Tensor:
        if self.run.deferred_regather == self.unit.name:
            self.run.deferred_regather = None  # backward got here before any hooked output's gradient
        if self.bwd_full is None:
            if self.bwd_pending is not None:
                self.bwd_full, self.bwd_pending = self.bwd_pending.wait(), None
            else:
                self.bwd_full = self.start_backward_gather().wait()
            self.run.prefetch_backward(self.unit.name)
        return self.bwd_full


class GatherSchedule:
    """The order stage-3 units were gathered in the last forward, to prefetch the next unit. A cache
    only: a wrong guess costs one extra gather, and every rank learns the same order."""

    def __init__(self, prefetch_numel: int = 10**18, max_live_numel: int = 10**18, max_reuse_distance: int = 0):
        self.forward_order: list[str] = []
        self._next: dict[str, str] = {}
        self.prefetch_numel = prefetch_numel  # stage3_prefetch_bucket_size: largest unit fetched ahead
        self.max_live_numel = max_live_numel  # stage3_max_live_parameters: current + prefetched at most
        self.max_reuse_distance = max_reuse_distance  # stage3_max_reuse_distance: see `kept_units`

    def record_forward(self, order: list[str]) -> None:
        if order != self.forward_order:
            self.forward_order = list(order)
            self._next = {a: b for a, b in zip(order, order[1:])}

    def next_unit(self, name: str) -> str | None:
        return self._next.get(name)

    def kept_units(self, numel_of) -> frozenset[str]:
        """The units kept gathered from forward to backward (`specs/sharding.md` §Apply, kept for
        backward). `numel_of(name)`: a unit's elements."""
        kept: set[str] = set()
        live = after = 0
        for name in reversed(dict.fromkeys(self.forward_order)):  # each unit once, at its first use
            n = numel_of(name)
            if kept and (2 * after > self.max_reuse_distance or live + n > self.max_live_numel):
                break
            kept.add(name)
            live += n
            after += n
        return frozenset(kept)


class GatherUnit(torch.autograd.Function):
    @staticmethod
    def forward(ctx, shard: torch.Tensor, rt: UnitRuntime, for_backward: bool = False) -> torch.Tensor:
        ctx.rt = rt
        # In backward (a recomputation) the copy re-gathered for backward serves, cached; a new
        # tensor object over it, since autograd sets this output's history.
        return rt.regather().detach() if for_backward else rt.gather()

    @staticmethod
    def backward(ctx, grad_full: torch.Tensor):
        rt = ctx.rt
        rt.bwd_full = None  # every user of the unit's parameters has run: free the re-gathered copy
        if rt.binder is not None:
            rt.binder.unbind()
        # An expert unit's gradient holds its ep group's tokens too; MiCS's shard group is one of its replicas.
        dp_world = rt.comm.world_size * rt.unit.ep * rt.run.num_replicas
        if grad_full.dtype in (torch.float16, torch.bfloat16) and dp_world > 1:
            # A 16-bit sum over ranks can overflow where each addend does not: divide first
            # (`specs/sharding.md` §Step; the step leaves this factor out of its own division).
            grad_full = grad_full / dp_world
        # Autograd made `grad_full` for this node alone (the concatenation of the parameter
        # gradients), so the exchange may receive into it.
        return rt.comm.reduce_scatter(grad_full, donate=True), None, None


class Regather:
    __slots__ = ("rt", "offset", "size", "stride")

    def __init__(self, rt, offset, size, stride):
        self.rt, self.offset, self.size, self.stride = rt, offset, size, stride
