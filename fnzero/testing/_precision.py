"""Where a model computes below its own dtype (a float64 model whose RMSNorm, softmax or loss runs in
float32): what `NoiseFloorWarning` names as *why* the model does not reproduce to its rounding."""

from __future__ import annotations

import collections
from typing import Any, Callable

import optree
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ._context import seeded

__all__ = ["lower_precision_sites", "describe_sites"]


class _Recorder(TorchDispatchMode):
    """Counts operations whose floating outputs are narrower than `dtype`, by the innermost module
    running (a stack kept by forward hooks) and by the narrow dtype."""

    def __init__(self, dtype: torch.dtype, stack: list[str]):
        super().__init__()
        self.dtype, self.stack = dtype, stack
        self.sites: collections.Counter[tuple[str, str]] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in optree.tree_leaves(out, none_is_leaf=True):
            if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype.itemsize < self.dtype.itemsize:
                self.sites[(self.stack[-1], str(t.dtype).removeprefix("torch."))] += 1
                break
        return out


def lower_precision_sites(
    model_factory: Callable[[], torch.nn.Module], loss_fn: Callable[..., Any], batch: Any,
    dtype: torch.dtype | None, seed: int,
) -> collections.Counter[tuple[str, str]]:
    """`{(module class, narrow dtype): operations}` in one forward of `loss_fn(model, batch)` on a
    plain (unsharded) copy of the model; empty when everything computes in the model's dtype."""
    with seeded(seed):
        model = model_factory()
    if dtype is not None:
        model = model.to(dtype)
    wide = dtype or next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    stack = ["the loss function"]
    handles = []

    def enter(module, args):
        stack.append(type(module).__name__)

    def leave(module, args, out):  # returns None: a forward hook's return value replaces the output
        stack.pop()

    for m in model.modules():
        handles += [m.register_forward_pre_hook(enter), m.register_forward_hook(leave)]
    recorder = _Recorder(wide, stack)
    try:
        with torch.no_grad(), recorder:
            loss_fn(model, batch)
    finally:
        for h in handles:
            h.remove()
    return recorder.sites


def describe_sites(sites: collections.Counter[tuple[str, str]], limit: int = 4) -> str:
    """`float32 inside LlamaRMSNorm (10 ops), LlamaAttention (4 ops) and 2 more modules`."""
    by_dtype: dict[str, list[tuple[str, int]]] = collections.defaultdict(list)
    for (where, narrow), n in sites.most_common():
        by_dtype[narrow].append((where, n))
    parts = []
    for narrow, places in by_dtype.items():
        named = ", ".join(f"{w} ({n} op{'s' if n > 1 else ''})" for w, n in places[:limit])
        more = f" and {len(places) - limit} more modules" if len(places) > limit else ""
        parts.append(f"{narrow} inside {named}{more}")
    return "; ".join(parts)
