"""`fnzero.shard`: the model laid out for its ZeRO stage (`fnzero.sharding.shard`), with the state
layer's `init_state` as what its `sm.init_state()` builds.

The layout is sharding's; the first state holds what the layers above it define (the optimizer's
state, the loss scale, offload stores, pretrained weights), so it is built here and handed to the
module as a parameter, and no import runs from sharding up to this layer
(`specs/architecture.md` §Layers)."""

from __future__ import annotations

import functools
from typing import Any

from ..sharding import ShardedModule, shard as lay_out
from ._init import init_state

__all__ = ["shard"]


def shard(model: Any, stage: int | None = None, config: Any = None, **options: Any) -> ShardedModule:
    return lay_out(model, stage, config, build_state=init_state, **options)


# One text and one signature for both (`help`, `inspect.signature`): the arguments are the layout's.
functools.update_wrapper(shard, lay_out, assigned=("__doc__",), updated=())
