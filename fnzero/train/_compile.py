"""`compile_fn`: torch.compile as every fnzero graph is compiled (`fnzero.jit`'s loss, units and
whole step alike), with the one dynamo setting they need."""

from __future__ import annotations

import functools
from typing import Any

import torch

__all__ = ["compile_fn"]


def compile_fn(fn, compile_kwargs: dict[str, Any]):
    """`torch.compile(fn, **compile_kwargs)`, traced with the one dynamo setting fnzero's graphs need.

    [Note: side effects in a checkpointed region] Eager activation checkpointing re-runs a region's
    Python in the backward, so dynamo refuses any mutation of outside state inside a checkpoint
    and breaks the graph there. Hugging Face models make one in every attention layer since
    transformers 5.2x: the `kernels` package's `use_kernelized_func` wrapper sets and restores a
    module-level variable around each forward, a net-zero change that only picks which Python
    function is traced. Such a region is traced whole when dynamo may apply the forward's side
    effects once and not again at recomputation (`skip_fwd_side_effects_in_bwd_under_checkpoint`):
    the tensors computed are the same, and a mutation the region undoes itself, as this one does, is
    the same either way. The setting is scoped to the calls of fnzero's compiled functions, where
    dynamo reads it; the rest of the process keeps torch's default (`specs/jit.md` §Checkpointing)."""
    compiled = torch.compile(fn, **compile_kwargs)

    @functools.wraps(fn)
    def call(*args, **kwargs):
        with torch._dynamo.config.patch(skip_fwd_side_effects_in_bwd_under_checkpoint=True):
            return compiled(*args, **kwargs)

    return call
