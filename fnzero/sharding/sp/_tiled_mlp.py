"""`tile_mlp`: a model's MLPs run a few tokens at a time, each tile recomputed in backward, so that
only one tile's intermediate activations exist at once (`specs/mesh.md` §Sequence, Tiled MLP)."""

from __future__ import annotations

import functools
import math
from typing import Callable

import torch
from torch import nn

from ..._errors import ShardingError
from ..zero import remat

__all__ = ["tile_mlp"]


def tile_mlp(model: nn.Module, tiles: int | str = "auto",
             select: Callable[[str, nn.Module], bool] | None = None) -> list[str]:
    """Make each MLP of `model` run over runs of tokens (dim 1 of its (batch, tokens, hidden)
    input) under `fnzero.remat`, as DeepSpeed's `TiledMLP`: the intermediate (tokens × MLP width)
    activations of one tile at a time, recomputed in backward; results equal the untiled MLP's.

    Each selected module is replaced, in its parent, by a copy of itself whose class is a subclass
    of its own with the tiled forward: the same parameters and children under the same names (state
    dicts, checkpoints and `fnzero.shard` see no difference); the module given is left as it was.
    `select(name, module)` picks the MLPs (default: a transformers decoder layer's `mlp`, not MoE
    blocks). `tiles`: a count, or "auto": ⌈tokens / hidden size⌉ per call, DeepSpeed's rule. Call it
    before `fnzero.shard`. Returns the names of the modules tiled; a ShardingError when none is."""
    if tiles != "auto" and (isinstance(tiles, bool) or not isinstance(tiles, int) or tiles < 1):
        raise ShardingError(f"tile_mlp: tiles must be a positive integer or 'auto', got {tiles!r}")
    select = select or functools.partial(_decoder_mlp, model)
    chosen = [(name, m) for name, m in model.named_modules() if name and select(name, m)]
    if not chosen:
        raise ShardingError(f"tile_mlp found no MLP to tile in {type(model).__name__} (a transformers decoder "
                            "layer's `mlp`, MoE blocks left out); pass select=(name, module) -> bool")
    for name, module in chosen:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, _tiled_copy(module, tiles))
    return [name for name, _ in chosen]


def _decoder_mlp(model: nn.Module, name: str, module: nn.Module) -> bool:
    """A transformers decoder layer's dense MLP: the child `mlp` of a module with `self_attn` (an
    MoE block, with experts and a router, is not one: each tile would route on its own)."""
    parent, _, child = name.rpartition(".")
    if child != "mlp" or isinstance(module, _Tiled) or any(hasattr(module, a) for a in ("experts", "gate", "router")):
        return False
    return hasattr(model.get_submodule(parent) if parent else model, "self_attn")


class _Tiled:
    """The tiled forward, mixed in front of an MLP's own class."""

    _fnzero_tiles: int | str

    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        own = super().forward  # the MLP class's forward, bound to this module
        n = self._fnzero_tiles
        if n == "auto":
            n = math.ceil(x.shape[1] / max(1, x.shape[-1])) if x.dim() >= 3 else 1
        if x.dim() < 3 or n <= 1 or x.shape[1] <= 1:
            return own(x, *args, **kwargs)
        run = remat(lambda t: own(t, *args, **kwargs))
        return torch.cat([run(part) for part in x.split(math.ceil(x.shape[1] / n), dim=1)], dim=1)


@functools.lru_cache(maxsize=None)
def _tiled_class(cls: type) -> type:
    return type(f"Tiled{cls.__name__}", (_Tiled, cls), {"__module__": cls.__module__})


def _tiled_copy(module: nn.Module, tiles: int | str) -> nn.Module:
    """A copy of `module` of the tiled subclass of its class: its attributes, with each dict (its
    parameters, buffers, children, hooks) copied, so the copy's entries can change apart."""
    new = object.__new__(_tiled_class(type(module)))
    new.__dict__.update({k: dict(v) if isinstance(v, dict) else v for k, v in module.__dict__.items()})
    new._fnzero_tiles = tiles
    return new
