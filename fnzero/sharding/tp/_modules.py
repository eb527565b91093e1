"""The layers a tensor-parallel model is made of, each keeping the replaced layer's parameter names
(`specs/mesh.md §Tensor parallelism`). `weight_layout`: "out_in" for torch's Linear, "in_out" for
Hugging Face's Conv1D (GPT-2), whose weight is stored transposed."""

from __future__ import annotations

import torch
from torch import nn

from ._ops import copy_to_tp, gather_from_tp, reduce_from_tp, vocab_parallel_embedding

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding"]


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, layout: str) -> torch.Tensor:
    if layout == "in_out":
        y = x @ weight
        return y + bias if bias is not None else y
    return nn.functional.linear(x, weight, bias)


class ColumnParallelLinear(nn.Module):
    """y = x Wᵀ + b with W's output rows split over the tensor-parallel ranks: each rank computes
    its slice of y; the input's gradient is summed over the ranks. `gather_sizes`: concatenate
    every rank's slice (the sizes of each) so the output is whole; None keeps it split."""

    def __init__(self, weight: nn.Parameter, bias: nn.Parameter | None, comm, weight_layout: str = "out_in",
                 gather_sizes: list[int] | None = None):  # fmt: skip
        super().__init__()
        self.weight, self.bias = weight, bias
        self.comm, self.weight_layout, self.gather_sizes = comm, weight_layout, gather_sizes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = _linear(copy_to_tp(x, self.comm), self.weight, self.bias, self.weight_layout)
        return gather_from_tp(y, self.comm, self.gather_sizes) if self.gather_sizes is not None else y

    def extra_repr(self) -> str:
        return f"local weight {tuple(self.weight.shape)}, tp={self.comm.world_size}, gather={self.gather_sizes is not None}"


class RowParallelLinear(nn.Module):
    """y = x Wᵀ + b with W's input columns split over the tensor-parallel ranks: each rank takes
    its slice of x (a column-parallel layer's output), one all-reduce sums the partial products,
    and the bias (whole on every rank) is added once after it."""

    def __init__(self, weight: nn.Parameter, bias: nn.Parameter | None, comm, weight_layout: str = "out_in"):
        super().__init__()
        self.weight, self.bias = weight, bias
        self.comm, self.weight_layout = comm, weight_layout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = reduce_from_tp(_linear(x, self.weight, None, self.weight_layout), self.comm)
        return y + self.bias if self.bias is not None else y

    def extra_repr(self) -> str:
        return f"local weight {tuple(self.weight.shape)}, tp={self.comm.world_size}"


class VocabParallelEmbedding(nn.Module):
    """An embedding whose rows `[start, start + len(weight))` this rank holds; lookups outside give
    zeros, summed over the ranks by one all-reduce."""

    def __init__(self, weight: nn.Parameter, start: int, comm, padding_idx: int | None = None):
        super().__init__()
        self.weight, self.start, self.comm, self.padding_idx = weight, start, comm, padding_idx

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_embedding(ids, self.weight, self.start, self.comm, self.padding_idx)

    def extra_repr(self) -> str:
        return f"rows [{self.start}, {self.start + self.weight.shape[0]}), tp={self.comm.world_size}"
