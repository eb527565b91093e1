"""Quantized all-gather and reduce-scatter over any `Collectives` (ZeRO++'s qwZ and qgZ), and the
wrapper that routes a caller's gathers and reduce-scatters through them (`specs/collectives.md`
§Quantized collectives); they move a codec's bytes through the wrapped collectives' own ops, so
recording, checking and the watchdog see what really travels."""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from ..._errors import ShardingError
from ._quantize import PayloadCodec

__all__ = ["quantized_all_gather_async", "quantized_reduce_scatter_async", "QuantizedCollectives", "quantizing"]


class _Decoding:
    """A pending collective of encoded bytes; `wait()` decodes them once."""

    __slots__ = ("_pending", "_decode", "_result")

    def __init__(self, pending, decode: Callable[[torch.Tensor], torch.Tensor]):
        self._pending, self._decode, self._result = pending, decode, None

    def wait(self) -> torch.Tensor:
        if self._pending is not None:
            self._result = self._decode(self._pending.wait())
            self._pending = self._decode = None
        return self._result


def quantized_all_gather_async(comm, shard: torch.Tensor, codec: PayloadCodec, out: torch.Tensor | None = None,
                               label: str = "") -> _Decoding:
    """qwZ: every rank decodes every rank's all-gathered encoding, its own too, so all hold the same
    full buffer (`specs/collectives.md` §Quantized collectives.All-gather (qwZ))."""
    flat = shard.reshape(-1)
    n, dtype, world = flat.numel(), flat.dtype, comm.world_size
    nbytes = codec.nbytes(n, dtype)
    pending = comm.all_gather_async(codec.encode(flat), label=label)

    def decode(gathered: torch.Tensor) -> torch.Tensor:
        full = out if out is not None else flat.new_empty(n * world)
        parts = gathered.view(world, nbytes)
        for r in range(world):
            full[r * n:(r + 1) * n] = codec.decode(parts[r], n, dtype)
        return full

    return _Decoding(pending, decode)


def quantized_reduce_scatter_async(comm, full: torch.Tensor, codec: PayloadCodec, label: str = "") -> _Decoding:
    """qgZ in one hop: one all-to-all of every chunk's encoding to its owner, which sums the decoded N
    in rank order (`specs/collectives.md` §Quantized collectives.Reduce-scatter (qgZ))."""
    world = comm.world_size
    flat = full.reshape(-1)
    if flat.numel() % world:
        raise ShardingError(f"reduce_scatter input of {flat.numel()} elements must be padded to the world size {world}")
    c, dtype = flat.numel() // world, flat.dtype
    nbytes = codec.nbytes(c, dtype)
    chunks = flat.view(world, c)
    pending = comm.all_to_all_async(torch.cat([codec.encode(chunks[j]) for j in range(world)]), label=label)
    work = torch.promote_types(dtype, torch.float32)

    def decode(received: torch.Tensor) -> torch.Tensor:
        parts = received.view(world, nbytes)
        total = codec.decode(parts[0], c, dtype, work)
        for r in range(1, world):
            total = total + codec.decode(parts[r], c, dtype, work)
        return total.to(dtype)

    return _Decoding(pending, decode)


class QuantizedCollectives:
    """`inner` with its all-gathers encoded by `gather` and its reduce-scatters made quantized
    all-to-alls with `reduce` (either None: as `inner` does it); every other call is `inner`'s."""

    def __init__(self, inner, gather: PayloadCodec | None = None, reduce: PayloadCodec | None = None):
        self.inner = inner
        self.gather_codec = gather
        self.reduce_codec = reduce
        self.rank = inner.rank
        self.world_size = inner.world_size

    def __getattr__(self, name):  # what else callers read of a group (its watchdog, process group)
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    def all_gather(self, shard):
        return self.all_gather_async(shard).wait()

    def all_gather_async(self, shard, out: torch.Tensor | None = None, label: str = ""):
        if self.gather_codec is None:
            return self.inner.all_gather_async(shard, out=out, label=label)
        return quantized_all_gather_async(self.inner, shard, self.gather_codec, out=out, label=label)

    def reduce_scatter(self, full, donate: bool = False):
        if self.reduce_codec is None:
            return self.inner.reduce_scatter(full, donate=donate)
        return self.reduce_scatter_async(full).wait()

    def reduce_scatter_async(self, full, label: str = ""):
        if self.reduce_codec is None:
            return self.inner.reduce_scatter_async(full, label=label)
        return quantized_reduce_scatter_async(self.inner, full, self.reduce_codec, label=label)

    def all_reduce(self, t, op="sum"):
        return self.inner.all_reduce(t, op)

    def all_reduce_async(self, t, donate: bool = False, label: str = ""):
        return self.inner.all_reduce_async(t, donate=donate, label=label)

    def broadcast(self, t, src=0):
        return self.inner.broadcast(t, src)

    def barrier(self):
        return self.inner.barrier()

    def all_to_all(self, tensor, *, input_split_sizes: Sequence[int] | None = None,
                   output_split_sizes: Sequence[int] | None = None, label: str = ""):
        return self.inner.all_to_all(tensor, input_split_sizes=input_split_sizes,
                                     output_split_sizes=output_split_sizes, label=label)

    def all_to_all_async(self, tensor, *, input_split_sizes: Sequence[int] | None = None,
                         output_split_sizes: Sequence[int] | None = None, label: str = ""):
        return self.inner.all_to_all_async(tensor, input_split_sizes=input_split_sizes,
                                           output_split_sizes=output_split_sizes, label=label)


def quantizing(comm, gather: PayloadCodec | None = None, reduce: PayloadCodec | None = None):
    """`comm` with the given codecs (`QuantizedCollectives`), or `comm` itself when there is
    nothing to quantize: no codec, or a world of one, where nothing travels."""
    if (gather is None and reduce is None) or comm is None or comm.world_size == 1:
        return comm
    return QuantizedCollectives(comm, gather, reduce)
