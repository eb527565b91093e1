"""`Schedule` and DeepSpeed's step convention, shared by every schedule: which lr the k-th applied
step uses, given `last_batch_iteration` (specs/schedules.md §Step convention)."""

from __future__ import annotations

import dataclasses
import math
import operator
from collections.abc import Callable
from typing import Any

from fnzero._errors import ConfigError

__all__ = ["Schedule", "constant"]


@dataclasses.dataclass(frozen=True)
class Schedule:
    """A learning-rate schedule: ``lr(k)`` (and, for OneCycle, ``momentum(k)``) for the k-th
    applied optimizer step, k = 0, 1, ...; ``schedule(k)`` is ``schedule.lr(k)``.

    Both are pure functions of k, so resuming needs nothing but the applied-step count.
    ``momentum`` is None when the schedule leaves momentum alone.
    """

    lr: Callable[[int], float]
    momentum: Callable[[int], float] | None = None

    def __call__(self, step: int) -> float:
        return self.lr(step)


def constant(lr: float) -> Schedule:
    """The same lr at every step (what DeepSpeed does without a `scheduler` block).

    >>> constant(0.1)(0), constant(0.1)(10**6)
    (0.1, 0.1)
    """
    value = number("constant", "lr", lr)

    def at(step: int) -> float:
        step_index(step)
        return value

    return Schedule(at)


def step_index(step: Any) -> int:
    """A non-negative int step; bools and floats are refused (a float step is a bug upstream)."""
    if isinstance(step, bool):
        raise TypeError(f"step must be an int, got {step!r}")
    k = operator.index(step)
    if k < 0:
        raise ValueError(f"step must be >= 0, got {k}")
    return k


def engine(
    get: Callable[[int], float], last_batch_iteration: int, initial: float, base: float | None
) -> Callable[[int], float]:
    """Turn DeepSpeed's ``get_lr`` at a given ``last_batch_iteration`` into ``lr(k)``.

    `base` (the optimizer's lr) is what step 0 uses when resuming from L >= 0; when it is not
    known, the scheduler's own value at L is used, as when DeepSpeed resumes from a checkpoint
    (the checkpointed optimizer carries the lr the scheduler last wrote).
    """
    L = last_batch_iteration

    def at(step: int) -> float:
        k = step_index(step)
        if k == 0:
            if L == -1:
                return initial
            return get(L) if base is None else base
        return get(L + k)

    return at


# -- hyper-parameter checks ---------------------------------------------------------------


def number(where: str, name: str, value: Any, *, lo: float | None = 0.0) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ConfigError(f"{where}: {name}={value!r} must be a finite number")
    if lo is not None and value < lo:
        raise ConfigError(f"{where}: {name}={value!r} must be >= {lo:g}")
    return float(value)


def integer(where: str, name: str, value: Any, *, lo: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{where}: {name}={value!r} must be an integer")
    if value < lo:
        raise ConfigError(f"{where}: {name}={value!r} must be >= {lo}")
    return value


def last_iteration(where: str, value: Any) -> int:
    # -1 is "start fresh"; below that DeepSpeed would evaluate its formulas at negative
    # iterations, which none of them is meant for.
    return integer(where, "last_batch_iteration", value, lo=-1)


def warmup_type(where: str, value: Any) -> str:
    # DeepSpeed logs a warning and uses "log" for an unknown type; a typo should not silently
    # change the ramp, so it is an error here.
    kind = value.lower() if isinstance(value, str) else value
    if kind not in ("log", "linear"):
        raise ConfigError(f"{where}: warmup_type={value!r} must be 'log' or 'linear'")
    return kind
