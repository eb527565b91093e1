"""transformers' own renames of a checkpoint's tensor names (`conversion_mapping`'s `WeightRenaming`s),
applied before fnzero matches a pretrained file's names with the model's (`specs/checkpoint-format.md`
§Pretrained). Only renames are taken: transforms that change tensors (concatenating, splitting,
permuting) would need the whole tensor on every rank, and a file that needs one reports its names
as the model's missing ones.
"""

from __future__ import annotations

import re
from typing import Callable

from torch import nn

__all__ = ["hf_renames"]


def hf_renames(module: nn.Module) -> Callable[[str], str] | None:
    """A function from a file's tensor name to the model's, by transformers' renames for
    `module` (a PEFT wrapper's: for the model it wraps); None when there are none (not a
    transformers model, or a transformers without the mapping)."""
    base = getattr(module, "get_base_model", None)
    model = base() if callable(base) else module
    try:
        from transformers import PreTrainedModel
        from transformers.conversion_mapping import WeightRenaming, get_model_conversion_mapping
    except ImportError:
        return None
    if not isinstance(model, PreTrainedModel):
        return None
    rules = []
    for rename in get_model_conversion_mapping(model):
        if type(rename) is not WeightRenaming:  # a subclass may do more than rename
            continue
        sources, targets = list(rename.source_patterns), list(rename.target_patterns)
        if len(targets) == 1:
            targets = targets * len(sources)
        if len(targets) != len(sources):
            continue
        rules += [(re.compile(s), t) for s, t in zip(sources, targets)]
    if not rules:
        return None

    def rename(name: str) -> str:
        for pattern, target in rules:
            name = pattern.sub(target, name, count=1)
        return name

    return rename
