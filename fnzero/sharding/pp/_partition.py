"""How a pipeline's layers are cut into stages: DeepSpeed's `partition_method`s with its results
(`specs/mesh.md` §Pipeline). Boundaries: `stages + 1` layer indices, stage s holding
`[bounds[s], bounds[s+1])`."""

from __future__ import annotations

import math
import re
from typing import Sequence

from ..._errors import ConfigError

__all__ = ["partition_uniform", "partition_balanced", "stage_bounds", "layer_type_name"]


def partition_uniform(num_items: int, num_parts: int) -> list[int]:
    """Boundaries giving each part `num_items // num_parts` items, the first `num_items %
    num_parts` parts one more."""
    if num_items <= num_parts:
        return [min(p, num_items) for p in range(num_parts + 1)]
    base, extra = divmod(num_items, num_parts)
    return [p * base + min(p, extra) for p in range(num_parts + 1)]


def partition_balanced(weights: Sequence[float], num_parts: int) -> list[int]:
    """Boundaries of `num_parts` contiguous parts minimising (largest sum - smallest sum), by dynamic
    programming; ties go to the latest last cut at each level (DeepSpeed's rule: the same cuts)."""
    n, m = len(weights), num_parts
    if n <= m:
        return partition_uniform(n, m)
    prefix = [0.0]
    for w in weights:
        prefix.append(prefix[-1] + float(w))
    inf = math.inf
    # best[i][j]: (cost, max, min) of cutting the first i items into j parts; cut[i][j]: the last cut.
    hi = [[inf] * (m + 1) for _ in range(n + 1)]
    lo = [[inf] * (m + 1) for _ in range(n + 1)]
    cost = [[inf] * (m + 1) for _ in range(n + 1)]
    cut = [[0] * (m + 1) for _ in range(n + 1)]
    hi[0][0] = cost[0][0] = 0.0
    for i in range(1, n + 1):
        for j in range(1, min(i, m) + 1):
            for k in range(i):
                part = prefix[i] - prefix[k]
                top, bottom = max(hi[k][j - 1], part), min(lo[k][j - 1], part)
                c = top - bottom
                if not cost[i][j] < c:  # ties (and inf - inf = nan against inf) take the later cut
                    cost[i][j], hi[i][j], lo[i][j], cut[i][j] = c, top, bottom, k
    bounds = [n]
    for j in range(m, 0, -1):
        bounds.append(cut[bounds[-1]][j])
    return bounds[::-1]


def layer_type_name(layer) -> str | None:
    """The class name a `type:` regex is matched against (a LayerSpec's class, a module's class,
    a function's name), or None."""
    typename = getattr(layer, "typename", None)
    if isinstance(typename, type):
        return typename.__name__
    if hasattr(layer, "parameters") and hasattr(layer, "forward"):
        return type(layer).__name__
    return getattr(layer, "__name__", None)


def stage_bounds(method: "str | Sequence[int]", layers: Sequence, num_stages: int,
                 param_counts: Sequence[int]) -> list[int]:
    """The boundaries of `num_stages` stages over `layers` by `method` (or split points: the indices of
    the layers that start stages 1, 2, ...); a ConfigError names the numbers where they cannot."""
    n = len(layers)
    if num_stages > n:
        raise ConfigError(f"a pipeline of {num_stages} stages needs at least {num_stages} layers; this model has {n}")
    if not isinstance(method, str):
        points = list(method)
        bounds = [0, *points, n]
        if len(points) != num_stages - 1 or not all(isinstance(p, int) and not isinstance(p, bool) for p in points) \
                or any(a >= b for a, b in zip(bounds, bounds[1:])):
            raise ConfigError(f"split points {points} do not cut {n} layers into {num_stages} non-empty stages: give "
                              f"{num_stages - 1} increasing layer indices between 1 and {n - 1}")
        return bounds
    m = method.lower()
    if m == "uniform":
        return partition_uniform(n, num_stages)
    if m == "parameters":
        return partition_balanced(param_counts, num_stages)
    if m.startswith("type:"):
        pattern = re.compile(method.split(":", 1)[1], re.IGNORECASE)
        hits = [1 if (name := layer_type_name(layer)) is not None and pattern.search(name) else 0 for layer in layers]
        if not any(hits):
            names = sorted({layer_type_name(x) or "?" for x in layers})
            raise ConfigError(f"partition_method {method!r} matches no layer (layer types: {', '.join(names)})")
        return partition_balanced(hits, num_stages)
    raise ConfigError(f"partition_method {method!r} is not one of 'parameters', 'uniform', 'type:<regex>'")
