"""`dtype=torch.int8`: weight-only int8 quantisation of a model's linear layers (`specs/inference.md`
§int8): each chosen layer computes `(x @ q) * s + b`, holding no dequantised weight; its weight is
frozen, hence whole per rank, and replaced by its int8 form in the state's `frozen`."""

from __future__ import annotations

import collections

import torch
from torch import nn

from ..sharding import ColumnParallelLinear, RowParallelLinear, copy_to_tp, gather_from_tp, reduce_from_tp

__all__ = ["Int8Linear", "int8_targets", "quantize_weight", "quantize_model"]

QMAX = 127


def _layout(module: nn.Module) -> str | None:
    """"out_in" (torch's Linear), "in_out" (Hugging Face's Conv1D), else None: not a linear layer."""
    if isinstance(module, (nn.Linear, ColumnParallelLinear, RowParallelLinear)):
        return getattr(module, "weight_layout", "out_in")
    if type(module).__name__ == "Conv1D" and isinstance(getattr(module, "weight", None), torch.Tensor):
        return "in_out"
    return None


def int8_targets(model: nn.Module) -> list[str]:
    """The paths of the linear layers int8 quantises: every Linear and Conv1D inside the model with
    a 2-D weight of its own, except the model's output head (`get_output_embeddings()`, kept in float as is usual for
    weight-only quantisation: its error lands on the logits directly) and weights tied to another
    module (an LM head tied to the embedding is read by the lookup too)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    uses = collections.Counter(id(p) for _, p in model.named_parameters(remove_duplicate=False))
    return [path for path, m in model.named_modules()  # the root itself is no layer of a model: kept
            if path and m is not head and _layout(m) is not None and m.weight.dim() == 2 and uses[id(m.weight)] == 1]


def quantize_weight(weight: torch.Tensor, layout: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 values, scales in the weight's dtype): one symmetric scale per output channel (a row of
    an out_in weight, a column of an in_out one); an all-zero channel gets scale 1 and zeros."""
    wide = weight.detach().to(torch.float64 if weight.dtype == torch.float64 else torch.float32)
    amax = wide.abs().amax(dim=1 if layout == "out_in" else 0, keepdim=True)
    scale = torch.where(amax > 0, amax / QMAX, torch.ones_like(amax))
    q = torch.round(wide / scale).clamp_(-QMAX, QMAX).to(torch.int8)
    return q, scale.to(weight.dtype)


class Int8Linear(nn.Module):
    """A linear layer (plain, column- or row-parallel) whose weight is int8 with per-output-channel
    scales: `weight` and `bias` keep the replaced layer's names, `weight_scale` is new. Its tensors
    are placeholders here: `ShardedModule.apply` binds the state's."""

    def __init__(self, like: nn.Module, layout: str, scale_shape: tuple[int, ...], dtype: torch.dtype):
        super().__init__()
        self.register_buffer("weight", torch.empty(like.weight.shape, dtype=torch.int8, device="meta"))
        self.register_buffer("weight_scale", torch.empty(scale_shape, dtype=dtype, device="meta"))
        self.bias = like.bias
        self.weight_layout = layout
        self.tp = "column" if isinstance(like, ColumnParallelLinear) else "row" if isinstance(like, RowParallelLinear) else None
        self.comm = getattr(like, "comm", None)
        self.gather_sizes = getattr(like, "gather_sizes", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp == "column":
            x = copy_to_tp(x, self.comm)
        q = self.weight.to(x.dtype)
        y = (x @ q.T if self.weight_layout == "out_in" else x @ q) * self.weight_scale.reshape(-1)
        if self.tp == "row":
            y = reduce_from_tp(y, self.comm)
        if self.bias is not None:
            y = y + self.bias
        if self.tp == "column" and self.gather_sizes is not None:
            y = gather_from_tp(y, self.comm, self.gather_sizes)
        return y

    def extra_repr(self) -> str:
        return f"int8 weight {tuple(self.weight.shape)} ({self.weight_layout}), per-channel scales, tp={self.tp}"


def quantize_model(module: nn.Module, frozen: dict[str, torch.Tensor], targets: list[str]) -> dict[str, torch.Tensor]:
    """The frozen tensors with each target's float weight replaced by its int8 values and scales,
    and each target layer of `module` (a sharded model, whose layers hold placeholders) replaced by
    its `Int8Linear`, in place. The float weights are dropped as they are quantised."""
    out = dict(frozen)
    for path in targets:
        layer = module.get_submodule(path)
        layout = _layout(layer)
        q, scale = quantize_weight(out.pop(f"{path}.weight"), layout)
        out[f"{path}.weight"], out[f"{path}.weight_scale"] = q, scale
        parent, _, child = path.rpartition(".")
        setattr(module.get_submodule(parent) if parent else module, child,
                Int8Linear(layer, layout, tuple(scale.shape), scale.dtype))
    return out
