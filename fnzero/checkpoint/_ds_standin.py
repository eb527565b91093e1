"""The model a DeepSpeed checkpoint describes, built from its files alone (`specs/checkpoint-format.md`
§DeepSpeed, "Converting to fnzero"): a module tree whose parameters and persistent buffers carry the
checkpoint's names, shapes, ties and trainable flags, so that a state can be laid out for it and
the checkpoint loaded into that state without the user's model at hand.

The trainable parameters hold zeros (a load writes them); the buffers, and the frozen parameters
where the files were read for them, hold the checkpoint's values (a universal checkpoint's load
keeps the model's frozen weights, as DeepSpeed's does).
"""

from __future__ import annotations

import torch
from torch import nn

from .._errors import CheckpointError
from ._ds_layout import DsCheckpoint, check_resumable, describe
from ._ds_stage0 import stage0_frozen
from ._ds_universal_read import universal_weights
from ._ds_weights import consolidate

__all__ = ["deepspeed_model"]


def deepspeed_model(path, tag: str | None = None) -> tuple[nn.Module, DsCheckpoint]:
    """(a module of the checkpoint's parameters and buffers, the checkpoint as `describe` reads it)
    for DeepSpeed checkpoint `path/tag`. Only the small fields and, for the buffers and frozen
    weights, the model files are read: the trainable weights stay in the optimizer files. A
    checkpoint `load` cannot resume (not Adam's, a pipeline's, ...) is refused here, named."""
    ck = describe(path, tag)
    check_resumable(ck)
    # (A universal checkpoint's frozen weights are read here: `load` keeps the model's own for it.)
    w = universal_weights(ck, trainable=False) if ck.layout == "universal" else consolidate(ck, trainable=False)
    frozen = w.frozen if w.frozen_known else stage0_frozen(ck)
    root = nn.Module()
    params: dict[str, nn.Parameter] = {}
    for name, t in w.tensors.items():
        owner, leaf = _owner(root, name, ck.dir)
        if name in w.buffers:
            owner.register_buffer(leaf, t.detach().clone(), persistent=True)
            continue
        dtype = torch.float32 if t.is_floating_point() else t.dtype
        value = t.detach().to(dtype).clone() if t.device.type != "meta" and name in frozen else torch.zeros(t.shape, dtype=dtype)
        p = params[name] = nn.Parameter(value, requires_grad=name not in frozen)
        owner.register_parameter(leaf, p)
    for first, aliases in w.aliases.items():
        for alias in aliases:
            owner, leaf = _owner(root, alias, ck.dir)
            owner.register_parameter(leaf, params[first])  # the same Parameter: a tie, as the model had it
    return root, ck


def _owner(root: nn.Module, name: str, where: str) -> tuple[nn.Module, str]:
    """The module that holds `name` (made on the way) and the leaf's own name."""
    *path, leaf = name.split(".")
    if not leaf or any(not p for p in path):
        raise CheckpointError(f"{where}: {name!r} is not a module path a model can hold")
    mod = root
    for part in path:
        child = mod._modules.get(part)
        if child is None:
            if part in mod._parameters or part in mod._buffers:
                raise CheckpointError(f"{where}: {name!r} puts a tensor under {part!r}, which is a tensor itself")
            child = nn.Module()
            mod.add_module(part, child)
        mod = child
    if leaf in mod._modules:
        raise CheckpointError(f"{where}: {name!r} names a module of other tensors")
    return mod, leaf
