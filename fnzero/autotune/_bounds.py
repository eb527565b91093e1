"""How far the autotuner's micro-batch grid grows (`specs/autotune.md` §Bounds): a candidate is
pruned by the memory, or skipped by the time, its layout's trials measured at two other sizes
extrapolate to; neither judges a layout before two of its sizes ran.
"""

from __future__ import annotations

import os

from ._space import Candidate

__all__ = ["host_memory_bytes", "activation_bytes_per_sample", "memory_floor", "trial_overhead_s", "two_sizes_ran"]

# Each candidate that ran and its kept result ("ok"): `peak_memory_bytes`, `step_time_s` and `wall_s`
# (`fnzero autotune`'s TrialResult).
Ran = list[tuple[Candidate, object]]


def host_memory_bytes() -> int | None:
    """This machine's physical memory (None where the OS does not say)."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def _groups(c: Candidate, ran: Ran) -> dict[tuple[int, str], list[tuple[int, int]]]:
    """(stage, offload) -> [(micro, peak bytes)] of c's layout's trials that measured their peak."""
    out: dict[tuple[int, str], list[tuple[int, int]]] = {}
    for r, res in ran:
        if r.layout == c.layout and res.peak_memory_bytes:
            out.setdefault((r.stage, r.offload), []).append((r.micro, res.peak_memory_bytes))
    return out


def two_sizes_ran(c: Candidate, ran: Ran) -> bool:
    """Whether one (stage, offload) of c's layout ran two micro-batch sizes: then a growth per sample
    is measured (the step's slope, the peak memory's), not the one trial's total spread over its samples."""
    sizes: dict[tuple[int, str], set[int]] = {}
    for r, _ in ran:
        if r.layout == c.layout:
            sizes.setdefault((r.stage, r.offload), set()).add(r.micro)
    return any(len(s) >= 2 for s in sizes.values())


def activation_bytes_per_sample(c: Candidate, ran: Ran) -> float | None:
    """The least growth of peak memory per sample among c's layout's (stage, offload) groups that ran
    two sizes, each between its two largest (None when none did). The least, so that a bound built
    on it stays a lower bound: what a candidate needs at least."""
    slopes = []
    for points in _groups(c, ran).values():
        top = sorted(dict(points).items())[-2:]  # by micro, the last job of a size wins (they agree)
        if len(top) == 2:
            (m1, p1), (m2, p2) = top
            slopes.append(max(0.0, (p2 - p1) / (m2 - m1)))
    return min(slopes) if slopes else None


def memory_floor(c: Candidate, ran: Ran, state_bytes: int, per_sample: float) -> int:
    """The least peak bytes one rank of `c` needs: the planner's model state plus `per_sample`
    activation bytes per sample, and, where c's own (stage, offload) ran a smaller size, that
    trial's measured peak grown by the same rate."""
    floor = state_bytes + per_sample * c.micro
    below = [(m, p) for m, p in _groups(c, ran).get((c.stage, c.offload), []) if m < c.micro]
    if below:
        m, p = max(below)
        floor = max(floor, p + per_sample * (c.micro - m))
    return int(floor)


def trial_overhead_s(ran: Ran, steps: int) -> float:
    """What a trial costs beside its steps (starting the ranks, building the model, measuring the
    link): the least of each trial's wall time less its `steps` steps; 0 before a trial timed it."""
    spare = [res.wall_s - steps * res.step_time_s for _, res in ran if res.wall_s > 0 and res.step_time_s]
    return max(0.0, min(spare)) if spare else 0.0
