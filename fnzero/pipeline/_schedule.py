"""Pipeline schedules: the order in which one stage runs the forward (F) and backward (B) of each
micro-batch (`specs/mesh.md` §Pipeline). Pure functions of (stages, micro-batches, stage).

* GPipe: every forward, then every backward. Each stage keeps all `m` micro-batches'
  activations; idle time (the bubble) is (p-1)/(m+p-1) of the step.
* 1F1B (PipeDream-flush): stage s runs `p-s-1` warm-up forwards, then alternates one forward and
  one backward, then drains the backwards. The same bubble as GPipe, but at most `p-s`
  micro-batches' activations are alive on stage s; it needs m >= p.

Backwards run in micro-batch order on every stage, so each pair of neighbouring stages sends and
receives in the same order, and the last micro-batch's backward is the last action everywhere
(its gradients' reductions start from it).
"""

from __future__ import annotations

from typing import NamedTuple

from .._errors import ConfigError

__all__ = ["Action", "gpipe", "one_f_one_b", "schedule", "SCHEDULES", "bubble_fraction"]


class Action(NamedTuple):
    kind: str  # "F" or "B"
    micro: int


def gpipe(stages: int, micro: int, stage: int) -> list[Action]:
    return [Action("F", j) for j in range(micro)] + [Action("B", j) for j in range(micro)]


def one_f_one_b(stages: int, micro: int, stage: int) -> list[Action]:
    warmup = min(stages - stage - 1, micro)
    out = [Action("F", j) for j in range(warmup)]
    f, b = warmup, 0
    while f < micro:
        out += [Action("F", f), Action("B", b)]
        f, b = f + 1, b + 1
    return out + [Action("B", j) for j in range(b, micro)]


SCHEDULES = {"gpipe": gpipe, "1f1b": one_f_one_b}


def schedule(name: str, stages: int, micro: int, stage: int) -> list[Action]:
    """Stage `stage`'s actions; a ConfigError names the numbers for an unknown schedule or, for
    1F1B, fewer micro-batches (gradient_accumulation_steps) than stages."""
    key = name.lower()
    if key not in SCHEDULES:
        raise ConfigError(f"pipeline schedule {name!r} is not one of {', '.join(SCHEDULES)}")
    if key == "1f1b" and micro < stages:
        raise ConfigError(f"the 1F1B schedule needs at least as many micro-batches as stages: gradient_accumulation_steps "
                          f"is {micro}, the pipeline has {stages} stages (raise it to >= {stages}, or use 'gpipe')")
    return SCHEDULES[key](stages, micro, stage)


def bubble_fraction(stages: int, micro: int) -> float:
    """The idle fraction of a step in theory, for equal stages: (p-1)/(m+p-1)."""
    return (stages - 1) / (micro + stages - 1)
