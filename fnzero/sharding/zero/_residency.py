"""Gathered units held from one forward to the next: what generation decodes from
(`specs/generation.md` §Residency).

[Note: why hold]
Decoding runs the same forward once per token over parameters that do not change, so a stage-3 unit
gathered for token t is the unit token t+1 needs. Without a holder every token moves (N-1)/N of the
model to every rank (300 MB per token on 2 ranks for a 150M model); with one, the units that fit the
budget move once per `generate` call and only the others stream. The budget keeps DeepSpeed's meaning
of `stage3_max_live_parameters`: elements gathered at once, here held plus the one streamed unit
being computed (and its prefetch, when that fits too)."""

from __future__ import annotations

from typing import Hashable, Sequence

import torch

from ..._errors import ShardingError
from ._param_store import is_placeholder
from ._plan import ROOT_UNIT

__all__ = ["HeldUnits", "next_to_prefetch", "plan_residency", "prefetch_held", "residency_sizes", "start_planned"]


def plan_residency(sizes: Sequence[tuple[Hashable, int]], budget: int) -> frozenset:
    """Which units to hold, from `sizes` ((key, elements), in the order of `residency_sizes`) and
    `budget` elements.

    Every unit when they all fit. Otherwise units in that order, each held if the held ones, it,
    and the largest unit left to stream still fit: so held + the unit being streamed never exceeds
    the budget. Pure and deterministic: every rank plans the same residency (their collectives match).
    """
    if sum(n for _, n in sizes) <= budget:
        return frozenset(k for k, _ in sizes)
    held: set = set()
    used = 0
    for key, n in sizes:
        largest_left = max((m for k, m in sizes if k != key and k not in held), default=0)
        if used + n + largest_left <= budget:
            held.add(key)
            used += n
    return frozenset(held)


class HeldUnits:
    """The gathered buffers of the planned units, kept across the applies of one block (a
    `generate` call), and a gather started for the next forward. Used by `ApplyRun` under
    `torch.no_grad()` only: a held buffer has no autograd history to share between forwards."""

    def __init__(self, sizes: Sequence[tuple[Hashable, int]], budget: int):
        self.budget = int(budget)
        self.planned = plan_residency(sizes, self.budget)
        self.order = [k for k, _ in sizes if k in self.planned]  # the planned keys, in `sizes`' order
        self._all = frozenset(k for k, _ in sizes)
        self.plans_all = self.planned == self._all  # every unit planned: the same answer on every rank
        # key -> (full buffer, the shard it was gathered from, that shard's version then)
        self._full: dict[Hashable, tuple[torch.Tensor, torch.Tensor, int]] = {}
        # key -> (a started gather (`Collectives.all_gather_async`), its shard, the shard's version)
        self._pending: dict[Hashable, tuple[object, torch.Tensor, int]] = {}
        self.numel = 0  # elements held now
        # Set by the decode loop before a forward known to be the last: no gather for a next one.
        self.last_forward = False
        self.started = 0  # gathers started ahead of their forward (a count, for tests and benchmarks)

    @classmethod
    def for_plan(cls, plan, config, budget: int | None) -> "HeldUnits":
        """A holder for `plan`'s units within `budget` elements, by default the `config`'s
        `stage3_max_live_parameters` (DeepSpeed's 1e9 without a config)."""
        if budget is None:
            budget = config.zero_optimization.stage3_max_live_parameters if config is not None else 1_000_000_000
        if isinstance(budget, bool) or not isinstance(budget, int) or budget < 0:
            raise ShardingError(f"max_live_parameters must be a whole number of elements >= 0, got {budget!r}")
        return cls(residency_sizes(plan), budget)

    @property
    def complete(self) -> bool:
        """Every sharded unit is held: a forward under this holder moves nothing."""
        return self.plans_all and len(self._full) == len(self._all)

    def gathers_alone(self, params: dict, frozen: dict) -> bool:
        """Whether `start_planned` alone issues every gather a forward would: every unit planned and
        its shard in memory (a shard in a store is gathered in the forward's order instead)."""
        return self.plans_all and not any(is_placeholder((frozen if f else params)[name]) for name, f in self.order)

    def settle(self) -> None:
        """Wait every gather started ahead and hold what it brought (the planned units)."""
        pending, self._pending = self._pending, {}
        for key, (p, shard, _) in pending.items():
            self.offer(key, p.wait(), shard)

    def get(self, key: Hashable, shard: torch.Tensor) -> torch.Tensor | None:
        """The held buffer of `key` if it was gathered from `shard` as it is now (the same tensor, not
        modified since: a step makes new shards, or bumps their version in place); a stale one is
        dropped."""
        entry = self._full.get(key)
        if entry is None:
            return None
        if _current(entry, shard):
            return entry[0]
        del self._full[key]
        self.numel -= entry[0].numel()
        return None

    def holds(self, key: Hashable) -> bool:
        return key in self._full

    def offer(self, key: Hashable, full: torch.Tensor, shard: torch.Tensor) -> None:
        """Keep `full`, gathered from `shard`, if `key` is planned (the first forward gathers, the
        next ones read it)."""
        if key in self.planned and key not in self._full:
            self._full[key] = (full, shard, shard._version)
            self.numel += full.numel()

    def start(self, key: Hashable, pending: object, shard: torch.Tensor) -> None:
        """A gather of `shard` started for the next forward, taken by `take_pending` there."""
        self._pending[key] = (pending, shard, shard._version)
        self.started += 1

    def take_pending(self, key: Hashable, shard: torch.Tensor):
        """The gather started for `key` from `shard` as it is now, else None (a stale one is waited:
        every rank started it)."""
        entry = self._pending.pop(key, None)
        if entry is None:
            return None
        if _current(entry, shard):
            return entry[0]
        entry[0].wait()
        return None

    def is_pending(self, key: Hashable) -> bool:
        return key in self._pending

    def release(self) -> None:
        """Drop the held buffers; a gather started for a forward that never came is waited (every
        rank started it, so its collective completes) and dropped."""
        pending, self._pending = list(self._pending.values()), {}
        for p, *_ in pending:
            p.wait()
        self._full.clear()
        self.numel = 0


def _current(entry: tuple, shard: torch.Tensor) -> bool:
    """Whether a held or pending `entry` (value, its shard, that shard's version) came from `shard`
    as it is now."""
    return entry[1] is shard and entry[2] == shard._version


def next_to_prefetch(order_next, first: str | None, name: str, steps: int, skip) -> tuple[str | None, bool]:
    """The unit to gather ahead after `name` under a holder, and whether it belongs to the next
    forward: the units after `name` in the last forward's order (`order_next(n)`, None after the
    last), wrapping to `first` (decoding repeats the forward, and the next token's weights do not
    depend on this token's output), passing the units `skip(unit, wrapped)` says need no gather.
    None when every unit of a whole turn (`steps` units) is skipped."""
    nxt, wrapped = order_next(name), False
    for _ in range(steps):
        if nxt is None:
            if wrapped or first is None:
                return None, False
            nxt, wrapped = first, True
        if not skip(nxt, wrapped):
            return nxt, wrapped
        nxt = order_next(nxt)
    return None, False


def residency_sizes(plan) -> list[tuple[tuple[str, bool], int]]:
    """((unit name, is frozen), elements) of every part a stage-3 forward gathers, the root first (it
    serves the whole forward), then in the plan's order: the same on every rank, whatever forwards
    each ran (a rank that does not decode records none), so their gathers match."""
    names = dict.fromkeys([ROOT_UNIT, *(u.name for u in (*plan.units, *plan.frozen_units))])
    out = []
    for name in names:
        for unit, frozen in ((plan.trainable_unit(name), False), (plan.frozen_unit(name), True)):
            if unit is not None and plan.params_sharded(unit):
                out.append(((name, frozen), unit.padded_numel))
    return out


# -- what an apply run does under a holder (`_runtime.ApplyRun`, which calls these with itself) --------
def start_planned(run) -> None:
    """Start at once the gathers of the planned units the run's holder does not hold yet, in the
    plan's order (the root first): they fit the budget together, and the forward computes while the
    later ones arrive (the first forward of a decode, or one after the shards changed)."""
    held = run.held
    for key in held.order:
        name, frozen = key
        shard = (run.frozen if frozen else run.params)[name]
        # A shard read from a store (`offload_param: nvme`) is read when its gather starts and kept by
        # it until it completes: started together, every shard would be in memory at once.
        if is_placeholder(shard):
            continue
        if held.get(key, shard) is None and not held.is_pending(key):
            rt = run._runtime(run.plan.frozen_unit(name) if frozen else run.plan.trainable_unit(name), frozen)
            held.start(key, rt.start_gather(), rt.shard)


def prefetch_held(run, name: str) -> None:
    """`ApplyRun.prefetch_forward` under a holder: the next unit not held, past the last unit into the
    next forward; held + the unit computing + the one fetched ahead stay within the budget."""
    held, schedule = run.held, run.schedule
    order = schedule.forward_order
    if held.complete:  # nothing left to fetch
        return

    def keys(unit: str) -> list:
        return [(u.name, f) for u, f in run.sharded_parts(unit)]

    def skip(unit: str, wrapped: bool) -> bool:
        return all(held.holds(k) for k in keys(unit)) or (not wrapped and (unit in run.rts or unit in run.frts))
    first = order[0] if order and not held.last_forward else None  # None: no wrapping into a next forward
    nxt, wrapped = next_to_prefetch(schedule.next_unit, first, name, len(order), skip)
    if nxt is None or any(held.is_pending(k) for k in keys(nxt)):
        return
    n, streaming = run._numel(nxt), not all(held.holds(k) for k in keys(name))
    if n > schedule.prefetch_numel or held.numel + (run._numel(name) if streaming else 0) + n > held.budget:
        return
    for unit, frozen in run.sharded_parts(nxt):
        rt = run._runtime(unit, frozen)
        if wrapped:  # the next forward's run takes it (`UnitRuntime.gather`)
            held.start(rt.key, rt.start_gather(), rt.shard)
        else:
            rt.pending = rt.start_gather()
