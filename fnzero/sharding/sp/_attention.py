"""Where a model's attention meets the sequence axis: fnzero's `CausalAttention` module and the
attention and mask functions registered with transformers (`specs/mesh.md` §Sequence)."""

from __future__ import annotations

import functools
import weakref

import torch
import torch.nn.functional as F
from torch import nn

from ..._errors import ShardingError
from ._core import whole_sequence_attention
from ._layout import SPLayout
from ._ulysses import ulysses_attention

__all__ = ["CausalAttention", "ATTENTION_KEY", "route", "layout_of", "hf_attention", "hf_mask"]

# The name fnzero's functions are registered under with transformers' AttentionInterface and
# AttentionMaskInterface; a model routed to them has it as its `attn_implementation`.
ATTENTION_KEY = "fnzero_sequence_parallel"

# Each routed model's modules -> its sequence axis. Module state by design: transformers calls the
# registered attention function from a process-wide table, with only the calling module to say
# which model (and so which rank's group, in a simulated world) it serves; weak, so a model
# dropped is forgotten (torch's composable APIs keep their per-module state the same way).
_ROUTED: "weakref.WeakKeyDictionary[nn.Module, SPLayout]" = weakref.WeakKeyDictionary()


def route(model: nn.Module, layout: SPLayout) -> None:
    """Make `model`'s attention (its `CausalAttention` modules, its transformers attention) run over
    `layout`'s ranks."""
    for module in model.modules():
        _ROUTED[module] = layout


def layout_of(module: nn.Module) -> SPLayout | None:
    return _ROUTED.get(module)


class CausalAttention(nn.Module):
    """Causal scaled-dot-product attention of q (b, heads, s, d) and k, v (b, kv heads, s, d), no
    parameters: in a model sharded with a sequence axis each rank holds a run of the tokens and
    attention spans them all (Ulysses); otherwise torch's causal SDPA."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        layout = _ROUTED.get(self)
        if layout is None or layout.size == 1:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])
        return ulysses_attention(q, k, v, layout.comm, whole_sequence_attention)


def hf_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                 sliding_window: int | None = None, softcap: float | None = None, is_causal: bool | None = None,
                 **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention function for a model routed over a sequence axis: (b, s/sp, heads, d),
    None, as its sdpa function returns. The padding mask and position ids of every rank's tokens are
    gathered over the group first."""
    layout = _ROUTED.get(module)
    if layout is None:
        raise ShardingError(f"this {type(module).__name__}'s model has attn_implementation {ATTENTION_KEY!r} but was "
                            "not sharded with a sequence axis by fnzero.shard; set its attn_implementation back")
    if softcap is not None:
        raise ShardingError(f"{type(module).__name__} caps attention logits (softcap {softcap}); fnzero's "
                            "sequence-parallel attention runs torch's SDPA, which has no cap")
    if not (is_causal if is_causal is not None else getattr(module, "is_causal", True)):
        raise ShardingError(f"{type(module).__name__} attends both ways; fnzero's sequence parallelism is for causal "
                            "(decoder) attention")
    if attention_mask is not None and attention_mask.ndim != 2:
        raise ShardingError(f"{type(module).__name__} got a {attention_mask.ndim}-D attention mask; with sequence "
                            "parallelism give the 2-D padding mask (batch, tokens) and fnzero builds the rest")
    position_ids = kwargs.get("position_ids")
    attend = functools.partial(
        whole_sequence_attention, scale=scaling, dropout=dropout, sliding_window=sliding_window,
        padding=layout.gather_sequence(attention_mask) if attention_mask is not None else None,
        position_ids=layout.gather_sequence(position_ids.expand(query.shape[0], -1))
        if position_ids is not None else None)
    if layout.size == 1:
        out = attend(query, key, value)
    else:
        out = ulysses_attention(query, key, value, layout.comm, attend)
    return out.transpose(1, 2).contiguous(), None


def hf_mask(attention_mask: torch.Tensor | None = None, **kwargs) -> torch.Tensor | None:
    """transformers' mask function for the same key: the 2-D padding mask as given (None: no padding);
    `hf_attention` builds the causal, window and document masks over the whole sequence."""
    return attention_mask
