"""OneCycle and LRRangeTest (deepspeed/runtime/lr_schedules.py, including the stair counts).

As in _warmup.py, each ``get`` repeats DeepSpeed's arithmetic at ``last_batch_iteration = i``
operation for operation; `engine` maps applied steps onto i.
"""

from __future__ import annotations

import dataclasses
import math

from fnzero._errors import ConfigError

from ._base import Schedule, engine, integer, last_iteration, number

__all__ = ["one_cycle", "lr_range_test"]


def one_cycle(
    cycle_min_lr: float,
    cycle_max_lr: float,
    decay_lr_rate: float = 0.0,
    cycle_first_step_size: int = 2000,
    cycle_second_step_size: int | None = None,
    cycle_first_stair_count: int = 0,
    cycle_second_stair_count: int | None = None,
    decay_step_size: int = 0,
    cycle_momentum: bool = True,
    cycle_min_mom: float = 0.8,
    cycle_max_mom: float = 0.9,
    decay_mom_rate: float = 0.0,
    last_batch_iteration: int = -1,
    *,
    base_lr: float | None = None,
    base_momentum: float | None = None,
) -> Schedule:
    """One cycle: lr rises from cycle_min_lr to cycle_max_lr over cycle_first_step_size steps, falls
    back over cycle_second_step_size, then decays; with ``cycle_momentum`` the momentum (beta1) moves
    the opposite way (specs/schedules.md §OneCycle). ``base_lr``/``base_momentum``: the optimizer's
    own values, for the first step when resuming with ``last_batch_iteration >= 0``.

    >>> s = one_cycle(0.0, 1.0, cycle_first_step_size=2, cycle_min_mom=0.8, cycle_max_mom=0.9)
    >>> [s(k) for k in range(6)]
    [0.0, 0.5, 1.0, 0.5, 0.0, 0.0]
    >>> [round(s.momentum(k), 6) for k in range(6)]
    [0.8, 0.85, 0.8, 0.85, 0.9, 0.9]
    """
    where = "one_cycle"
    min_lr = number(where, "cycle_min_lr", cycle_min_lr)
    max_lr = number(where, "cycle_max_lr", cycle_max_lr)
    decay_lr_rate = number(where, "decay_lr_rate", decay_lr_rate, lo=None)
    first = float(integer(where, "cycle_first_step_size", cycle_first_step_size, lo=1))
    # A zero-length falling half is harmless (the scale never leaves the rising branch).
    second = first if cycle_second_step_size is None else float(integer(where, "cycle_second_step_size", cycle_second_step_size, lo=0))
    # Stair counts <= 0 mean "continuous" in DeepSpeed (its CLI default is -1).
    first_stairs = integer(where, "cycle_first_stair_count", cycle_first_stair_count, lo=-(2**63))
    second_stairs = first_stairs if cycle_second_stair_count is None else integer(
        where, "cycle_second_stair_count", cycle_second_stair_count, lo=-(2**63)
    )
    decay_step_size = integer(where, "decay_step_size", decay_step_size, lo=0)
    if not isinstance(cycle_momentum, bool):
        raise ConfigError(f"{where}: cycle_momentum={cycle_momentum!r} must be true or false")
    min_mom = number(where, "cycle_min_mom", cycle_min_mom)
    max_mom = number(where, "cycle_max_mom", cycle_max_mom)
    decay_mom_rate = number(where, "decay_mom_rate", decay_mom_rate, lo=None)
    L = last_iteration(where, last_batch_iteration)
    base = None if base_lr is None else number(where, "base_lr", base_lr)
    base_mom = None if base_momentum is None else number(where, "base_momentum", base_momentum)
    cycle = _Cycle(min_lr, max_lr, decay_lr_rate, first, second, first_stairs, second_stairs, decay_step_size,
                   min_mom, max_mom, decay_mom_rate)
    momentum = engine(cycle.momentum, L, min_mom, base_mom) if cycle_momentum else None
    return Schedule(engine(cycle.lr, L, min_lr, base), momentum)


@dataclasses.dataclass(frozen=True)
class _Cycle:
    """DeepSpeed's OneCycle at `last_batch_iteration = i` over checked values: the lr and the
    momentum within the cycle (`first` steps up, `second` down, on stairs where a stair count
    is > 0) and their decay after it."""

    min_lr: float
    max_lr: float
    decay_lr_rate: float
    first: float
    second: float
    first_stairs: int
    second_stairs: int
    decay_step_size: int
    min_mom: float
    max_mom: float
    decay_mom_rate: float

    @property
    def total(self) -> float:
        return self.first + self.second

    @property
    def step_ratio(self) -> float:
        return self.first / self.total

    # DeepSpeed skips the post-cycle decay (holding the end value) when the interval or the
    # rate is (close to) zero, which also keeps it from dividing by a zero interval.
    @property
    def skip_lr_decay(self) -> bool:
        return math.isclose(self.decay_step_size, 0) or math.isclose(self.decay_lr_rate, 0)

    @property
    def skip_mom_decay(self) -> bool:
        return math.isclose(self.decay_step_size, 0) or math.isclose(self.decay_mom_rate, 0)

    def scale(self, i: int) -> float:
        total, first, second, step_ratio = self.total, self.first, self.second, self.step_ratio
        batch_iteration = i + 1
        cycle = math.floor(1 + batch_iteration / total)
        x = 1.0 + batch_iteration / total - cycle
        if x <= step_ratio:
            factor = x / step_ratio
            stairs = self.first_stairs
        else:
            factor = (x - 1) / (step_ratio - 1)
            stairs = self.second_stairs
        if stairs > 0:
            # Quantised from the integer offset, not from `factor` (see DeepSpeed #8179).
            cycle_iteration = batch_iteration % total
            if cycle_iteration <= first:
                position = cycle_iteration * stairs / first
            else:
                position = (total - cycle_iteration) * stairs / second
            factor = math.floor(position) / stairs
        return factor

    def lr(self, i: int) -> float:
        if i < self.total:
            return self.min_lr + (self.max_lr - self.min_lr) * self.scale(i)
        if self.skip_lr_decay:
            return self.min_lr
        return self.min_lr / (1 + self.decay_lr_rate * ((i - self.total + 1) / self.decay_step_size))

    def momentum(self, i: int) -> float:
        if i < self.total:
            return self.max_mom - (self.max_mom - self.min_mom) * self.scale(i)
        if self.skip_mom_decay:
            return self.max_mom
        return self.max_mom * (1 + self.decay_mom_rate * ((i - self.total + 1) / self.decay_step_size))


def lr_range_test(
    lr_range_test_min_lr: float = 1e-3,
    lr_range_test_step_size: int = 2000,
    lr_range_test_step_rate: float = 1.0,
    lr_range_test_staircase: bool = False,
    last_batch_iteration: int = -1,
    *,
    base_lr: float | None = None,
) -> Schedule:
    """The LR range test: min_lr * (1 + rate * (i+1)/step_size), floored to whole intervals
    with ``staircase``.

    >>> s = lr_range_test(1.0, lr_range_test_step_size=2, lr_range_test_staircase=True)
    >>> [s(k) for k in range(6)]
    [1.0, 1.0, 2.0, 2.0, 3.0, 3.0]
    """
    where = "lr_range_test"
    min_lr = number(where, "lr_range_test_min_lr", lr_range_test_min_lr)
    size = integer(where, "lr_range_test_step_size", lr_range_test_step_size, lo=1)
    rate = number(where, "lr_range_test_step_rate", lr_range_test_step_rate, lo=None)
    if not isinstance(lr_range_test_staircase, bool):
        raise ConfigError(f"{where}: lr_range_test_staircase={lr_range_test_staircase!r} must be true or false")
    L = last_iteration(where, last_batch_iteration)
    base = None if base_lr is None else number(where, "base_lr", base_lr)

    def get(i: int) -> float:
        interval = float(i + 1) / size
        if lr_range_test_staircase:
            interval = math.floor(interval)
        return min_lr * (1 + rate * interval)

    return Schedule(engine(get, L, min_lr, base))
