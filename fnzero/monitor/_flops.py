"""FLOP counting for `Monitor.profile_flops`: `torch.utils.flop_counter.FlopCounterMode` around a
call, with the per-module totals DeepSpeed's flops profiler reports (`module_depth`, `top_modules`).
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable

import torch
from torch.utils.flop_counter import FlopCounterMode

__all__ = ["FlopsProfile", "count_flops", "format_flops"]


@dataclasses.dataclass(frozen=True)
class FlopsProfile:
    """What one profiled call cost (`specs/monitor.md` §Sections, flops_profiler). total: FLOPs of
    the call (a multiply-add counts 2). top: `{depth: [(name, flops), ...]}`. step_flops: the
    estimated FLOPs of one training step on this rank. output: what the call returned."""

    total: int
    by_module: dict[str, int]
    top: dict[int, list[tuple[str, int]]]
    step_flops: int
    output: Any = None


def format_flops(n: float, per_second: bool = False) -> str:
    """`1.23 GFLOP`, `4.56 TFLOP/s`.

    >>> format_flops(2.5e9), format_flops(3e12, per_second=True)
    ('2.50 GFLOP', '3.00 TFLOP/s')
    """
    for div, unit in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "K")):
        if abs(n) >= div:
            return f"{n / div:.2f} {unit}FLOP{'/s' if per_second else ''}"
    return f"{n:.0f} FLOP{'/s' if per_second else ''}"


def count_flops(fn: Callable, args, kwargs, *, module_depth: int = -1, top_modules: int = 1,
                includes_backward: bool = False) -> tuple[int, dict[str, int], dict[int, list[tuple[str, int]]], Any]:
    """Run `fn(*args, **kwargs)` under FlopCounterMode; returns (total, by_module, top, output).

    A forward-only call runs under `torch.no_grad()`: no graph is kept for a backward that never comes.
    """
    guard = contextlib.nullcontext() if includes_backward else torch.no_grad()
    with guard, FlopCounterMode(display=False) as counter:
        output = fn(*args, **kwargs)
    total = int(counter.get_total_flops())
    by_module = {name: int(sum(ops.values())) for name, ops in counter.get_flop_counts().items() if name != "Global"}
    top: dict[int, list[tuple[str, int]]] = {}
    for name, flops in by_module.items():
        depth = name.count(".")
        if module_depth >= 0 and depth > module_depth:
            continue
        top.setdefault(depth, []).append((name, flops))
    top = {d: sorted(v, key=lambda kv: (-kv[1], kv[0]))[:top_modules] for d, v in sorted(top.items())}
    return total, by_module, top, output
