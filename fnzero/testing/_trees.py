"""Comparing and snapshotting pytrees of tensors, with messages that name the leaf:
`assert_trees_close` is the primitive every other assertion reports through."""

from __future__ import annotations

import math
from typing import Any

import optree
import torch

__all__ = ["assert_trees_close", "assert_trees_equal", "tree_snapshot", "leaf_paths"]

_MAX_LISTED = 5  # differing leaves named after the first one


def leaf_paths(tree: Any, root: str = "") -> tuple[list[str], list[Any], Any]:
    """(paths, leaves, treespec) with paths written as Python accessors: `root.field['key'][0]`."""
    flatten = getattr(optree, "tree_flatten_with_accessor", None)
    if flatten is not None:
        accessors, leaves, spec = flatten(tree, none_is_leaf=True)
        return [a.codify(root) for a in accessors], leaves, spec
    leaves, spec = optree.tree_flatten(tree, none_is_leaf=True)  # optree < 0.12: plain key paths
    paths = optree.tree_paths(tree, none_is_leaf=True)
    return [root + "".join(f"[{k!r}]" for k in p) for p in paths], leaves, spec


def tree_snapshot(tree: Any) -> Any:
    """A deep copy whose tensors share no storage with `tree` (other leaves are kept as they are)."""
    return optree.tree_map(
        lambda x: x.detach().clone() if isinstance(x, torch.Tensor) else x, tree, none_is_leaf=True
    )


def _fmt(x: float) -> str:
    return f"{x:.6g}"


def _tensor_problem(got: torch.Tensor, want: torch.Tensor, rtol: float, atol: float, equal_nan: bool, check_dtype: bool):
    if tuple(got.shape) != tuple(want.shape):
        return f"shape {tuple(got.shape)} vs {tuple(want.shape)}"
    if check_dtype and got.dtype != want.dtype:
        return f"dtype {got.dtype} vs {want.dtype}"
    if got.numel() == 0:
        return None
    g = got.detach().cpu()
    w = want.detach().cpu()
    if rtol == 0 and atol == 0 and not (g.is_floating_point() or g.is_complex()):
        bad = g != w
        diff = bad.to(torch.float64)
        rel = diff
    else:
        g, w = g.to(torch.float64), w.to(torch.float64)
        # Equal values (infinities included) never differ; a NaN differs from everything but,
        # with equal_nan, another NaN. `not <=` rather than `>` so a NaN difference counts.
        same = (g == w) | (torch.isnan(g) & torch.isnan(w) & equal_nan)
        diff = torch.where(same, torch.zeros_like(g), (g - w).abs())
        bad = ~same & ~(diff <= atol + rtol * w.abs())
        rel = diff / w.abs().clamp_min(torch.finfo(torch.float64).tiny)
    if not bool(bad.any()):
        return None
    n_bad = int(bad.sum())
    masked = torch.where(bad, diff.nan_to_num(nan=math.inf), torch.full_like(diff, -1.0))
    flat = int(masked.reshape(-1).argmax())
    index = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), got.shape)) if got.dim() else ()
    gv, wv = got.reshape(-1)[flat].item(), want.reshape(-1)[flat].item()
    return (
        f"{n_bad} of {got.numel()} elements differ; max abs diff {_fmt(diff.reshape(-1)[flat].item())} "
        f"(rel {_fmt(rel.reshape(-1)[flat].item())}) at index {index}: got {gv!r}, want {wv!r}"
    )


def _scalar_problem(got: Any, want: Any, rtol: float, atol: float, equal_nan: bool):
    numbers = (int, float, bool)
    if isinstance(got, numbers) and isinstance(want, numbers) and not isinstance(got, bool) and not isinstance(want, bool):
        g, w = float(got), float(want)
        if math.isnan(g) and math.isnan(w) and equal_nan:
            return None
        if g == w or abs(g - w) <= atol + rtol * abs(w):
            return None
        rel = abs(g - w) / abs(w) if w else math.inf
        return f"got {got!r}, want {want!r} (abs diff {_fmt(abs(g - w))}, rel {_fmt(rel)})"
    if isinstance(got, torch.Tensor) or isinstance(want, torch.Tensor):
        return f"a {type(got).__name__} vs a {type(want).__name__}"
    return None if got == want else f"got {got!r}, want {want!r}"


def assert_trees_close(
    got: Any,
    want: Any,
    rtol: float = 1e-7,
    atol: float = 0.0,
    *,
    what: str = "",
    root: str = "",
    equal_nan: bool = True,
    check_dtype: bool = True,
) -> None:
    """Assert two pytrees have the same structure and leaves within `atol + rtol * |want|`.

    Tensor leaves are compared elementwise in float64 (NaN equals NaN unless `equal_nan=False`);
    number leaves the same way; other leaves with `==`. The AssertionError names `what` (add the
    rank and step here), the first differing leaf's path under `root` (e.g. `state.params['fc']`),
    the count of differing elements, the largest difference and where it is, and lists the other
    differing leaves.
    """
    gp, gl, gspec = leaf_paths(got, root)
    wp, wl, wspec = leaf_paths(want, root)
    prefix = f"{what}: " if what else ""
    if gp != wp or gspec != wspec:
        missing = [p for p in wp if p not in set(gp)]
        extra = [p for p in gp if p not in set(wp)]
        detail = []
        if missing:
            detail.append(f"missing {missing[:_MAX_LISTED]}")
        if extra:
            detail.append(f"unexpected {extra[:_MAX_LISTED]}")
        if not detail:
            detail.append(f"structure {gspec} vs {wspec}")
        raise AssertionError(f"{prefix}trees differ in structure: " + "; ".join(detail))
    problems = []
    for path, g, w in zip(gp, gl, wl):
        if isinstance(g, torch.Tensor) and isinstance(w, torch.Tensor):
            p = _tensor_problem(g, w, rtol, atol, equal_nan, check_dtype)
        else:
            p = _scalar_problem(g, w, rtol, atol, equal_nan)
        if p is not None:
            problems.append((path or root or "<root>", p))
    if problems:
        path, p = problems[0]
        msg = f"{prefix}{path}: {p} (rtol={rtol:g}, atol={atol:g})"
        if len(problems) > 1:
            others = [q for q, _ in problems[1 : 1 + _MAX_LISTED]]
            more = len(problems) - 1 - len(others)
            msg += f"; {len(problems) - 1} more leaves differ: {others}" + (f" and {more} more" if more else "")
        raise AssertionError(msg)


def assert_trees_equal(got: Any, want: Any, *, what: str = "", root: str = "") -> None:
    """`assert_trees_close` with no tolerance: bit-for-bit values (NaN equals NaN), same dtypes."""
    assert_trees_close(got, want, rtol=0.0, atol=0.0, what=what, root=root)
