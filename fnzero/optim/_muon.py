"""Muon as DeepSpeed 0.19.8's `"type": "Muon"` computes it (specs/optim.md §Muon): `scale_by_muon`
orthogonalises each matrix's momentum (not elementwise); `partition` applies one chain to the
parameters a predicate selects and another to the rest."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Callable, NamedTuple

import optree
import torch

from fnzero._errors import ConfigError

from . import _validate as check
from ._base import Params, zeros_count
from ._newton_schulz import NS_METHODS, orthogonalize
from ._transform import GradientTransformation, _named

__all__ = [
    "ScaleByMuonState", "PartitionState", "scale_by_muon", "partition", "uses_muon", "aspect_ratio_scale",
    "MUON_DEFAULT_LR", "ADAM_DEFAULT_LR",
]

# DeepSpeed's `set_optimizer_flags`: these in a parameter's lower-cased name send it to AdamW.
_NOT_MUON_NAMES = ("embed", "lm_head")
# MuonWithAuxAdam's defaults for a half whose lr the config does not give.
MUON_DEFAULT_LR = 0.02
ADAM_DEFAULT_LR = 3e-4


class ScaleByMuonState(NamedTuple):
    """`scale_by_muon`: the update count and the momentum buffer, a tree like params."""

    count: torch.Tensor
    momentum: Params


def uses_muon(name: str, shape: tuple[int, ...]) -> bool:
    """DeepSpeed's grouping: Muon for parameters of >= 2 dimensions whose name (any case)
    contains neither "embed" nor "lm_head"; AdamW for the rest."""
    return len(shape) >= 2 and not any(word in name.lower() for word in _NOT_MUON_NAMES)


def aspect_ratio_scale(rows: int, cols: int) -> float:
    """DeepSpeed's factor on the orthogonalised update: sqrt(rows / cols) for a tall matrix, else 1."""
    return math.sqrt(rows / cols) if rows > cols else 1.0


def _muon_direction(m: torch.Tensor, ns_steps: int, ns_method: str, heads: int | None = None) -> torch.Tensor:
    """The orthogonalised direction of one parameter's blended momentum `m`: a 4-D (conv)
    tensor as the matrix of its first dimension by the rest, >= 3-D otherwise as a batch of its
    last two; scaled by the last two dimensions' aspect ratio (the 4-D case too, as DeepSpeed).
    With `heads` (per_head_muon: an attention projection [heads * head_dim, in]) each head's
    [head_dim, in] block is orthogonalised on its own and scaled by that block's aspect ratio."""
    if heads is not None:
        blocks = m.reshape(heads, m.size(0) // heads, m.size(1))
        out = orthogonalize(blocks, ns_steps, ns_method) * aspect_ratio_scale(blocks.size(1), blocks.size(2))
        return out.reshape(m.shape).to(m.dtype)
    x = m.reshape(m.size(0), -1) if m.ndim == 4 else m
    out = orthogonalize(x, ns_steps, ns_method) * aspect_ratio_scale(m.size(-2), m.size(-1))
    return out.reshape(m.shape).to(m.dtype)


def _check_heads(name: str, key: str, leaf: torch.Tensor, heads: int) -> None:
    if isinstance(heads, bool) or not isinstance(heads, int) or heads < 1:
        raise ConfigError(f"{name}: head_counts[{key!r}]={heads!r} must be a positive integer")
    if leaf.ndim != 2 or leaf.size(0) % heads:
        raise ConfigError(
            f"{name}: parameter {key!r} has shape {tuple(leaf.shape)}, which does not split into "
            f"{heads} heads along its rows (per_head_muon orthogonalises a 2-D [heads * head_dim, in] projection)"
        )


@_named
def scale_by_muon(momentum: float = 0.95, nesterov: bool = True, ns_steps: int = 5,
                  ns_method: str = "gram", head_counts: Mapping[str, int] | None = None) -> GradientTransformation:
    """Muon's direction per matrix: `buf = momentum * buf + (1 - momentum) * g` (the buffer
    starts at zero), blended `(1 - momentum) * g + momentum * buf` with `nesterov` (else `buf`),
    orthogonalised by `ns_steps` Newton–Schulz iterations ("gram" or "standard") and scaled
    by `aspect_ratio_scale`. Every parameter it is given must have >= 2 dimensions (`partition`
    sends the others elsewhere); it reads whole matrices, so it is not elementwise.

    `head_counts` (DeepSpeed's `per_head_muon`; `muon_head_counts(model)` resolves it): parameter
    name (its path in the tree joined by ".") -> attention heads; such a parameter's direction is
    orthogonalised per head (`_muon_direction`). Names it gives that the tree lacks are ignored (a
    partition or an owning rank sees some parameters only)."""
    name = "scale_by_muon"
    beta = check.number(name, "momentum", momentum, hi=1.0, hi_open=True)
    nesterov = check.flag(name, "nesterov", nesterov)
    if isinstance(ns_steps, bool) or not isinstance(ns_steps, int) or ns_steps < 1:
        raise ConfigError(f"{name}: ns_steps={ns_steps!r} must be a positive integer")
    if ns_method not in NS_METHODS:
        raise ConfigError(f"{name}: ns_method={ns_method!r} must be one of {', '.join(map(repr, NS_METHODS))}")
    if head_counts is not None and not isinstance(head_counts, Mapping):
        raise ConfigError(f"{name}: head_counts must be a mapping of parameter name -> heads, "
                          f"got {type(head_counts).__name__}")
    heads_of = dict(head_counts or {})

    def init(params):
        flat = optree.tree_flatten_with_path(params)
        for path, leaf in zip(flat[0], flat[1]):
            if leaf.ndim < 2:
                raise ConfigError(
                    f"{name}: parameter {_path_name(path)!r} has shape {tuple(leaf.shape)}; Muon orthogonalises "
                    "matrices (>= 2 dimensions): send the others to another chain with fnzero.optim.partition"
                )
            if _path_name(path) in heads_of:
                _check_heads(name, _path_name(path), leaf, heads_of[_path_name(path)])
        with torch.no_grad():
            return ScaleByMuonState(zeros_count(), optree.tree_map(torch.zeros_like, params))

    def update(u, s, params=None, **extra):
        buf = optree.tree_map(lambda b, g: b + (g.to(b.dtype) - b) * (1.0 - beta), s.momentum, u)
        blended = optree.tree_map(lambda g, b: g.to(b.dtype) + (b - g.to(b.dtype)) * beta, u, buf) if nesterov else buf
        paths, leaves, treedef = optree.tree_flatten_with_path(blended)
        out = optree.tree_unflatten(treedef, [_muon_direction(m, ns_steps, ns_method, heads_of.get(_path_name(p)))
                                              for p, m in zip(paths, leaves)])
        return out, ScaleByMuonState(s.count + 1, buf)

    return GradientTransformation(init, update, elementwise=False)


def _path_name(path: tuple) -> str:
    return ".".join(map(str, path))


class PartitionState(NamedTuple):
    """`partition`: the selected parameters' chain state and the others'."""

    inside: Any
    outside: Any


def partition(select: Callable[[str, tuple[int, ...]], bool], inside: GradientTransformation,
              outside: GradientTransformation, *,
              outside_extra: Callable[[dict], dict] | None = None) -> GradientTransformation:
    """`inside` for the parameters `select(name, shape)` chooses, `outside` for the rest. A
    parameter's name is its path in the tree joined by "." (a dict of state-dict names gives
    those names). Each chain sees a dict of its parameters by name. `outside_extra` maps the
    step's extras for `outside` (e.g. its own learning rate from the schedule's)."""

    def split(tree, params_tree):
        paths, leaves, _ = optree.tree_flatten_with_path(params_tree)
        values = optree.tree_leaves(tree)
        ins, outs = {}, {}
        for path, p, v in zip(paths, leaves, values):
            key = _path_name(path)
            (ins if select(key, tuple(p.shape)) else outs)[key] = v
        return ins, outs

    def init(params):
        ins, outs = split(params, params)
        return PartitionState(inside.init(ins), outside.init(outs))

    def update(updates, state, params=None, **extra):
        if params is None:
            raise ConfigError("partition: update needs params (parameters are routed by name and shape)")
        u_in, u_out = split(updates, params)
        p_in, p_out = split(params, params)
        new_in, s_in = inside.update(u_in, state.inside, p_in, **extra)
        new_out, s_out = outside.update(u_out, state.outside, p_out, **(outside_extra(extra) if outside_extra else extra))
        merged = {**new_in, **new_out}
        paths, _, treedef = optree.tree_flatten_with_path(params)
        return optree.tree_unflatten(treedef, [merged[_path_name(p)] for p in paths]), PartitionState(s_in, s_out)

    return GradientTransformation(init, update, inside.elementwise and outside.elementwise,
                                  f"partition({inside.name or '?'}, {outside.name or '?'})", (inside, outside),
                                  (select, outside_extra))
