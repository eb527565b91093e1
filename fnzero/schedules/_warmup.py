"""WarmupLR, WarmupDecayLR and WarmupCosineLR (deepspeed/runtime/lr_schedules.py).

Each ``get`` below is DeepSpeed's ``get_lr`` at ``last_batch_iteration = i`` with the same
floating-point operations in the same order, so lrs agree bit for bit; `engine` maps the
applied-step index onto i.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from ._base import Schedule, engine, integer, last_iteration, number
from ._base import warmup_type as check_warmup_type

__all__ = ["warmup_lr", "warmup_decay_lr", "warmup_cosine_lr"]


def _ramp(where: str, warmup_num_steps: int, warmup_type: str) -> tuple[int, Callable[[int], float]]:
    """(n, the warmup fraction at iteration i < n: log(i+1)/log(n) or i/n)."""
    # DeepSpeed refuses < 1 and then uses max(2, n): with n = 1 the log ramp would divide by
    # log(1) = 0, so a one-step warmup is really two steps there, and here.
    n = max(2, integer(where, "warmup_num_steps", warmup_num_steps, lo=1))
    if check_warmup_type(where, warmup_type) == "log":
        inverse_log = 1.0 / math.log(n)
        return n, lambda i: inverse_log * math.log(i + 1)
    return n, lambda i: i / n


def _warmup(where: str, warmup_min_lr: float, warmup_max_lr: float, warmup_num_steps: int, warmup_type: str,
            last_batch_iteration: int, base_lr: float | None, after: Callable[[int, int], float]) -> Schedule:
    """WarmupLR's get_lr, min + (max - min) * gamma: the ramp's gamma below n, `after(i, n)` from there."""
    lo = number(where, "warmup_min_lr", warmup_min_lr)
    hi = number(where, "warmup_max_lr", warmup_max_lr)
    n, ramp = _ramp(where, warmup_num_steps, warmup_type)
    L = last_iteration(where, last_batch_iteration)
    base = None if base_lr is None else number(where, "base_lr", base_lr)
    delta = hi - lo

    def get(i: int) -> float:
        return lo + (delta * (ramp(i) if i < n else after(i, n)))

    # At construction DeepSpeed's get_lr sees last_batch_iteration = -1 and returns min_lr.
    return Schedule(engine(get, L, lo, base))


def warmup_lr(
    warmup_min_lr: float = 0.0,
    warmup_max_lr: float | None = None,
    warmup_num_steps: int = 1000,
    warmup_type: str = "log",
    last_batch_iteration: int = -1,
    *,
    base_lr: float | None = None,
) -> Schedule:
    """Ramp from warmup_min_lr to warmup_max_lr over warmup_num_steps, then hold.

    ``warmup_max_lr=None`` is the optimizer's lr (``base_lr``), as in DeepSpeed >= 0.17; with
    neither given it is 0.001, DeepSpeed's documented default. ``base_lr`` is also the lr of the
    first step when resuming with ``last_batch_iteration >= 0`` (see specs/schedules.md).

    >>> s = warmup_lr(0.0, 1.0, warmup_num_steps=4, warmup_type="linear")
    >>> [s(k) for k in range(7)]
    [0.0, 0.0, 0.25, 0.5, 0.75, 1.0, 1.0]
    """
    max_lr = warmup_max_lr if warmup_max_lr is not None else (base_lr if base_lr is not None else 0.001)
    return _warmup("warmup_lr", warmup_min_lr, max_lr, warmup_num_steps, warmup_type, last_batch_iteration, base_lr,
                   lambda i, n: 1.0)


def warmup_decay_lr(
    total_num_steps: int,
    warmup_min_lr: float = 0.0,
    warmup_max_lr: float = 0.001,
    warmup_num_steps: int = 1000,
    warmup_type: str = "log",
    last_batch_iteration: int = -1,
    *,
    base_lr: float | None = None,
) -> Schedule:
    """WarmupLR, then linear decay to 0 at total_num_steps.

    >>> s = warmup_decay_lr(6, 0.0, 1.0, warmup_num_steps=2, warmup_type="linear")
    >>> [s(k) for k in range(9)]
    [0.0, 0.0, 0.5, 1.0, 0.75, 0.5, 0.25, 0.0, 0.0]
    """
    total = integer("warmup_decay_lr", "total_num_steps", total_num_steps, lo=0)
    return _warmup("warmup_decay_lr", warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type,
                   last_batch_iteration, base_lr, lambda i, n: max(0.0, float(total - i) / float(max(1.0, total - n))))


def warmup_cosine_lr(
    total_num_steps: int,
    warmup_min_ratio: float = 0.0,
    warmup_num_steps: int = 1000,
    cos_min_ratio: float = 0.0001,
    warmup_type: str = "log",
    last_batch_iteration: int = -1,
    *,
    base_lr: float,
) -> Schedule:
    """Warm up from warmup_min_ratio to 1, then cosine-decay to cos_min_ratio, all as ratios of
    ``base_lr`` (the optimizer's lr). As in DeepSpeed, the very first step uses lr 0.

    >>> s = warmup_cosine_lr(4, warmup_num_steps=2, cos_min_ratio=0.0, warmup_type="linear", base_lr=1.0)
    >>> [round(s(k), 6) for k in range(6)]
    [0.0, 0.0, 0.5, 0.5, 0.0, 0.0]
    """
    where = "warmup_cosine_lr"
    total = integer(where, "total_num_steps", total_num_steps, lo=0)
    wmin = number(where, "warmup_min_ratio", warmup_min_ratio)
    cmin = number(where, "cos_min_ratio", cos_min_ratio)
    n, ramp = _ramp(where, warmup_num_steps, warmup_type)
    L = last_iteration(where, last_batch_iteration)
    org = number(where, "base_lr", base_lr)

    def ratio(i: int) -> float:
        if i < n:
            return wmin + ramp(i) * (1.0 - wmin)
        progress = min(1.0, (i - n + 1) / max(1, total - n))
        r = (1 + math.cos(math.pi * progress)) / 2
        return max(0.0, cmin + (1.0 - cmin) * r)

    def get(i: int) -> float:
        return org * ratio(i)

    # DeepSpeed's get_lr returns 0.0 before the first step(): the constructor writes lr 0 into
    # the optimizer, and the first applied step runs with it. When resuming (L >= 0) the
    # optimizer keeps its own lr, which is `base_lr` here.
    return Schedule(engine(get, L, 0.0, org))

