"""The optimizer state of a ZeRO-Infinity run: what a step needs in memory, the rest in files."""

from __future__ import annotations

from typing import Any

import optree
import torch

from ._nvme import NvmeOptimizerStore

__all__ = ["NvmeOptState"]


@optree.dataclasses.dataclass(frozen=True, eq=False, namespace="")
class NvmeOptState:
    """`count`: steps applied through the store (0-dim int64). `store`: the per-rank files holding
    the fp32 master weights and every per-unit leaf of the optimizer's state (static metadata,
    not a leaf). `resident`: the optimizer state's other leaves (its step counts), in memory.
    `layout`: which leaf of the optimizer's own state is which (`_layout.py`; static).
    `holds_params`: the store is also where the stage-3 parameter shards are read from (static).

    The files are updated in place by each step, so only the newest state is usable: a step given
    an older one fails with a clear error instead of reading moments from the future.
    """

    count: torch.Tensor
    store: NvmeOptimizerStore = optree.dataclasses.field(pytree_node=False)
    resident: tuple = ()
    layout: Any = optree.dataclasses.field(pytree_node=False, default=None)
    # `offload_param: nvme`: stage-3 parameter shards are read from the store's master file and
    # `TrainState.params` holds placeholders for them (`fnzero/sharding/zero/_param_store.py`).
    holds_params: bool = optree.dataclasses.field(pytree_node=False, default=False)
