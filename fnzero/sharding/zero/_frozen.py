"""Frozen units at stage 3: the end of a unit's backward, seen from its inputs. No `GatherUnit.backward`
says when a frozen unit's backward is done, so its forward's inputs pass through an identity whose
backward frees the re-gathered copy (`specs/sharding.md` §Frozen parameters; FSDP2's post-backward)."""

from __future__ import annotations

from typing import Any, Callable

import torch

__all__ = ["release_after_backward"]


class _ReleaseAfterBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, release: Callable[[], None], *inputs: torch.Tensor):
        ctx.release = release
        return inputs

    @staticmethod
    def backward(ctx, *grads):
        release, ctx.release = ctx.release, None
        if release is not None:
            release()
        return (None, *grads)


def release_after_backward(args: tuple, kwargs: dict, release: Callable[[], None]) -> tuple[tuple, dict]:
    """`args` and `kwargs` with each top-level tensor that needs a gradient passed through one
    identity, whose backward calls `release` (unchanged when none needs one, or grad is off)."""
    if not torch.is_grad_enabled():
        return args, kwargs
    where: list[tuple[str, Any]] = [("a", i) for i, a in enumerate(args) if _needs_grad(a)]
    where += [("k", k) for k, v in kwargs.items() if _needs_grad(v)]
    if not where:
        return args, kwargs
    inputs = [args[i] if kind == "a" else kwargs[i] for kind, i in where]
    outs = _ReleaseAfterBackward.apply(release, *inputs)
    args, kwargs = list(args), dict(kwargs)
    for (kind, i), t in zip(where, outs):
        if kind == "a":
            args[i] = t
        else:
            kwargs[i] = t
    return tuple(args), kwargs


def _needs_grad(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and x.requires_grad
