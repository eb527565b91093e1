"""torch.compile as every fnzero graph is compiled, with the one dynamo setting they need: `compile_fn`
wraps a function (`fnzero.jit`'s loss and whole step), `CompiledFrames` compiles the frames that start
while it is entered (`fnzero.jit`'s unit forwards, entered by each unit's own hooks)."""

from __future__ import annotations

import functools
from typing import Any

import torch

__all__ = ["compile_fn", "CompiledFrames"]


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


class CompiledFrames:
    """torch.compile as a window instead of a wrapper: between `window = frames()` and
    `window.__exit__(None, None, None)`, every Python frame that starts on this thread is compiled as
    `torch.compile(..., **compile_kwargs)` compiles the function it wraps, cached on the frame's code
    object, with the setting of `compile_fn`.

    [Note: a compile window, not a wrapper]
    torch.compile is frame evaluation: its wrapper turns dynamo's frame hook on for the call and off
    after it, and dynamo compiles every frame that starts meanwhile. `fnzero.jit(scope="units")` has
    no call of its own around a unit's forward (the user's model calls the unit), only the unit's
    hooks before and after it, so it opens the same hook there (`sharding/zero/_unit_hooks.py`):
    the forward's frame is compiled, and nothing of the module is replaced. torch keeps that hook
    behind its wrapper (entering its context directly is refused unless
    `raise_on_ctx_manager_usage` is off), so this is the one place fnzero reaches past torch.compile's
    public surface; the jit tests fail if a torch release changes it.
    """

    def __init__(self, compile_kwargs: dict[str, Any]):
        # The dynamo context torch.compile builds for these arguments (an OptimizedModule keeps it),
        # so mode, options, fullgraph and dynamic mean what they mean to torch.compile, and equal
        # arguments give equal backends, whose compiled frames dynamo shares.
        self._dynamo = torch.compile(torch.nn.Identity(), **compile_kwargs).dynamo_ctx
        # Entered with the window, left after it (its hooks run after the frame hook is off again).
        self._dynamo.enter_exit_hooks.append(
            torch._dynamo.config._make_closure_patcher(skip_fwd_side_effects_in_bwd_under_checkpoint=True))

    def __call__(self):
        """Open a window; its `__exit__(None, None, None)`, torch's code alone, closes it."""
        # One context object per window (entering keeps the hook it replaces on the object), a
        # shallow copy: copy.copy would rebuild it through its __reduce__, which drops fullgraph.
        window = object.__new__(type(self._dynamo))
        window.__dict__.update(vars(self._dynamo))
        with torch._dynamo.config.patch(raise_on_ctx_manager_usage=False):
            window.__enter__()
        return window
