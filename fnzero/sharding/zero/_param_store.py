"""Parameter shards kept in a store instead of memory: `offload_param: {device: nvme}` at stage 3
(`specs/offload.md` §Parameters).

With the optimizer state on NVMe, the store's master file already holds every unit's fp32 shard,
and a stage-3 parameter shard is that shard in the compute dtype. So the state keeps no copy: each
sharded unit's entry in `TrainState.params` is a *placeholder*, a tensor of the shard's shape and
dtype over one element of storage (stride 0), and a unit's shard is read from the store just
before its all-gather, in forward and again for its backward. The gradient of the loss with
respect to the placeholder is the unit's reduced gradient shard, as for an in-memory shard, and
the optimizer step writes the new master straight to the file (no copy-out).

Reading the fp32 master and rounding it to 16 bits gives the same bits as the kernel's fused
16-bit copy-out (round to nearest even), so a run with offloaded parameters equals the same run
without, bit for bit (tested). The cost: each step reads the shard twice (forward and backward),
4Ψ/N bytes each, even in 16-bit training.
"""

from __future__ import annotations

import torch

__all__ = ["placeholder", "is_placeholder", "read_shard"]


def placeholder(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A stand-in for a shard whose values are in the store: its shape and dtype, no memory."""
    return torch.empty_strided((numel,), (0,), dtype=dtype, device=device)


def is_placeholder(t: torch.Tensor) -> bool:
    return t.dim() == 1 and t.numel() > 1 and t.stride(0) == 0


def read_shard(store, unit: str, like: torch.Tensor) -> torch.Tensor:
    """The unit's current shard from `store`, in `like`'s dtype and on its device."""
    return store.read(unit, "master").to(device=like.device, dtype=like.dtype)
