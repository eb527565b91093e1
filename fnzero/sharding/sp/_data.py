"""Cutting a batch along the sequence for the sequence-parallel ranks (`specs/mesh.md` §Sequence, The data)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from ..._errors import ShardingError
from ._layout import SPLayout

__all__ = ["shard_sequence", "shifted_labels"]

_TOKEN_KEYS = ("input_ids", "labels", "attention_mask", "position_ids", "shift_labels", "token_type_ids")


def shard_sequence(batch: Any, layout: SPLayout | None, *, ignore_index: int = -100, pad_to_multiple: bool = False,
                   pad_id: int = 0) -> Any:
    """This rank's run of every sample's tokens, from the whole micro-batch (every rank of the group
    gives the same one).

    A dict (`input_ids`, and `labels`, `attention_mask`, `position_ids` where given) comes back with
    each (batch, tokens) tensor cut to this rank's run, `position_ids` added when absent (0, 1, ...
    as transformers counts them), and `shift_labels`: the labels shifted by one over the whole
    sequence before the cut, so each run's last label is the next run's first token (as DeepSpeed's
    `UlyssesSPDataLoaderAdapter`). A tuple or list of (batch, tokens) tensors (inputs and targets
    already shifted) comes back cut, with the position ids appended. `layout` None (no sequence
    axis) cuts nothing.

    `pad_to_multiple`: right-pad the tokens to a multiple of the ranks (`pad_id`, labels
    `ignore_index`, the attention mask 0) instead of refusing a length they do not divide. A
    ShardingError names a batch whose tensors disagree on their length, and a sample whose run on
    some rank holds only padding."""
    size = layout.size if layout is not None else 1
    if isinstance(batch, (tuple, list)):
        parts = [_checked(x, f"item {i} of the {type(batch).__name__}") for i, x in enumerate(batch)]
        length = _one_length({str(i): x for i, x in enumerate(parts)})
        positions = torch.arange(length, device=parts[0].device).expand(parts[0].shape[0], -1)
        return type(batch)(_cut(x, layout) for x in (*parts, positions))
    if not isinstance(batch, dict) or "input_ids" not in batch:
        raise ShardingError(f"shard_sequence takes a dict with input_ids, or a tuple of (batch, tokens) tensors; got "
                            f"{type(batch).__name__}")
    out = {k: v for k, v in batch.items()}
    tokens = {k: _checked(v, repr(k)) for k, v in out.items() if k in _TOKEN_KEYS and v is not None}
    length = _one_length(tokens)
    if pad_to_multiple and length % size:
        extra = size - length % size
        fill = {"labels": ignore_index, "shift_labels": ignore_index, "attention_mask": 0}
        tokens = {k: _padded(v, extra, fill.get(k, pad_id), k == "position_ids") for k, v in tokens.items()}
        length += extra
    if layout is not None:
        layout.shard_range(length)  # the length check, before anything is cut
    ids = tokens["input_ids"]
    tokens.setdefault("position_ids", torch.arange(length, device=ids.device).expand(ids.shape[0], -1))
    if "labels" in tokens and "shift_labels" not in tokens:
        tokens["shift_labels"] = shifted_labels(tokens["labels"], ignore_index)
    if "attention_mask" in tokens and layout is not None:
        _check_no_empty_run(tokens["attention_mask"], layout)
    out.update({k: _cut(v, layout) for k, v in tokens.items()})
    return out


def shifted_labels(labels: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """Position t's target is label t+1 (the next token's); the last has none (`ignore_index`)."""
    return F.pad(labels, (0, 1), value=ignore_index)[:, 1:]


def _padded(x: torch.Tensor, extra: int, value: int, counting: bool) -> torch.Tensor:
    """`x` right-padded by `extra` tokens of `value`; position ids go on counting."""
    if counting:
        return torch.cat([x, x[:, -1:] + torch.arange(1, extra + 1, device=x.device)], dim=1)
    return F.pad(x, (0, extra), value=value)


def _checked(x: Any, what: str) -> torch.Tensor:
    if not isinstance(x, torch.Tensor) or x.ndim != 2:
        got = f"a {x.ndim}-D tensor" if isinstance(x, torch.Tensor) else type(x).__name__
        raise ShardingError(f"shard_sequence: {what} must be a (batch, tokens) tensor, got {got}")
    return x


def _one_length(tokens: dict[str, torch.Tensor]) -> int:
    lengths = {k: v.shape[1] for k, v in tokens.items()}
    if len(set(lengths.values())) > 1:
        raise ShardingError(f"shard_sequence: the tensors disagree on the sequence length: "
                            f"{', '.join(f'{k} {n}' for k, n in lengths.items())}")
    return next(iter(lengths.values()))


def _cut(x: torch.Tensor, layout: SPLayout | None) -> torch.Tensor:
    if layout is None:
        return x
    start, stop = layout.shard_range(x.shape[1])
    return x[:, start:stop].contiguous()


def _check_no_empty_run(mask: torch.Tensor, layout: SPLayout) -> None:
    """Refuse a sample whose run on some rank is all padding: that rank would compute nothing of use,
    and a left-padded one would have no key to attend to."""
    runs = mask.reshape(mask.shape[0], layout.size, -1).bool().any(-1)
    empty = (~runs).nonzero()
    if len(empty):
        sample, rank = (int(v) for v in empty[0])
        raise ShardingError(f"sample {sample}: its tokens on sequence-parallel rank {rank} of {layout.size} are all "
                            "padding; trim the padding (to the longest sample, rounded up to a multiple of "
                            f"{layout.size}) or use fewer sequence-parallel ranks")
