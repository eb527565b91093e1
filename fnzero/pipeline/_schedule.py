"""Pipeline schedules: the order in which one stage runs the forward (F) and backward (B) of each
micro-batch. Pure functions of (stages, micro-batches, stage). GPipe, 1F1B and interleaved 1F1B,
their bubbles, and why backwards run in micro-batch order on every stage: `specs/mesh.md` §Pipeline.
"""

from __future__ import annotations

from typing import NamedTuple

from .._errors import ConfigError

__all__ = ["Action", "gpipe", "one_f_one_b", "interleaved", "schedule", "SCHEDULES", "bubble_fraction"]


class Action(NamedTuple):
    kind: str  # "F" or "B"
    micro: int
    chunk: int = 0  # which of the rank's chunks (interleaved schedules)


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


def interleaved(stages: int, micro: int, stage: int, chunks: int) -> list[Action]:
    """Megatron's interleaved 1F1B: virtual micro-batch k is micro-batch (k // (p·v))·p + k % p of
    chunk (k // p) % v (forward) or v-1 - (k // p) % v (backward); stage s runs
    2(p-s-1) + (v-1)·p warm-up forwards, then one forward and one backward in turn."""
    p, v = stages, chunks

    def which(k: int, backward: bool) -> tuple[int, int]:
        c = (k // p) % v
        return (k // (p * v)) * p + k % p, (v - 1 - c) if backward else c

    total = micro * v
    warmup = min(2 * (p - stage - 1) + (v - 1) * p, total)
    out = [Action("F", *which(k, False)) for k in range(warmup)]
    f, b = warmup, 0
    while f < total:
        out += [Action("F", *which(f, False)), Action("B", *which(b, True))]
        f, b = f + 1, b + 1
    return out + [Action("B", *which(k, True)) for k in range(b, total)]


SCHEDULES = {"gpipe": gpipe, "1f1b": one_f_one_b, "interleaved": interleaved}


def schedule(name: str, stages: int, micro: int, stage: int, chunks: int = 1) -> list[Action]:
    """Stage `stage`'s actions; a ConfigError names the numbers for an unknown schedule, for 1F1B
    fewer micro-batches (gradient_accumulation_steps) than stages, for the interleaved schedule a
    micro-batch count that is not a multiple of the stages, and for virtual stages (`chunks` > 1)
    any schedule but the interleaved one."""
    key = name.lower()
    if key not in SCHEDULES:
        raise ConfigError(f"pipeline schedule {name!r} is not one of {', '.join(SCHEDULES)}")
    if key in ("1f1b", "interleaved") and micro < stages:
        raise ConfigError(f"the {name} schedule needs at least as many micro-batches as stages: gradient_accumulation_steps "
                          f"is {micro}, the pipeline has {stages} stages (raise it to >= {stages}, or use 'gpipe')")
    if key == "interleaved":
        if micro % stages:
            raise ConfigError(f"the interleaved schedule runs micro-batches in groups of the stage count: "
                              f"gradient_accumulation_steps is {micro}, not a multiple of the {stages} stages")
        return interleaved(stages, micro, stage, chunks)
    if chunks > 1:
        raise ConfigError(f"a pipeline with {chunks} virtual stages per rank runs the 'interleaved' schedule, not {name!r}")
    return SCHEDULES[key](stages, micro, stage)


def bubble_fraction(stages: int, micro: int, chunks: int = 1) -> float:
    """The idle fraction of a step in theory, for equal stages: (p-1)/(v·m+p-1) (v = 1 but for
    interleaving)."""
    return (stages - 1) / (chunks * micro + stages - 1)
