"""`compile_fn`: torch.compile as every fnzero graph is compiled (`fnzero.jit`'s loss, units and
whole step alike), with the one dynamo setting they need."""

from __future__ import annotations

import functools
from typing import Any

import torch

__all__ = ["compile_fn"]


def compile_fn(fn, compile_kwargs: dict[str, Any]):
    """`torch.compile(fn, **compile_kwargs)`, traced with the one dynamo setting fnzero's graphs need:
    `skip_fwd_side_effects_in_bwd_under_checkpoint`, so a checkpointed region that sets and restores
    outside state (Hugging Face attention since transformers 5.2x) is traced whole; scoped to these
    calls (`specs/jit.md` §Checkpointing)."""
    compiled = torch.compile(fn, **compile_kwargs)

    @functools.wraps(fn)
    def call(*args, **kwargs):
        with torch._dynamo.config.patch(skip_fwd_side_effects_in_bwd_under_checkpoint=True):
            return compiled(*args, **kwargs)

    return call
