"""`fnzero.remat`: activation checkpointing as a function transform (like `jax.checkpoint`), on
torch.utils.checkpoint (non-reentrant); under stage 3 the recomputation re-gathers the parameters."""

from __future__ import annotations

import functools
from typing import Any, Callable

import optree
import torch
from torch.utils.checkpoint import checkpoint

from ._ambient import ambient, within

__all__ = ["remat"]


def remat(fn: Callable[..., Any] | None = None, *, cpu_offload: bool = False, preserve_rng_state: bool = True,
          config: Any = None):
    """Return `fn` with activation checkpointing. Usable as `remat(fn)` or `@remat(cpu_offload=True)`.

    `cpu_offload`: the inputs kept for recomputation live in host memory. `config`: a fnzero Config;
    its `activation_checkpointing.cpu_checkpointing` sets `cpu_offload`.

    >>> import torch, fnzero
    >>> layer = torch.nn.Linear(4, 4)
    >>> f = fnzero.remat(lambda x: torch.tanh(layer(x)).sum())
    >>> f(torch.ones(2, 4, requires_grad=True)).backward()
    """
    if config is not None:
        cpu_offload = config.activation_checkpointing.cpu_checkpointing or cpu_offload
    if fn is None:
        return functools.partial(remat, cpu_offload=cpu_offload, preserve_rng_state=preserve_rng_state)

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        if torch.compiler.is_compiling() and not cpu_offload:
            # Traced by torch.compile: parameters are graph inputs, so the recomputation needs no
            # rebinding and the checkpoint becomes part of the compiled backward.
            return checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=preserve_rng_state, **kwargs)
        run = ambient().run
        bindings = list(run.bindings) if run is not None else []
        devices: dict[int, torch.device] = {}

        def body(*a, **k):
            if cpu_offload:
                a, k = optree.tree_map(
                    lambda x: x.to(devices[id(x)]) if isinstance(x, torch.Tensor) and id(x) in devices else x,
                    (a, k), none_is_leaf=True,
                )
            if run is None or ambient().run is run:
                return fn(*a, **k)  # the first forward: parameters are bound already
            # Recomputation runs inside backward, after `apply` returned: bind the parameters the
            # forward saw again (stage-3 units are re-gathered) and make the run current.
            with within(run=run), run.rebind(bindings):
                return fn(*a, **k)

        if cpu_offload:
            def to_host(x):
                if isinstance(x, torch.Tensor) and x.device.type != "cpu":
                    h = x.to("cpu")
                    devices[id(h)] = x.device
                    return h
                return x

            args, kwargs = optree.tree_map(to_host, (args, kwargs), none_is_leaf=True)
        return checkpoint(body, *args, use_reentrant=False, preserve_rng_state=preserve_rng_state, **kwargs)

    return wrapped
