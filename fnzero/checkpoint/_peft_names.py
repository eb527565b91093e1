"""A PEFT model's tensor names and its base model's (`specs/peft.md` §Names).

Read from the names alone, by structure rather than by PEFT's tuner prefixes: a module with a
tensor under `base_layer` is a tuner layer, and its other tensors are adapters; a module with
one under `original_module` is a modules_to_save wrapper.
"""

from __future__ import annotations

__all__ = ["PeftNames", "peft_names"]

_ROOT = "base_model.model."  # PeftModel -> its tuner (LoraModel) -> the wrapped model
_WRAPPED, _ORIGINAL, _COPIES = "base_layer", "original_module", "modules_to_save"


class PeftNames:
    """The base-model name of each tensor of a PEFT model (None for an adapter)."""

    def __init__(self, names: set[str]):
        self.rooted = all(n.startswith(_ROOT) for n in names)
        tuned, wrapped = set(), set()
        for n in names:
            parts = self._strip(n).split(".")
            for i, p in enumerate(parts[:-1]):
                (tuned if p == _WRAPPED else wrapped if p == _ORIGINAL else set()).add(".".join(parts[:i]))
        self.base_of = {n: self._base(self._strip(n), tuned, wrapped) for n in names}

    def _strip(self, name: str) -> str:
        return name[len(_ROOT):] if self.rooted else name

    @staticmethod
    def _base(name: str, tuned: set[str], wrapped: set[str]) -> str | None:
        parts, out, i = name.split("."), [], 0
        while i < len(parts) - 1:
            at, p = ".".join(parts[:i]), parts[i]
            if at in tuned and p != _WRAPPED or at in wrapped and p not in (_ORIGINAL, _COPIES):
                return None  # a tuner layer's own tensor: an adapter
            i += 2 if (at in wrapped and p == _COPIES) else 1  # `modules_to_save.<adapter>` is a copy of the base
            if p not in (_WRAPPED, _ORIGINAL, _COPIES) or at not in tuned | wrapped:
                out.append(p)
        return ".".join(out + parts[-1:])

    def base_names(self) -> set[str]:
        """Every name the base model's files may hold for this model."""
        return {b for b in self.base_of.values() if b is not None}

    def adapters(self) -> list[str]:
        """The adapter tensors: no base model's file has them."""
        return [n for n, b in self.base_of.items() if b is None]

    def to_model(self, entries: dict) -> dict:
        """`entries` by base-model name, by this model's names instead (a base tensor feeding a
        wrapped layer and its modules_to_save copies appears under each); names no tensor of
        this model reads are kept as they are (the loader reports them as unexpected)."""
        out, used = {}, set()
        for name, base in self.base_of.items():
            if base is not None and base in entries:
                out[name] = entries[base]
                used.add(base)
        out.update({n: e for n, e in entries.items() if n not in used and n not in out})
        return out


def peft_names(names: set[str]) -> PeftNames | None:
    """The PEFT naming of a model with tensors `names`, or None when it has no PEFT layer."""
    if not any(f".{_WRAPPED}." in n or f".{_ORIGINAL}." in n for n in names):
        return None
    return PeftNames(names)
