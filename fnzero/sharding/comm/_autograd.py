"""The differentiable all-to-all: its backward is the all-to-all with the split sizes swapped, so
gradients go back the way the rows came; every rank issues the same ones, in one order. Expert
parallelism dispatches tokens with it, sequence parallelism trades sequence shards for heads."""

from __future__ import annotations

from typing import Sequence

import torch

__all__ = ["all_to_all_grad"]


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm, ins, outs, label):
        ctx.comm, ctx.ins, ctx.outs, ctx.label = comm, ins, outs, label
        return comm.all_to_all(x.contiguous(), input_split_sizes=ins, output_split_sizes=outs, label=label)

    @staticmethod
    def backward(ctx, g):
        back = ctx.comm.all_to_all(g.contiguous(), input_split_sizes=ctx.outs, output_split_sizes=ctx.ins,
                                   label=ctx.label)
        return back, None, None, None, None


@torch.compiler.disable  # collectives of a thread world or process group: not traced
def all_to_all_grad(x: torch.Tensor, comm, input_split_sizes: Sequence[int] | None = None,
                    output_split_sizes: Sequence[int] | None = None, label: str = "") -> torch.Tensor:
    """`comm.all_to_all` of `x` (rows of dim 0 split by `input_split_sizes`, equal when None),
    differentiable: its backward sends the gradient back the way the rows came. Give both split
    lists or neither (the backward needs the sizes this rank receives). A world of one returns `x`."""
    if comm.world_size == 1:
        return x
    if (input_split_sizes is None) != (output_split_sizes is None):
        raise ValueError("all_to_all_grad needs both split lists or neither: backward sends the rows back")
    ins = list(input_split_sizes) if input_split_sizes is not None else None
    outs = list(output_split_sizes) if output_split_sizes is not None else None
    return _AllToAll.apply(x, comm, ins, outs, label)
