"""A causal language model's loss with the logits made a few tokens at a time: its decoder's hidden
states, then the head and the cross-entropy tile by tile, each tile recomputed in backward, so the
logits never exist whole (`specs/mesh.md` §Sequence, Tiled loss)."""

from __future__ import annotations

import math
from typing import Callable

import torch
from torch import nn

from ..._errors import ShardingError
from ..zero import remat
from ._data import shifted_labels
from ._layout import SPLayout

__all__ = ["tiled_causal_lm_loss"]

# Config fields of transformers models whose logits are more than the head's output (Gemma 2/3's
# soft cap, Cohere's scale, Granite's divisor): the tiled loss would leave them out.
_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling")


def tiled_causal_lm_loss(model: nn.Module, *, tiles: int | str, layout: SPLayout | None,
                         cross_entropy: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], ignore_index: int = -100,
                         labels: torch.Tensor | None = None, shift_labels: torch.Tensor | None = None,
                         **inputs) -> torch.Tensor:
    """The mean cross-entropy of `model`'s next-token logits over the valid labels (with a sequence
    axis, this rank's share of its group's mean), from its decoder's hidden states and its output
    embeddings `tiles` runs of tokens at a time; `cross_entropy(logits, targets)` sums a tile's."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if decoder is None or head is None or decoder is model:
        raise ShardingError(f"causal_lm_loss runs a transformers causal LM's decoder and then its head; "
                            f"{type(model).__name__} has no get_decoder()/get_output_embeddings() pair")
    config = getattr(model, "config", None)
    for key in _LOGIT_TRANSFORMS:
        if getattr(config, key, None) not in (None, 1, 1.0):
            raise ShardingError(f"{type(model).__name__} applies {key}={getattr(config, key)} to its logits, which "
                                "causal_lm_loss's tiles leave out; use the model's own loss (sm.apply(...).loss)")
    targets = _shifted(labels, shift_labels, layout, ignore_index)
    if layout is not None and inputs.get("position_ids") is None:
        raise ShardingError(f"{type(model).__name__} is sharded over {layout.size} sequence-parallel ranks: each holds a "
                            "run of the tokens, so causal_lm_loss needs position_ids (fnzero.shard_sequence adds them)")
    hidden = decoder(**inputs, use_cache=False).last_hidden_state
    if hidden.shape[1] != targets.shape[1]:
        raise ShardingError(f"causal_lm_loss: {hidden.shape[1]} tokens of hidden states but {targets.shape[1]} labels")
    n = _tile_count(tiles, hidden.shape[1], head)
    per = math.ceil(hidden.shape[1] / n)

    def tile_loss(h: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        logits = head(h)
        return cross_entropy(logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits, y)

    total = sum(remat(tile_loss)(hidden[:, a:a + per], targets[:, a:a + per]) for a in range(0, hidden.shape[1], per))
    count = (targets != ignore_index).sum()
    if layout is not None:
        return layout.loss_share(total, count)
    return total / count.clamp_min(1).to(total.dtype)


def _shifted(labels, shift_labels, layout, ignore_index):
    if shift_labels is not None:
        return shift_labels
    if labels is None:
        raise ShardingError("causal_lm_loss needs labels= (or shift_labels=, the labels already shifted)")
    if layout is not None:
        raise ShardingError("with sequence parallelism the labels are shifted before the sequence is cut: pass "
                            "shift_labels= too, as fnzero.shard_sequence makes them")
    return shifted_labels(labels, ignore_index)


def _tile_count(tiles: int | str, tokens: int, head: nn.Module) -> int:
    if tiles == "auto":  # a tile's logits about the size of the hidden states
        weight = head.weight
        return max(1, min(tokens, math.ceil(weight.shape[0] / max(1, weight.shape[1]))))
    if isinstance(tiles, bool) or not isinstance(tiles, int) or tiles < 1:
        raise ShardingError(f"causal_lm_loss: tiles must be a positive integer or 'auto', got {tiles!r}")
    return min(tiles, tokens)
