"""The names a model's own save gives its tensors, read when it is sharded (`make_plan`), so that a
state and its checkpoint carry them and every export, `fnzero export` included, writes what the
model's save would (`specs/checkpoint-format.md` §Export, "Names"; `specs/sharding.md` §Plan)."""

from __future__ import annotations

import dataclasses
import re

from torch import nn

__all__ = ["SavedNames", "saved_names", "non_persistent_buffers"]


@dataclasses.dataclass(frozen=True)
class SavedNames:
    """What a model's own save writes, where it differs from the names fnzero holds."""

    # Buffers registered persistent=False: held, checkpointed, never exported.
    non_persistent: tuple[str, ...] = ()
    # A transformers model: (state_dict name, the name save_pretrained writes it under, or None
    # where it writes none), for every name where the two differ; None for any other module.
    pretrained: tuple[tuple[str, str | None], ...] | None = None


def non_persistent_buffers(model: nn.Module) -> set[str]:
    """The names of `model`'s buffers registered with `persistent=False` (not in its `state_dict()`)."""
    return {f"{path}.{leaf}" if path else leaf
            for path, m in model.named_modules(remove_duplicate=False)
            for leaf in getattr(m, "_non_persistent_buffers_set", ())}


def saved_names(model: nn.Module) -> SavedNames:
    """The names `model`'s own save gives its tensors, where they differ from those fnzero holds."""
    transient = non_persistent_buffers(model)
    held = [n for n, _ in model.named_buffers(remove_duplicate=False)]
    non_persistent = tuple(n for n in held if n in transient)
    if not _is_transformers_model(model):
        return SavedNames(non_persistent)
    return SavedNames(non_persistent, tuple(sorted(_pretrained_names(model, transient).items())))


def _is_transformers_model(model: nn.Module) -> bool:
    # By the class's bases, so that sharding a plain module never imports transformers.
    return any(c.__name__ == "PreTrainedModel" and c.__module__.startswith("transformers.") for c in type(model).__mro__)


def _pretrained_names(model: nn.Module, transient: set[str]) -> dict[str, str | None]:
    """{state_dict name: the name save_pretrained writes, or None} where they differ."""
    groups: dict[int, list[str]] = {}  # one tensor's names, the first (the name fnzero holds it by) first
    for name, t in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]:
        if name not in transient:
            groups.setdefault(id(t), []).append(name)
    ignored = set(getattr(model, "_keys_to_ignore_on_save", None) or ())
    patterns = [f"{path}.{key}" if path else key for path, m in model.named_modules()
                for key in (getattr(m, "_tied_weights_keys", None) or {})]
    kept_of = {}
    for names in groups.values():
        kept_of[names[0]] = _kept([n for n in names if n not in ignored], patterns)
    renames = _save_renames(model, [n for kept in kept_of.values() for n in kept])
    out: dict[str, str | None] = {}
    for names in groups.values():
        kept = [renames.get(n, n) for n in kept_of[names[0]]]
        # The kept names go to the group's names in order (one tensor: which carries which is
        # immaterial), so the first name, the one always known (a whole frozen tensor of a
        # checkpoint knows only it), carries the first kept name.
        for i, name in enumerate(names):
            saved = kept[i] if i < len(kept) else None
            if saved != name:
                out[name] = saved
    return out


def _kept(names: list[str], patterns: list[str]) -> list[str]:
    """The names of one tensor that `remove_tied_weights_from_state_dict` keeps. Where it would
    keep more than one (a tie the model does not declare, which makes save_pretrained raise),
    every one is kept: the export still loads."""
    if len(names) < 2:
        return names
    found, dropped = 0, set()
    for name in sorted(names):
        if any(re.search(p, name) for p in patterns):
            found += 1
            if found < len(names):
                dropped.add(name)
    return [n for n in names if n not in dropped]


def _save_renames(model: nn.Module, names: list[str]) -> dict[str, str]:
    """{name: the name in the model's original files} for the names `revert_weight_conversion`
    renames: the model's conversion mapping (the one `from_pretrained` used, else its default
    without legacy renames and prefix changes), reversed, renames only."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import (PrefixChange, WeightConverter, WeightRenaming, apply_converters,
                                                     apply_renamings, dot_natural_key)
    except ImportError:  # a transformers without conversion mappings writes the model's own names
        return {}
    conversions = getattr(model, "_weight_conversions", None)
    if conversions is None:
        conversions = [c for c in get_model_conversion_mapping(model, add_legacy=False) if not isinstance(c, PrefixChange)]
    reverse = [c.reverse_transform() for c in conversions[::-1]]
    renamings = [c for c in reverse if isinstance(c, WeightRenaming)]
    converters = [c for c in reverse if isinstance(c, WeightConverter)]
    if converters and any(apply_converters(n, converters)[1] is not None for n in names):
        return {}  # some tensors cannot be written in the files' format: every name stays the model's
    out = {}
    for name in sorted(names, key=dot_natural_key):  # the order save_pretrained renames in
        new = apply_renamings(name, renamings)
        if new != name:
            out[name] = new
    return out
