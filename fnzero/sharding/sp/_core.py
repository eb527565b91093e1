"""Causal attention over a whole sequence for the heads a rank holds, with the masks transformers
builds for sdpa: padding, a sliding window and packed documents (`specs/mesh.md` §Sequence)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["whole_sequence_attention", "block_masks"]


def whole_sequence_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float | None = None,
                             dropout: float = 0.0, padding: torch.Tensor | None = None,
                             position_ids: torch.Tensor | None = None,
                             sliding_window: int | None = None) -> torch.Tensor:
    """(b, heads, s, d) of causal attention over q (b, heads, s, d) and k, v (b, kv heads, s, d),
    kv heads shared by groups of q heads (grouped-query attention).

    `padding` (b, s), true at tokens: keys at padding are masked. `position_ids` (b, s): where they
    do not step by one a new document starts, and tokens attend only within theirs (as transformers
    detects packed sequences: only without padding). `sliding_window`: a query sees the keys less
    than that many positions back. Without any of them, torch's causal kernel runs unmasked."""
    s = q.shape[-2]
    mask = None
    if sliding_window is not None and sliding_window < s:
        i = torch.arange(s, device=q.device)
        mask = (i[:, None] >= i[None, :]) & (i[:, None] - i[None, :] < sliding_window)
    if padding is not None and not bool(padding.all()):
        mask = _and(mask, padding.bool()[:, None, None, :], s, q.device)
    elif padding is None and position_ids is not None:
        docs = _documents(position_ids)
        if docs is not None:
            mask = _and(mask, (docs[:, :, None] == docs[:, None, :])[:, None], s, q.device)
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, dropout_p=dropout,
                                              enable_gqa=q.shape[1] != k.shape[1])
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, dropout_p=dropout,
                                          enable_gqa=q.shape[1] != k.shape[1])


def _and(mask: torch.Tensor | None, extra: torch.Tensor, s: int, device) -> torch.Tensor:
    """`extra` and the causal mask (or `mask`, already causal)."""
    if mask is None:
        mask = torch.ones(s, s, dtype=torch.bool, device=device).tril()
    return mask & extra


def _documents(position_ids: torch.Tensor) -> torch.Tensor | None:
    """Each token's document index from position ids that restart (transformers'
    `find_packed_sequence_indices`), or None when every row is one document."""
    if position_ids.ndim == 1:
        position_ids = position_ids[None]
    steps = torch.diff(position_ids, prepend=position_ids[:, :1] - 1, dim=-1)
    docs = (steps != 1).cumsum(-1)
    return None if bool((docs[:, -1] == 0).all()) else docs


def block_masks(padding: torch.Tensor | None, position_ids: torch.Tensor | None, sliding_window: int | None,
                chunk: int, device: torch.device):
    """`block_mask(i, j)` for ring attention over runs of `chunk` tokens: the same masks as
    `whole_sequence_attention` (causal; padding; else packed documents; a sliding window), for run
    i's queries against run j's keys: False where none is seen (the block is skipped), None where all
    are, else a (b, 1, chunk, chunk) or (chunk, chunk) bool tensor. `padding` and `position_ids`
    are the whole sequence's (b, s)."""
    if padding is not None and bool(padding.all()):
        padding = None
    docs = _documents(position_ids) if padding is None and position_ids is not None else None

    def block_mask(i: int, j: int):
        if j > i or (sliding_window is not None and (i - j - 1) * chunk + 1 >= sliding_window):
            return False  # in the future, or every key out of the window
        q_pos = i * chunk + torch.arange(chunk, device=device)
        gap = q_pos[:, None] - (j * chunk + torch.arange(chunk, device=device))[None, :]
        mask = gap >= 0 if i == j else None
        if sliding_window is not None and (i - j + 1) * chunk - 1 >= sliding_window:  # some keys out of it
            mask = (gap < sliding_window) if mask is None else mask & (gap < sliding_window)
        if padding is not None:
            mask = _and_opt(mask, padding.bool()[:, None, None, j * chunk:(j + 1) * chunk])
        if docs is not None:
            same = docs[:, i * chunk:(i + 1) * chunk, None] == docs[:, None, j * chunk:(j + 1) * chunk]
            mask = _and_opt(mask, same[:, None]) if not bool(same.all()) else mask
        return mask

    return block_mask


def _and_opt(mask: torch.Tensor | None, extra: torch.Tensor) -> torch.Tensor:
    return extra if mask is None else mask & extra
