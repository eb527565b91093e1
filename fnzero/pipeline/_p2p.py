"""Stage-boundary messages: an activation (a tensor or a tuple of tensors) sent forward with a
small header saying what it is, its gradient sent back without one (the receiver knows the
shapes: it sent them). `specs/collectives.md` §Pipeline counts the bytes. Activations and gradients travel under two
tags, so a pair of ranks that sends both ways of the same boundary (the wrap-around of interleaved
stages) never takes one for the other.
"""

from __future__ import annotations

from typing import Any

import torch

from .._errors import ShardingError

__all__ = ["send_activation", "recv_activation", "send_grads", "recv_grads", "HEADER_NUMEL", "boundary_tensors"]

_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.bool,
           torch.uint8, torch.int8, torch.int16]
_MAX_TENSORS, _MAX_DIMS = 4, 6
_PER = 3 + _MAX_DIMS  # dtype, requires_grad, ndim, dims
HEADER_NUMEL = 2 + _MAX_TENSORS * _PER  # is-tuple flag, count, then one record per tensor
ACTIVATION, GRADIENT = 0, 1  # message tags


def boundary_tensors(x: Any, stage: int) -> tuple[list[torch.Tensor], bool]:
    """(the tensors of an activation, whether it is a tuple); a ShardingError names the stage when
    it is something a stage boundary cannot carry."""
    items, is_tuple = (list(x), True) if isinstance(x, (tuple, list)) else ([x], False)
    if not items or len(items) > _MAX_TENSORS or not all(isinstance(t, torch.Tensor) for t in items):
        raise ShardingError(
            f"pipeline stage {stage} returned {type(x).__name__}; a stage boundary carries a tensor or a tuple of "
            f"1-{_MAX_TENSORS} tensors")
    for t in items:
        if t.dim() > _MAX_DIMS or t.dtype not in _DTYPES:
            raise ShardingError(f"pipeline stage {stage} returned a {t.dim()}-d {t.dtype} tensor; a stage boundary "
                                f"carries up to {_MAX_DIMS}-d tensors of {', '.join(map(str, _DTYPES))}")
    return items, is_tuple


def send_activation(comm, x: Any, dst: int, stage: int, label: str) -> list:
    """Start sending activation `x` to stage `dst`; the pending sends (wait before reusing `x`)."""
    items, is_tuple = boundary_tensors(x, stage)
    header = torch.zeros(HEADER_NUMEL, dtype=torch.int64)
    header[0], header[1] = int(is_tuple), len(items)
    for i, t in enumerate(items):
        rec = [_DTYPES.index(t.dtype), int(t.requires_grad), t.dim(), *t.shape]
        header[2 + i * _PER: 2 + i * _PER + len(rec)] = torch.tensor(rec)
    pending = [comm.send_async(header.to(items[0].device), dst, label=f"{label}:header", tag=ACTIVATION)]
    return pending + [comm.send_async(t.detach().contiguous(), dst, label=label, tag=ACTIVATION) for t in items]


def recv_activation(comm, src: int, device: torch.device, label: str) -> Any:
    """The next activation from stage `src`; floating tensors the sender differentiates through
    require grad here, so their gradient can be sent back."""
    header = comm.recv(torch.empty(HEADER_NUMEL, dtype=torch.int64, device=device), src, label=f"{label}:header",
                       tag=ACTIVATION).cpu()
    is_tuple, count = bool(header[0]), int(header[1])
    out = []
    for i in range(count):
        rec = header[2 + i * _PER: 2 + (i + 1) * _PER].tolist()
        dtype, grad, ndim = _DTYPES[rec[0]], bool(rec[1]), rec[2]
        t = comm.recv(torch.empty(rec[3:3 + ndim], dtype=dtype, device=device), src, label=label, tag=ACTIVATION)
        out.append(t.requires_grad_(True) if grad else t)
    return tuple(out) if is_tuple else out[0]


def send_grads(comm, x: Any, dst: int, label: str) -> list:
    """Start sending the gradient of each received tensor of `x` that requires grad (zeros where
    this stage did not use it)."""
    items = list(x) if isinstance(x, tuple) else [x]
    return [comm.send_async(t.grad if t.grad is not None else torch.zeros_like(t), dst, label=label, tag=GRADIENT)
            for t in items if t.requires_grad]


def recv_grads(comm, outputs: list[torch.Tensor], src: int, label: str) -> list[torch.Tensor]:
    """The gradients of this stage's outputs that require grad, from the next stage."""
    return [comm.recv(torch.empty_like(t), src, label=label, tag=GRADIENT) for t in outputs if t.requires_grad]
