"""Parameter shards kept in a store instead of memory, as placeholders: `offload_param: {device: nvme}`
at stage 3 (`specs/offload.md` §Parameters). This layer only reads and writes a store (`ShardSource`);
the stores are the offload layer's, handed in through `Sharding.shard_sources`."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from ..._errors import ShardingError
from ..._state import TrainState

__all__ = ["ShardSource", "ShardSources", "placeholder", "is_placeholder", "sources_of", "held", "read_placeholders", "stepped_in_place",
           "stored_bytes"]


def placeholder(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A stand-in for a shard whose values are in a store: its shape and dtype, no memory."""
    return torch.empty_strided((numel,), (0,), dtype=dtype, device=device)


def is_placeholder(t: torch.Tensor) -> bool:
    return t.dim() == 1 and t.numel() > 1 and t.stride(0) == 0


@dataclasses.dataclass(frozen=True)
class ShardSource:
    """Where one kind of placeholder shard is read from: `store.read(unit, kind)` (a CPU tensor of
    any float dtype) and, for `checkpoint.load`, `store.write(unit, kind, value)`. `current`: unit ->
    the address of its newest placeholder (`renew`), the only one `read` accepts (`specs/offload.md`
    §Parameters); a unit never renewed is read by any state."""

    store: Any
    kind: str
    current: dict[str, int] = dataclasses.field(default_factory=dict, compare=False, repr=False)

    def read(self, unit: str, like: torch.Tensor) -> torch.Tensor:
        """The unit's current shard, in `like`'s dtype and on its device."""
        shard = self.store.read(unit, self.kind)  # (first: a store an update broke says so, not this)
        newest = self.current.get(unit)
        if newest is not None and like.data_ptr() != newest:
            raise ShardingError(
                f"the parameters given hold an older state's placeholder for unit {unit!r}: with offload_param "
                "device nvme each step (and checkpoint.load) writes the shards into their files in place, so only the "
                "newest state's parameters can be read; use the newest state, or load a checkpoint")
        # Not blocking: a pinned host shard (`offload/_host_params.py`) then copies by DMA while
        # the host goes on to issue the gather; a pageable one copies synchronously as before.
        return shard.to(device=like.device, dtype=like.dtype, non_blocking=True)

    def write(self, unit: str, value: torch.Tensor) -> None:
        self.store.write(unit, self.kind, value)

    def renew(self, unit: str, like: torch.Tensor) -> torch.Tensor:
        """A new placeholder like `like` for the state whose shard of `unit` the store now holds."""
        fresh = placeholder(like.numel(), like.dtype, like.device)
        self.current[unit] = fresh.data_ptr()
        return fresh


@dataclasses.dataclass(frozen=True)
class ShardSources:
    """The sources of a state's placeholders: `params` for trainable units, `frozen` for frozen ones."""

    params: ShardSource | None = None
    frozen: ShardSource | None = None

    def of(self, frozen: bool) -> ShardSource | None:
        return self.frozen if frozen else self.params


NO_SOURCES = ShardSources()


def sources_of(sharding) -> ShardSources:
    """The shard sources a `Sharding` carries (none: every shard is in memory)."""
    return getattr(sharding, "shard_sources", None) or NO_SOURCES


def held(t: torch.Tensor, source: ShardSource | None, unit: str) -> torch.Tensor:
    """`t`'s values: `t` itself (detached), or a placeholder's shard read from `source`."""
    if source is not None and is_placeholder(t):
        return source.read(unit, t)
    return t.detach()


def stepped_in_place(state: TrainState) -> ShardSource | None:
    """The parameter store each step writes its new trainable shards into, in place, checked to hold
    this state's step (`specs/offload.md` §Parameters); None where no step writes a store. A store an
    update left part-way raises its NvmeStoreError."""
    source = sources_of(state.sharding).params
    if source is None or state.master is None or not any(is_placeholder(p) for p in state.params.values()):
        return None
    held_step, step = source.store.last_step, int(state.step)
    if held_step != step:
        raise ShardingError(
            f"this TrainState is at step {step} but the NVMe files of its parameter shards hold step {held_step}: "
            "with offload_param device nvme each step writes the new shards into their files in place, so only "
            "the newest state can take a step or be saved"
        )
    return source


def read_placeholders(state: TrainState, *, frozen: bool = True) -> TrainState:
    """A copy of `state` with every placeholder in `params` (and `frozen`, unless `frozen=False`)
    read from its store; a state older than its store's shards is refused (`stepped_in_place`)."""
    sources = sources_of(state.sharding)
    if sources is NO_SOURCES:
        return state
    stepped_in_place(state)
    changes: dict[str, dict[str, torch.Tensor]] = {}
    for field, source in (("params", sources.params), ("frozen", sources.frozen if frozen else None)):
        tensors = getattr(state, field)
        if source is not None and any(is_placeholder(t) for t in tensors.values()):
            changes[field] = {k: held(t, source, k) for k, t in tensors.items()}
    return state.replace(**changes) if changes else state


def stored_bytes(tensors: dict[str, torch.Tensor]) -> int:
    """The bytes the placeholders among `tensors` stand for (held in a store, not in memory)."""
    return sum(t.numel() * t.element_size() for t in tensors.values() if is_placeholder(t))
