"""Where a model's attention meets the sequence axis: fnzero's `CausalAttention` module and the
attention and mask functions registered with transformers (`specs/mesh.md` §Sequence)."""

from __future__ import annotations

import functools
import weakref

import torch
import torch.nn.functional as F
from torch import nn

from ..._errors import ShardingError
from ._core import block_masks, whole_sequence_attention
from ._layout import SPLayout
from ._ring import Ring, ring_attention
from ._ulysses import ulysses_attention, ulysses_size

__all__ = ["CausalAttention", "ATTENTION_KEY", "route", "layout_of", "hf_attention", "hf_mask", "sequence_attention",
           "token_positions"]

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


def token_positions(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The places 0, 1, ... of `x`'s tokens (dim 1) in the whole sequence: from this rank's run
    when `module` is routed over a sequence axis (a pipeline's layers, which pass no position ids)."""
    layout = _ROUTED.get(module)
    start = layout.rank * x.shape[1] if layout is not None else 0
    return torch.arange(start, start + x.shape[1], device=x.device)


class CausalAttention(nn.Module):
    """Causal scaled-dot-product attention of q (b, heads, s, d) and k, v (b, kv heads, s, d), no
    parameters: in a model sharded with a sequence axis each rank holds a run of the tokens and
    attention spans them all (Ulysses, ring, or both: `sequence_attention`); otherwise torch's causal
    SDPA."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        layout = _ROUTED.get(self)
        if layout is None or layout.size == 1:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])
        return sequence_attention(q, k, v, layout)


def sequence_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: SPLayout, *,
                       scale: float | None = None, dropout: float = 0.0, padding: torch.Tensor | None = None,
                       position_ids: torch.Tensor | None = None, sliding_window: int | None = None,
                       where: str = "attention") -> torch.Tensor:
    """Causal attention over the whole sequence of q (b, h, s/sp, d) and k, v (b, kv, s/sp, d), this
    rank's run of the tokens; `padding` and `position_ids` (b, s/sp) are this rank's too. The sp
    ranks split into Ulysses groups of U adjacent ranks (U: `ulysses_size` of the heads) and rings
    of sp/U: each group trades its runs for heads, and each ring passes keys and values around for
    the group's share of the heads (`specs/mesh.md` §Sequence)."""
    n, rank = layout.size, layout.rank
    u = ulysses_size(n, q.shape[1], k.shape[1])
    padding = layout.gather_sequence(padding) if padding is not None else None
    position_ids = layout.gather_sequence(position_ids.expand(q.shape[0], -1)) if position_ids is not None else None
    if u == n:
        attend = functools.partial(whole_sequence_attention, scale=scale, dropout=dropout, padding=padding,
                                   position_ids=position_ids, sliding_window=sliding_window)
        return ulysses_attention(q, k, v, layout.comm, attend)
    if dropout:
        raise ShardingError(f"{where} has attention dropout {dropout}, which fnzero's ring attention does not draw "
                            f"({q.shape[1]} heads over {n} sequence-parallel ranks need the ring); set it to 0 for "
                            "training with sequence parallelism")
    rings = n // u
    ring = Ring(tuple(g * u + rank % u for g in range(rings)), rank // u)
    masks = block_masks(padding, position_ids, sliding_window, q.shape[2] * u, q.device)
    attend = functools.partial(ring_attention, comm=layout.comm, ring=ring, block_mask=masks, scale=scale)
    if u == 1:
        return attend(q, k, v)
    return ulysses_attention(q, k, v, layout.comm, attend, group=(rank - rank % u, u))


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
    out = sequence_attention(query, key, value, layout, scale=scaling, dropout=dropout, padding=attention_mask,
                             position_ids=kwargs.get("position_ids"), sliding_window=sliding_window,
                             where=type(module).__name__)
    return out.transpose(1, 2).contiguous(), None


def hf_mask(attention_mask: torch.Tensor | None = None, **kwargs) -> torch.Tensor | None:
    """transformers' mask function for the same key: the 2-D padding mask as given (None: no padding);
    `hf_attention` builds the causal, window and document masks over the whole sequence."""
    return attention_mask
