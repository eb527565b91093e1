"""Where each parameter's elements sit in a DeepSpeed ZeRO checkpoint's flat partitions
(`specs/checkpoint-format.md` §DeepSpeed, "Weights"), computed from `param_shapes`, the alignment
paddings and the world size alone: the arithmetic `consolidate` walks every file with and a resume
reads one rank's shard with (`_ds_shard.py`), so the two cannot disagree.

ZeRO-1/2 (and BF16_Optimizer): a group's parameters are laid end to end, each followed by its
alignment padding; the group is padded to a multiple of 2 x world and cut into `world` equal
partitions, rank r holding the r-th less the tail padding. ZeRO-3: each parameter is padded to a
multiple of the world size, rank r holding slice r of each, the slices of a sub-group end to end.

A MoE expert group is partitioned over the expert-data-parallel ranks only (`partition_count`
= world / ep): rank r holds partition r // ep of expert-parallel rank e = r % ep's experts, which
every rank names locally (`deepspeed_experts.0` ...); DeepSpeed's expert files, and these runs,
name them by global id `e * (experts per rank) + local id`. A pipeline's stages (model-parallel
ranks) each have their own groups and files: each stage's runs carry its `mp`.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from .._errors import CheckpointError
from ._ds_layout import DsCheckpoint

__all__ = ["Run", "FROZEN", "shapes_of", "list_of", "zero12_offsets", "zero12_partition", "zero3_offsets", "runs",
           "frozen_shapes", "frozen_runs", "expert_names", "expert_replicas", "EXPERT_ID"]

FROZEN = -1  # a Run's `group` for a frozen parameter's fragment in a ZeRO-3 model file
_ALIGN = 2  # DeepSpeed's nccl_start_alignment_factor: a ZeRO-1/2 group is padded to 2 x world elements


@dataclass(frozen=True)
class Run:
    """Elements [lo, hi) of one parameter sit at `pos`... of flat group `group` in the file of
    data-parallel rank `rank`, model-parallel rank (pipeline stage) `mp`."""

    rank: int
    group: int
    pos: int
    lo: int
    hi: int
    mp: int = 0


def shapes_of(meta: dict, where: str) -> list[list[tuple[str, tuple[int, ...]]]]:
    groups = meta.get("param_shapes")
    if not isinstance(groups, list) or not all(isinstance(g, dict) for g in groups):
        raise CheckpointError(f"{where}: 'param_shapes' is missing or not a list of name -> shape maps")
    return [[(str(n), tuple(int(d) for d in s)) for n, s in g.items()] for g in groups]


def list_of(osd: dict, key: str, n: int, where: str) -> list:
    v = osd.get(key)
    if not isinstance(v, list) or len(v) != n:
        raise CheckpointError(f"{where}: '{key}' should be a list of {n} entries (one per group of param_shapes)")
    return v


def zero12_offsets(group: list[tuple[str, tuple]], align: list) -> tuple[list[tuple[str, int, int]], int]:
    """(each parameter's (name, offset, numel) in its ZeRO-1/2 flat group, the group's length
    before its tail padding). `align`: the padding after each parameter."""
    out, off = [], 0
    for (name, shape), pad in zip(group, align):
        n = math.prod(shape)
        out.append((name, off, n))
        off += n + int(pad)
    return out, off - (int(align[-1]) if align else 0)


def zero12_partition(length: int, world: int) -> int:
    """The elements of each rank's ZeRO-1/2 partition of a group `length` long (before padding)."""
    return -(-length // (_ALIGN * world)) * _ALIGN


def zero3_offsets(group: list[tuple[str, tuple]], world: int) -> list[tuple[str, int, int]]:
    """Each parameter's (name, offset in every rank's flat sub-group, slice length `ps`): rank r
    holds its elements [r * ps, (r + 1) * ps), the tail past numel being padding."""
    out, off = [], 0
    for name, shape in group:
        ps = -(-math.prod(shape) // world)
        out.append((name, off, ps))
        off += ps
    return out


EXPERT_ID = re.compile(r"(deepspeed_experts\.)(\d+)(?=\.)")


def expert_names(group: list[tuple[str, tuple]], replica: int) -> list[str]:
    """A MoE group's local names (`...deepspeed_experts.1.weight` on every rank) renamed to the global
    expert ids of expert-parallel rank `replica`, as DeepSpeed names them in its expert files."""
    local: dict[str, set[int]] = {}
    for name, _ in group:
        if m := EXPERT_ID.search(name):
            local.setdefault(name[: m.start()], set()).add(int(m[2]))
    if replica == 0 and len(local) == 0:
        return [n for n, _ in group]

    def rename(name: str) -> str:
        m = EXPERT_ID.search(name)
        if m is None:
            raise CheckpointError(f"parameter {name!r} of a MoE expert group is not named as a DeepSpeed expert")
        return f"{name[: m.start()]}{m[1]}{replica * len(local[name[: m.start()]]) + int(m[2])}{name[m.end():]}"

    return [rename(n) for n, _ in group]


def expert_replicas(ck: DsCheckpoint, osd: dict, n: int, where: str) -> list[int]:
    """Per group, how many different flat buffers the ranks hold (`osd`: a rank's optimizer state):
    1, or for a MoE expert group (partitioned over the expert-data-parallel ranks only,
    `partition_count`) the expert-parallel size."""
    counts = osd.get("partition_count") or [ck.dp] * n
    if not isinstance(counts, list) or len(counts) != n or any(type(c) is not int or c < 1 or ck.dp % c
                                                                 for c in counts):
        raise CheckpointError(f"{where}: 'partition_count' should be {n} divisors of the world size {ck.dp}")
    if any(c != ck.dp for c in counts) and (ck.meta.get("ds_config") or {}).get("use_data_before_expert_parallelism"):
        raise CheckpointError(f"{where}: use_data_before_expert_parallelism lays experts out in a way not read yet")
    return [ck.dp // c for c in counts]


def runs(ck: DsCheckpoint, shapes: list, align: list[list[int]], mp: int = 0,
         replicas: list[int] | None = None) -> dict[str, list[Run]]:
    """Every trainable parameter's runs over the files of model-parallel rank `mp` (ZeRO-1/2 layout
    "flat" with its alignment paddings `align` and, per group, `replicas` (`expert_replicas`);
    ZeRO-3 "per_param"), from the arithmetic alone; expert parameters under their global names."""
    out: dict[str, list[Run]] = {}
    w = ck.dp
    for g, group in enumerate(shapes):
        if ck.layout == "per_param":
            for (name, off, ps), (_, shape) in zip(zero3_offsets(group, w), group):
                n = math.prod(shape)
                out[name] = [Run(r, g, off, r * ps, min(n, (r + 1) * ps), mp) for r in range(w) if r * ps < n]
            continue
        ep = replicas[g] if replicas else 1
        offsets, length = zero12_offsets(group, align[g])
        part = zero12_partition(length, w // ep)
        for e in range(ep):
            names = expert_names(group, e) if ep > 1 else [n for n, _ in group]
            for name, (_, off, n) in zip(names, offsets):
                first, last = off // part, (off + n - 1) // part if n else off // part - 1
                out[name] = [Run(p * ep + e, g, max(off, p * part) - p * part, max(off, p * part) - off,
                                 min(off + n, (p + 1) * part) - off, mp) for p in range(first, last + 1)]
    return out


def frozen_shapes(meta: dict) -> list[tuple[str, tuple[int, ...]]]:
    """ZeRO-3's frozen parameters (`frozen_param_shapes`), in order."""
    return [(str(n), tuple(int(d) for d in s)) for n, s in (meta.get("frozen_param_shapes") or {}).items()]


def frozen_runs(ck: DsCheckpoint) -> dict[str, list[Run]]:
    """ZeRO-3's frozen parameters' runs: each padded to a multiple of the world size like a
    trainable one, rank r's model file holding slice r (`frozen_param_fragments[name]`, group
    `FROZEN`, from its position 0)."""
    out = {}
    for name, shape in frozen_shapes(ck.meta):
        n, ps = math.prod(shape), -(-math.prod(shape) // ck.dp)
        out[name] = [Run(r, FROZEN, 0, r * ps, min(n, (r + 1) * ps)) for r in range(ck.dp) if r * ps < n]
    return out
