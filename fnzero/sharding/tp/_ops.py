"""Tensor parallelism's differentiable collectives, Megatron's f and g, and the vocabulary-parallel
lookup and cross-entropy (`specs/mesh.md §Tensor parallelism`), each over the tp `Collectives` given.
Every rank issues the same collectives in forward and backward, in one order."""

from __future__ import annotations

from typing import Sequence

import torch

__all__ = ["copy_to_tp", "reduce_from_tp", "gather_from_tp", "vocab_parallel_embedding",
           "vocab_parallel_cross_entropy", "split_sizes"]


def split_sizes(n: int, parts: int) -> list[int]:
    """How `n` elements split over `parts` ranks: as `torch.tensor_split`, the first n % parts
    ranks get one more."""
    q, r = divmod(n, parts)
    return [q + (i < r) for i in range(parts)]


class _CopyToTP(torch.autograd.Function):
    """f: identity forward; backward all-reduces the gradient (each rank's layer used the input)."""

    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return ctx.comm.all_reduce(g.contiguous()), None


class _ReduceFromTP(torch.autograd.Function):
    """g: all-reduce forward (partial sums of a row-parallel layer); identity backward."""

    @staticmethod
    def forward(ctx, x, comm):
        return comm.all_reduce(x.contiguous())

    @staticmethod
    def backward(ctx, g):
        return g, None


class _GatherFromTP(torch.autograd.Function):
    """Concatenate every rank's last-dimension slice (sizes may differ by one); backward keeps
    this rank's slice of the gradient."""

    @staticmethod
    def forward(ctx, x, comm, sizes):
        ctx.lo = sum(sizes[: comm.rank])
        ctx.n = sizes[comm.rank]
        width = max(sizes)
        padded = x.new_zeros(*x.shape[:-1], width)
        padded[..., : x.shape[-1]] = x
        parts = comm.all_gather(padded.reshape(-1)).view(len(sizes), *x.shape[:-1], width)
        return torch.cat([parts[i, ..., :s] for i, s in enumerate(sizes)], dim=-1)

    @staticmethod
    def backward(ctx, g):
        return g[..., ctx.lo: ctx.lo + ctx.n].contiguous(), None, None


@torch.compiler.disable  # collectives of a thread world or process group: not traced
def copy_to_tp(x: torch.Tensor, comm) -> torch.Tensor:
    """Enter a column-parallel region: the same `x` on every rank, its gradient summed over them."""
    return _CopyToTP.apply(x, comm) if comm.world_size > 1 else x


@torch.compiler.disable  # collectives of a thread world or process group: not traced
def reduce_from_tp(x: torch.Tensor, comm) -> torch.Tensor:
    """Leave a row-parallel region: the sum of every rank's partial result."""
    return _ReduceFromTP.apply(x, comm) if comm.world_size > 1 else x


@torch.compiler.disable  # collectives of a thread world or process group: not traced
def gather_from_tp(x: torch.Tensor, comm, sizes: Sequence[int]) -> torch.Tensor:
    """Every rank's last-dimension slice, concatenated in rank order."""
    return _GatherFromTP.apply(x, comm, list(sizes)) if comm.world_size > 1 else x


@torch.compiler.disable  # collectives of a thread world or process group: not traced
def vocab_parallel_embedding(ids: torch.Tensor, weight: torch.Tensor, start: int, comm,
                             padding_idx: int | None = None) -> torch.Tensor:  # fmt: skip
    """Look `ids` up in a table whose rows `[start, start + len(weight))` this rank holds: rows
    outside contribute zeros, and one all-reduce sums the ranks' parts."""
    end = start + weight.shape[0]
    outside = (ids < start) | (ids >= end)
    local = torch.where(outside, torch.zeros_like(ids), ids - start)
    pad = padding_idx - start if padding_idx is not None and start <= padding_idx < end else None
    if weight.shape[0]:
        out = torch.nn.functional.embedding(local, weight, padding_idx=pad).masked_fill(outside.unsqueeze(-1), 0.0)
    else:  # no rows on this rank: only its part of the sum, zeros (kept in the graph for the weight's gradient)
        out = (weight.sum() * 0).expand(*ids.shape, weight.shape[1]).clone()
    return reduce_from_tp(out, comm)


class _VocabParallelCE(torch.autograd.Function):
    """Per-token cross-entropy of logits split over the vocabulary (this rank: columns
    `[start, start + V_local)`), never all-reducing the logits themselves."""

    @staticmethod
    def forward(ctx, logits, target, start, comm, ignore_index):
        n = logits.shape[-1]  # may be 0: a rank with no vocabulary entries
        m = logits.max(dim=-1).values if n else logits.new_full(logits.shape[:-1], -torch.inf)
        m = comm.all_reduce(m.contiguous(), op="max")
        z = logits - m.unsqueeze(-1)
        ez = z.exp()
        sum_ez = comm.all_reduce(ez.sum(dim=-1).contiguous())
        local = target - start
        mine = (local >= 0) & (local < n)
        idx = torch.where(mine, local, torch.zeros_like(local)).unsqueeze(-1)
        z_t = torch.where(mine, z.gather(-1, idx).squeeze(-1), torch.zeros_like(m)) if n else torch.zeros_like(m)
        z_t = comm.all_reduce(z_t.contiguous())
        ignored = target == ignore_index
        loss = torch.where(ignored, torch.zeros_like(m), sum_ez.log() - z_t)
        ctx.save_for_backward(ez, sum_ez, idx, mine, ignored)
        return loss

    @staticmethod
    def backward(ctx, g):
        ez, sum_ez, idx, mine, ignored = ctx.saved_tensors
        grad = ez / sum_ez.unsqueeze(-1)
        onehot = torch.zeros_like(grad)
        if grad.shape[-1]:
            onehot.scatter_(-1, idx, mine.unsqueeze(-1).to(grad.dtype))
        scale = torch.where(ignored, torch.zeros_like(g), g).unsqueeze(-1)
        return (grad - onehot) * scale, None, None, None, None


@torch.compiler.disable  # collectives of a thread world or process group: not traced
def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, start: int, comm,
                                 ignore_index: int = -100, reduction: str = "mean") -> torch.Tensor:  # fmt: skip
    """`torch.nn.functional.cross_entropy(full_logits, target)` from this rank's vocabulary slice
    of the logits (columns `[start, start + logits.shape[-1])`), without gathering them: the same
    value on every rank of `comm`. `reduction`: mean over non-ignored targets, sum, or none."""
    tgt = target.reshape(-1)
    flat = logits.reshape(tgt.numel(), logits.shape[-1])
    if comm.world_size > 1:
        loss = _VocabParallelCE.apply(flat, tgt, start, comm, ignore_index)
    else:
        loss = torch.nn.functional.cross_entropy(flat, tgt, ignore_index=ignore_index, reduction="none")
    if reduction == "none":
        return loss.view(target.shape)
    if reduction == "sum":
        return loss.sum()
    return loss.sum() / (tgt != ignore_index).sum().to(loss.dtype)  # nan when every target is ignored, as torch
