"""A causal language model's loss on one rank's run of the tokens: its share of the group's mean
(`specs/mesh.md` §Sequence, The loss)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..._errors import ShardingError
from ._layout import SPLayout

__all__ = ["causal_lm_loss_share"]


def causal_lm_loss_share(layout: SPLayout, cross_entropy=None):
    """A transformers `loss_function` for a model whose ranks each hold a run of the tokens: the
    cross-entropy summed over this rank's `shift_labels` (the labels shifted before the sequence was
    cut, so a run's last label is the next run's first token), divided by the valid labels of the
    whole group (`num_items_in_batch` when given). Float64 logits stay float64; 16-bit ones are
    taken to float32, as transformers' loss does. `cross_entropy(logits, targets, ignore_index)`:
    the summed cross-entropy (default torch's; the vocabulary-parallel one for a split LM head)."""

    def loss_function(logits, labels=None, vocab_size=None, num_items_in_batch=None, ignore_index=-100,
                      shift_labels=None, **kwargs):
        if shift_labels is None:
            raise ShardingError("with sequence parallelism the labels are shifted before the sequence is cut (a run's "
                                "last label is the next run's first token): pass shift_labels= too, as "
                                "fnzero.shard_sequence makes them")
        if logits.dtype in (torch.float16, torch.bfloat16):
            logits = logits.float()
        targets = shift_labels.to(logits.device)
        if cross_entropy is not None:
            total = cross_entropy(logits, targets, ignore_index)
        else:
            total = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1),
                                    ignore_index=ignore_index, reduction="sum")
        if num_items_in_batch is not None:
            return total / num_items_in_batch
        return layout.loss_share(total, (targets != ignore_index).sum())

    return loss_function
