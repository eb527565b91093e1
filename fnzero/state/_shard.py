"""`fnzero.shard`: the model laid out for its ZeRO stage (`fnzero.sharding.shard`), with the state
layer's `init_state` as what its `sm.init_state()` builds.

The layout is sharding's; the first state holds what the layers above it define (the optimizer's
state, the loss scale, offload stores, pretrained weights), so it is built here and handed to the
module as a parameter, and no import runs from sharding up to this layer
(`specs/architecture.md` §Layers)."""

from __future__ import annotations

from typing import Any, Callable, Iterable

import torch
from torch import nn

from ..sharding import Collectives, CommQuantization, Mesh, ShardedModule, TPRule, shard as lay_out
from ._init import init_state

__all__ = ["shard"]


def shard(
    model: nn.Module,
    stage: int | None = None,
    config: Any = None,
    *,
    wrap: Callable[[str, nn.Module], bool] | Iterable[type] | None = None,
    comm: Collectives | None = None,
    device: torch.device | str | None = None,
    debug_collectives: bool = False,
    init_seed: int | None = None,
    mesh: Mesh | None = None,
    tp_plan: list[TPRule] | None = None,
    comm_quantization: CommQuantization | None = None,
) -> ShardedModule:
    return lay_out(model, stage, config, wrap=wrap, comm=comm, device=device, debug_collectives=debug_collectives,
                   init_seed=init_seed, mesh=mesh, tp_plan=tp_plan, comm_quantization=comm_quantization,
                   build_state=init_state)


shard.__doc__ = lay_out.__doc__  # one text for both: the arguments are the layout's
