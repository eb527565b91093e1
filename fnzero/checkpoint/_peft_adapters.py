"""A PEFT adapter directory (`adapter_model.safetensors`, `adapter_config.json`) and a sharded
PEFT model: which tensor is which, and reading one into the initial state (`specs/peft.md`).

The names in an adapter file are PEFT's own: `get_peft_model_state_dict` decides them (the
adapter's name dropped, `modules_to_save.default.` folded away, ...). Rather than copy those
rules, each of the model's tensor names is handed to it once, as a distinct meta tensor, and the
file name it comes back under is the answer: the same function PEFT's `save_pretrained` and
`from_pretrained` go through, so the two cannot drift apart.
"""

from __future__ import annotations

import json
import os
from typing import Callable

import torch

from .._errors import CheckpointError
from ._tree import slots_by_name

__all__ = ["AdapterNames", "adapter_names", "load_adapters"]

WEIGHTS, CONFIG = "adapter_model.safetensors", "adapter_config.json"
# Config fields that change what the same tensors compute (the scaling, the method).
_SAME_MEANING = ("peft_type", "r", "lora_alpha", "use_rslora", "use_dora", "rank_pattern", "alpha_pattern")


class AdapterNames:
    """One adapter of a PEFT model: its name, its config, and file name -> model name."""

    def __init__(self, adapter: str, config, to_model: dict[str, str]):
        self.adapter, self.config, self.to_model = adapter, config, to_model


def adapter_names(module, adapter: str | None) -> AdapterNames:
    """The tensors of `adapter` (None: the model's only one) in `module`, a PEFT model."""
    configs = getattr(module, "peft_config", None)
    if not isinstance(configs, dict) or not configs:
        raise CheckpointError(f"{type(module).__name__} has no PEFT adapters (no peft_config): build it with "
                              "peft.get_peft_model(model, LoraConfig(...)) before fnzero.shard")
    if adapter is None:
        if len(configs) > 1:
            raise CheckpointError(f"the model has adapters {sorted(configs)}: name one with adapter=")
        adapter = next(iter(configs))
    if adapter not in configs:
        raise CheckpointError(f"the model has no adapter {adapter!r} (it has {sorted(configs)})")
    from peft import get_peft_model_state_dict

    tags = {n: torch.empty(t.shape, dtype=t.dtype, device="meta")
            for n, t in [*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)]}
    by_tag = {id(t): n for n, t in tags.items()}
    # Embedding layers are saved whole only when the vocabulary changed; fnzero keeps it fixed.
    saved = get_peft_model_state_dict(module, state_dict=tags, adapter_name=adapter, save_embedding_layers=False)
    return AdapterNames(adapter, configs[adapter], {k: by_tag[id(v)] for k, v in saved.items()})


def _read_config(path: str) -> dict:
    file = os.path.join(path, CONFIG)
    try:
        with open(file, encoding="utf-8") as f:
            out = json.load(f)
    except FileNotFoundError:
        raise CheckpointError(f"adapters {path!r}: no {CONFIG} (a directory written by PeftModel.save_pretrained or "
                              "fnzero.checkpoint.export_adapters)") from None
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{file}: cannot read it as JSON ({e})") from e
    if not isinstance(out, dict):
        raise CheckpointError(f"{file}: not a JSON object")
    return out


def _check(path: str, names: AdapterNames, entries: dict, slots: dict) -> None:
    """One error per kind of mismatch, naming the tensors (every rank raises the same)."""
    stray = sorted(set(entries) - set(names.to_model))
    lacking = sorted(set(names.to_model) - set(entries))
    if stray or lacking:
        raise CheckpointError(
            f"adapters {path!r} are for other targets: tensors the model's adapter {names.adapter!r} lacks "
            f"{stray[:8]}{' ...' if len(stray) > 8 else ''}, tensors the file lacks {lacking[:8]}"
            f"{' ...' if len(lacking) > 8 else ''}"
        )
    bad = [f"{k}: file {list(e.shape)}, model {list(slots[names.to_model[k]][1].shape)}"
           for k, e in sorted(entries.items()) if tuple(e.shape) != tuple(slots[names.to_model[k]][1].shape)]
    if bad:
        raise CheckpointError(f"adapters whose base shapes do not match, in {path!r} (another r, other targets or "
                              f"another base model?): {'; '.join(bad[:6])}{' ...' if len(bad) > 6 else ''}")
    file_cfg, model_cfg = _read_config(path), names.config.to_dict()
    differ = [f"{k}: file {file_cfg.get(k)!r}, model {model_cfg.get(k)!r}" for k in _SAME_MEANING
              if k in model_cfg and _plain(file_cfg.get(k, model_cfg[k])) != _plain(model_cfg[k])]
    if differ:
        raise CheckpointError(f"adapters {path!r}: {CONFIG} differs from the model's {type(names.config).__name__} "
                              f"in what the adapters compute: {'; '.join(differ)}")


def _plain(v):
    return str(v.value) if hasattr(v, "value") else v  # PeftType is an enum, the file holds its value


def load_adapters(path, module, plan, rank: int, initial: dict[str, torch.Tensor], *, adapter: str | None = None,
                  tp=None) -> tuple[list[str], Callable[[], None]]:
    """Check the adapter directory `path` against the model (names, shapes, config) without
    reading tensor data; returns the model names it holds and the read, which overwrites them in
    `initial` (unit -> flat buffer or this rank's shard) in place."""
    from ._pretrained import _load_slot, _read_header, _Reader

    path = os.fspath(path)
    if tp is not None:
        raise CheckpointError("adapters into a tensor-parallel model are not supported yet")
    names = adapter_names(module, adapter)
    slots = slots_by_name(plan)
    frozen = sorted(m for m in names.to_model.values() if m not in slots)
    if frozen:
        raise CheckpointError(f"adapter tensors that are not trainable in this model: {frozen[:8]}")
    file = path if os.path.isfile(path) else os.path.join(path, WEIGHTS)
    if not os.path.isfile(file):
        raise CheckpointError(f"adapters {path!r}: no {WEIGHTS} (adapter_model.bin, a torch pickle, is not loaded)")
    entries = _read_header(file)
    _check(os.path.dirname(file), names, entries, slots)

    def read() -> None:
        reader = _Reader()
        try:
            with torch.no_grad():
                for k, e in entries.items():
                    u, s = slots[names.to_model[k]]
                    _load_slot(reader, e, u, s, None, initial, plan, rank)
        finally:
            reader.close()

    return sorted(names.to_model.values()), read
