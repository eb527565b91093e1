"""The compressed all-reduce of 1-bit Adam, 0/1 Adam and 1-bit LAMB, DeepSpeed's `compressed_allreduce`
with the tensors of one call sharing its four collectives (`specs/collectives.md` §Compressed all-reduce)."""

from __future__ import annotations

import math
from typing import NamedTuple, Sequence

import torch

from ..._errors import DistributedError
from ._collectives import Collectives

__all__ = ["CompressedAllReduce", "compressed_all_reduce", "compressed_padded_numel", "compressed_bytes"]

_BIT_WEIGHTS = (128, 64, 32, 16, 8, 4, 2, 1)  # the first element of a byte is its highest bit (numpy's order)


class CompressedAllReduce(NamedTuple):
    """What `compressed_all_reduce` returns: per tensor, the flat averaged result over its padded
    length, and the new worker error (padded length) and server error (this rank's chunk)."""

    results: tuple[torch.Tensor, ...]
    worker_errors: tuple[torch.Tensor, ...]
    server_errors: tuple[torch.Tensor, ...]


def compressed_padded_numel(numel: int, world_size: int) -> int:
    """`numel` rounded up to a multiple of `N · lcm(N, 8)`: each rank's chunk is then whole
    bytes of signs (DeepSpeed's `corrected_tensor_size`)."""
    step = world_size * math.lcm(world_size, 8)
    return -(-numel // step) * step


def compressed_bytes(numels: Sequence[int], world_size: int, scale_itemsize: int = 4) -> float:
    """Ring-equivalent bytes one rank sends in one call over tensors of `numels` elements
    (`RecordingCollectives.ring_bytes_sent`; `specs/collectives.md` §Compressed all-reduce)."""
    n = world_size
    if n == 1:
        return 0.0
    sign_bytes = sum(compressed_padded_numel(m, n) for m in numels) // 8
    return 2 * (n - 1) / n * sign_bytes + 2 * (n - 1) * len(numels) * scale_itemsize


def _pack(bits: torch.Tensor) -> torch.Tensor:
    """Bool `[..., 8k]` -> uint8 `[..., k]`, 8 signs a byte."""
    w = torch.tensor(_BIT_WEIGHTS, dtype=torch.uint8, device=bits.device)
    return (bits.reshape(*bits.shape[:-1], -1, 8).to(torch.uint8) * w).sum(-1, dtype=torch.uint8)


def _unpack_signs(packed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """uint8 `[..., k]` -> ±1 `[..., 8k]` in `dtype` (bit 1 is +1)."""
    w = torch.tensor(_BIT_WEIGHTS, dtype=torch.uint8, device=packed.device)
    bits = (packed.unsqueeze(-1) & w) != 0
    return bits.reshape(*packed.shape[:-1], -1).to(dtype) * 2 - 1


def _compress(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(scale, signs as bools, error) of one buffer: scale = ‖x‖/√numel, a zero counting as +1."""
    scale = torch.linalg.vector_norm(x) / math.sqrt(x.numel()) if x.numel() else x.new_zeros(())
    positive = x >= 0
    return scale, positive, x - scale * (positive.to(x.dtype) * 2 - 1)


def _check(tensors, worker_errors, server_errors, n: int) -> None:
    if not (len(tensors) == len(worker_errors) == len(server_errors)):
        raise DistributedError(f"compressed_all_reduce: {len(tensors)} tensors, {len(worker_errors)} worker errors "
                               f"and {len(server_errors)} server errors; give one of each per tensor")
    for i, (t, we, se) in enumerate(zip(tensors, worker_errors, server_errors)):
        if t.dtype != tensors[0].dtype or t.device != tensors[0].device:
            raise DistributedError(f"compressed_all_reduce: tensor {i} is {t.dtype} on {t.device}, tensor 0 "
                                   f"{tensors[0].dtype} on {tensors[0].device}; one dtype and device per call")
        m = compressed_padded_numel(t.numel(), n)
        for what, e, want in (("worker", we, m), ("server", se, m // n)):
            if e.numel() not in (0, want):
                raise DistributedError(f"compressed_all_reduce: tensor {i}'s {what} error has {e.numel()} elements; "
                                       f"{want} (its padded length for {n} ranks) or 0 (no error yet) expected")


def compressed_all_reduce(comm: Collectives, tensors: Sequence[torch.Tensor], worker_errors: Sequence[torch.Tensor],
                          server_errors: Sequence[torch.Tensor]) -> CompressedAllReduce:
    """The mean of `tensors` over the ranks of `comm`, each sent as signs and a scale, the errors
    fed back (`specs/collectives.md` §Compressed all-reduce, steps 1-5); inputs are never written.
    Errors of 0 elements stand for zeros. Returns `CompressedAllReduce`: results flat, of the padded
    length M (the caller cuts `[:numel]`)."""
    n = comm.world_size
    _check(tensors, worker_errors, server_errors, n)
    if n == 1:
        return CompressedAllReduce(tuple(t.detach().reshape(-1).clone() for t in tensors), tuple(worker_errors),
                                   tuple(server_errors))
    if not tensors:
        return CompressedAllReduce((), (), ())
    dtype, device = tensors[0].dtype, tensors[0].device
    sizes = [compressed_padded_numel(t.numel(), n) for t in tensors]
    scales, packed, new_worker = [], [], []
    for t, we, m in zip(tensors, worker_errors, sizes):
        y = torch.cat([t.detach().reshape(-1), t.new_zeros(m - t.numel())])
        if we.numel():
            y = y + we
        scale, positive, err = _compress(y)
        scales.append(scale)
        new_worker.append(err)
        packed.append(_pack(positive.reshape(n, -1)))  # [N, M/(8N)]: row j goes to rank j
    recv = comm.all_to_all(torch.cat(packed, dim=1).contiguous()).reshape(n, -1)
    worker_scales = comm.all_gather(torch.stack(scales)).reshape(n, -1)  # [rank, tensor]
    server_scales, server_packed, new_server = [], [], []
    offset = 0
    for i, (se, m) in enumerate(zip(server_errors, sizes)):
        width = m // (8 * n)
        signs = _unpack_signs(recv[:, offset:offset + width], dtype)  # [N, M/N]
        offset += width
        z = (signs * (worker_scales[:, i] * (1 / n)).unsqueeze(1)).sum(0)
        if se.numel():
            z = z + se
        scale, positive, err = _compress(z)
        server_scales.append(scale)
        new_server.append(err)
        server_packed.append(_pack(positive))
    chunks = comm.all_gather(torch.cat(server_packed)).reshape(n, -1)
    chunk_scales = comm.all_gather(torch.stack(server_scales)).reshape(n, -1)
    results, offset = [], 0
    for i, m in enumerate(sizes):
        width = m // (8 * n)
        signs = _unpack_signs(chunks[:, offset:offset + width], dtype)
        offset += width
        results.append((signs * chunk_scales[:, i:i + 1]).reshape(-1).to(device))
    return CompressedAllReduce(tuple(results), tuple(new_worker), tuple(new_server))
