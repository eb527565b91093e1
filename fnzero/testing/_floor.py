"""The model's own noise floor: how far the *unsharded* step moves when the same rows are split into
the sharded run's micro-batches (`specs/testing.md` §Noise floor: why, how measured, the rule)."""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

import torch

from ._trees import assert_trees_close, leaf_paths

__all__ = ["NOISE_FACTOR", "SPLIT_CEILING", "NoiseFloorWarning", "Floor", "measure_floor", "judge"]

# The sharded run's distance from the reference is the floor itself (ratio 1.0 measured); 10 leaves
# an order of magnitude, far below a sharding bug's (§Noise floor, the rule).
NOISE_FACTOR = 10.0

# Above this relative step-0 floor the result depends on the split itself (BatchNorm, a loss not a
# mean over rows): not noise, so never an excuse (§Noise floor).
SPLIT_CEILING = 1e-3


class NoiseFloorWarning(UserWarning):
    """`assert_stage_equivalent` passed only against the model's own noise floor (§Noise floor)."""


@dataclasses.dataclass(frozen=True)
class Floor:
    """Per step, `{leaf path: floor}` (largest absolute difference between the split and the
    whole-batch unsharded runs; 0 for non-floating leaves), and the step-0 relative floor of the
    loss and the gradient norm (`start`: (path, relative floor))."""

    steps: list[dict[str, float]]
    start: tuple[str, float]
    chunks: int

    @property
    def is_rounding(self) -> bool:
        return self.start[1] <= SPLIT_CEILING


def _leaf_floor(a: Any, b: Any) -> tuple[float, float]:
    """(largest abs difference, that difference relative to `b`) of two leaves; 0 unless floating."""
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        if not (a.is_floating_point() and b.is_floating_point()) or a.shape != b.shape or not a.numel():
            return 0.0, 0.0
        d = (a.detach().double() - b.detach().double()).abs().reshape(-1)
        i = int(d.argmax())
        return float(d[i]), float(d[i] / b.detach().double().reshape(-1)[i].abs().clamp_min(1e-300))
    if isinstance(a, float) and isinstance(b, float):
        return abs(a - b), abs(a - b) / max(abs(b), 1e-300)
    return 0.0, 0.0


def measure_floor(split: list[dict], whole: list[dict], chunks: int) -> Floor:
    """The floor from the unsharded traces on the sharded run's micro-batches (`split`) and on the
    whole batch (`whole`): each a list, per step, of `{"metrics": ..., "params": ...}`."""
    steps = []
    start = ("metrics['loss']", 0.0)
    for s, (a, b) in enumerate(zip(split, whole)):
        per_leaf = {}
        for part in a:
            paths, al, _ = leaf_paths(a[part], part)
            for path, x, y in zip(paths, al, leaf_paths(b[part], part)[1]):
                per_leaf[path], rel = _leaf_floor(x, y)
                if s == 0 and part == "metrics" and rel > start[1]:
                    start = (path, rel)
        steps.append(per_leaf)
    return Floor(steps, start, chunks)


def _max_diff(g: Any, w: Any) -> float:
    return _leaf_floor(g, w)[0] if isinstance(g, torch.Tensor) else abs(float(g) - float(w))


def judge(got: dict, want: dict, floor: dict[str, float], part: str, rtol: float, atol: float
          ) -> tuple[str | None, tuple[str, float]]:
    """`got[part]` against `want[part]` with each leaf's atol raised to NOISE_FACTOR x its floor:
    (the first differing leaf's report, naming its floor, and the others' paths, or None;
    (path, difference / floor) of the leaf that came closest to its widened tolerance)."""
    gp, gl, _ = leaf_paths(got[part], part)
    wl = leaf_paths(want[part], part)[1]
    bad, worst = [], ("", 0.0)
    for path, g, w in zip(gp, gl, wl):
        f = floor.get(path, 0.0)
        leaf_atol = max(atol, NOISE_FACTOR * f)
        try:
            assert_trees_close(g, w, rtol, leaf_atol, root=path)
        except AssertionError as e:
            widened = f"atol = {NOISE_FACTOR:g} x its noise floor {f:.3g}" if leaf_atol > atol else \
                f"its noise floor {f:.3g} is below atol"
            bad.append(f"{e} [{widened}]")
            continue
        if f > 0 and leaf_atol > atol and _max_diff(g, w) / f > worst[1]:
            worst = (path, _max_diff(g, w) / f)
    if not bad:
        return None, worst
    others = [b.split(":", 1)[0] for b in bad[1:6]]
    return bad[0] + (f"; {len(bad) - 1} more leaves differ: {others}" if len(bad) > 1 else ""), worst


def floor_note(floor: Floor, used: bool) -> str:
    """How the floor was measured and whether it was used, for a failure message."""
    how = (f"the unsharded step on one process over the sharded run's {floor.chunks} micro-batches moves "
           f"{floor.start[0]} by {floor.start[1]:.3g} relative at step 0 against the whole-batch step")
    if used:
        return f"judged against the model's own noise floor ({how}; each leaf within max(atol, " \
               f"{NOISE_FACTOR:g} x its floor)), and still differs: a sharding error, not rounding"
    return (f"the model's own noise floor was not used: {how}, above {SPLIT_CEILING:g}, which rounding does "
            f"not explain (statistics over the micro-batch such as BatchNorm's, or a loss that is not a mean "
            f"over rows, make the result depend on the split)")


def warn_floor_used(what: str, floor: Floor, worst: tuple[str, float], sites: str | Exception, float64: bool,
                    rtol: float) -> None:
    """The NoiseFloorWarning after a pass that needed the floor: where the model computes below its
    dtype (`sites`, from `describe_sites`, or the exception the probe raised), how big the floor
    is, and how close the sharded run came."""
    if isinstance(sites, Exception):
        inside = f"(where the model narrows is unknown: a plain forward raised {type(sites).__name__}: {sites})"
    elif sites:
        inside = f"the {'float64 ' if float64 else ''}model computes in {sites}, so"
    else:
        inside = "no operation computes below the model's dtype, yet"
    warnings.warn(
        f"{what} passed only against the model's own noise floor: {inside} splitting the same rows into "
        f"the sharded run's {floor.chunks} micro-batches moves the unsharded step itself ({floor.start[0]} by "
        f"{floor.start[1]:.3g} relative at step 0), beyond the stated tolerance (rtol {rtol:g}). Each leaf was "
        f"judged within max(atol, {NOISE_FACTOR:g} x its floor); the sharded run differs from the whole-batch "
        f"step by at most {worst[1]:.3g} x its floor (at {worst[0]}). Pass noise_floor=False to judge at the "
        f"stated tolerance alone.",
        NoiseFloorWarning,
        stacklevel=3,
    )
