"""One rank's shard of a DeepSpeed ZeRO-1/2/3 checkpoint, read alone (`specs/checkpoint-format.md`
§DeepSpeed, "Resuming in fnzero", "Memory and files").

The element ranges each parameter's fp32 weights and Adam moments need on this rank follow from
`like`'s leaves (its units' slots cut by its shard); `_ds_offsets.runs` says which rank's file holds
each range, from `param_shapes` and the world size alone. Only the files that overlap are opened,
one at a time, and only the overlapping slices are copied out: the files are mapped, so the pages
of the other ranks' elements are never read. Every opened file's partition sizes are checked
against the arithmetic, and its Adam step against the others'.

A pipeline's stages are model-parallel ranks with their own groups and files
(`zero_pp_rank_{dp}_mp_rank_{stage}`); a parameter is found in the one stage whose groups name it,
so a rank holding one fnzero stage opens only the files of the DeepSpeed stages holding its layers.
A MoE expert group's parameters carry their global expert ids (`_ds_offsets.expert_names`); under
fnzero's expert parallelism each rank's experts are looked up by their names in the whole model.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .._errors import CheckpointError
from .._state import TrainState
from ._ds_layout import DsCheckpoint, optim_of
from ._ds_offsets import (FROZEN, Run, expert_replicas, frozen_runs, list_of, runs, shapes_of, zero12_offsets,
                          zero12_partition, zero3_offsets)
from ._ds_optim import MOMENTS, adam_step, flat_moment, zero3_moments
from ._ds_pickle import load_ds_file
from ._ds_weights import group_shapes
from ._tree import state_leaves, units_by_key

__all__ = ["ShardRead", "WEIGHTS", "leaf_needs"]

WEIGHTS = "weights"  # the fp32 weights; the other fields are Adam's moments, by torch's names


@dataclass(frozen=True)
class _Stage:
    """One model-parallel rank's optimizer groups: each group's (name, shape), the alignment padding
    after each parameter, and how many expert-parallel replicas of it the ranks hold."""

    shapes: list
    align: list[list[int]]
    replicas: list[int]


class ShardRead:
    """What this rank of `like` needs of checkpoint `ck` (computed at once, no optimizer file
    opened but for the small fields of rank 0's where the layout needs them) and, after `read()`,
    those elements: `piece(field, name, a, b)`."""

    extra_steps = 0  # Adam's count less the steps applied: none at ZeRO-1/2/3

    def __init__(self, ck: DsCheckpoint, like: TrainState):
        self.ck = ck
        self.stages = {mp: self._stage(mp) for mp in sorted({mp for _, mp in ck.model_files})}
        self.runs: dict[str, list[Run]] = {}
        for mp, st in self.stages.items():
            for name, found in runs(ck, st.shapes, st.align, mp, st.replicas).items():
                if name in self.runs:
                    raise CheckpointError(f"{ck.dir}: parameter {name!r} is in the optimizer groups of two "
                                          f"model-parallel ranks ({self.runs[name][0].mp} and {mp})")
                self.runs[name] = found
        if ck.layout == "per_param":  # (ZeRO-1/2 keep frozen weights whole in the model file: read by name)
            self.runs.update(frozen_runs(ck))
        self.needs, self.names = leaf_needs(like, self.runs)
        self.by_file: dict[tuple[int, int], list[tuple[str, str, Run, int, int]]] = {}
        for field, needs in self.needs.items():
            for name, (a, b) in needs.items():
                for run in self.runs[name]:
                    lo, hi = max(a, run.lo), min(b, run.hi)
                    if lo < hi:
                        self.by_file.setdefault((run.rank, run.mp), []).append((field, name, run, lo, hi))
        # The optimizer files this rank opens, (DeepSpeed dp rank, mp rank); a ZeRO-3 frozen
        # parameter's fragment is in the model file of its dp rank instead.
        self.files = sorted(f for f, entries in self.by_file.items() if any(e[2].group != FROZEN for e in entries))
        self.pieces: dict[str, dict[str, tuple[int, torch.Tensor]]] = {}
        self.elements = 0  # how many elements `read` copied out of the files

    def _stage(self, mp: int) -> _Stage:
        """Model-parallel rank `mp`'s groups (ZeRO-3: `param_shapes` of the one model file)."""
        ck = self.ck
        if ck.layout == "per_param":
            shapes = shapes_of(ck.meta, ck.path(ck.model_files[(0, 0)]))
            return _Stage(shapes, [[0] * len(g) for g in shapes], [1] * len(shapes))
        shapes = group_shapes(ck, mp, ck.meta if (0, mp) == min(ck.model_files) else None)
        zeros = [[0] * len(g) for g in shapes]
        zero_cfg = (ck.meta.get("ds_config") or {}).get("zero_optimization") or {}
        aligned = isinstance(zero_cfg, dict) and zero_cfg.get("parameter_alignment")
        if not aligned and not ck.expert_files:
            return _Stage(shapes, zeros, [1] * len(shapes))
        # The alignment paddings (none unless the run set `parameter_alignment`) and a MoE run's
        # partition counts are small fields of rank 0's file, the same in every rank's.
        osd, where = optim_of(ck, 0, mp)
        align = list_of({"a": osd.get("param_alignment_paddings") or zeros}, "a", len(shapes), where) if aligned \
            else zeros
        return _Stage(shapes, align, expert_replicas(ck, osd, len(shapes), where))

    def adam_step(self) -> int:
        """The Adam step of the first file this rank reads (`read` checks the others against it)."""
        dp, mp = self.files[0] if self.files else (0, min(self.stages))
        osd, where = optim_of(self.ck, dp, mp)
        return adam_step(osd, len(self.stages[mp].shapes), self.ck.layout == "per_param", where)

    def read(self) -> None:
        """Copy the needed elements out of the overlapping files, one file at a time."""
        for field, needs in self.needs.items():
            self.pieces[field] = {n: (a, torch.empty(b - a, dtype=torch.float32)) for n, (a, b) in needs.items()}
        steps: dict[int, str] = {}
        for r, mp in sorted(self.by_file):
            entries = self.by_file[(r, mp)]
            flats: dict = {}
            if (r, mp) in self.files:
                osd, where = optim_of(self.ck, r, mp)
                wanted = {f for f, _, run, *_ in entries if run.group != FROZEN}  # (in order: the weights' lengths first)
                flats = {f: self._flats(osd, f, r, mp, where) for f in self.needs if f in wanted}
                steps.setdefault(adam_step(osd, len(self.stages[mp].shapes), self.ck.layout == "per_param", where),
                                 where)
                del osd
            if any(run.group == FROZEN for _, _, run, *_ in entries):
                flats[FROZEN] = self._fragments(r)
            for field, name, run, lo, hi in entries:
                a, buf = self.pieces[field][name]
                p = run.pos + lo - run.lo
                src = flats[FROZEN][name] if run.group == FROZEN else flats[field][run.group]
                buf[lo - a: hi - a] = src[p: p + hi - lo]
                self.elements += hi - lo
            del flats
        if len(steps) > 1:
            raise CheckpointError(f"{self.ck.dir}: the ranks' optimizer files are at different steps "
                                  f"({', '.join(f'{s} in {w}' for s, w in sorted(steps.items()))})")

    def _fragments(self, r: int) -> dict[str, torch.Tensor]:
        """ZeRO-3 rank `r`'s frozen fragments by name (flat), each as long as the arithmetic says."""
        name = self.ck.model_files[(r, 0)]
        frags = load_ds_file(self.ck.dir, name).get("frozen_param_fragments") or {}
        out = {}
        for n, runs_of in self.runs.items():
            mine = [run for run in runs_of if run.group == FROZEN and run.rank == r]
            if not mine:
                continue
            t = frags.get(n)
            want = mine[0].hi - mine[0].lo
            if not isinstance(t, torch.Tensor) or t.numel() < want:
                got = t.numel() if isinstance(t, torch.Tensor) else "none"
                raise CheckpointError(f"{self.ck.path(name)}: frozen_param_fragments[{n!r}] holds {got} elements where "
                                      f"frozen_param_shapes and the world size {self.ck.dp} put {want}")
            out[n] = t.reshape(-1)
        return out

    def _flats(self, osd: dict, field: str, r: int, mp: int, where: str) -> list[torch.Tensor]:
        """Rank `r`'s flat groups of `field`, each checked to be as long as the arithmetic says."""
        st = self.stages[mp]
        n = len(st.shapes)
        if self.ck.layout == "per_param":
            flats = list_of(osd, "fp32_flat_groups", n, where) if field == WEIGHTS else zero3_moments(osd, n, field,
                                                                                                   where)
            want = [sum(ps for *_, ps in zero3_offsets(g, self.ck.dp)) for g in st.shapes]
        else:
            worlds = [self.ck.dp // e for e in st.replicas]  # (an expert group: the expert-data-parallel size)
            counts = osd.get("partition_count")
            if counts is not None and counts != worlds:
                raise CheckpointError(f"{where}: 'partition_count' {counts} is not {worlds}, what rank 0's file and "
                                      f"the world size {self.ck.dp} say")
            parts = list_of(osd, "single_partition_of_fp32_groups", n, where)
            pads = list_of(osd, "group_paddings", n, where)
            flats, want = [], []
            for g, (part, pad) in enumerate(zip(parts, pads)):
                if not isinstance(part, torch.Tensor) or part.dim() != 1:
                    raise CheckpointError(f"{where}: single_partition_of_fp32_groups[{g}] is not a flat tensor")
                # ZeRO-1/2 store the partition without its padding; BF16_Optimizer (no zero_stage) with it.
                content = part if "zero_stage" in osd else part[: max(0, part.numel() - int(pad))]
                flats.append(content if field == WEIGHTS else flat_moment(osd, g, n, field, content, int(pad), where))
                length = zero12_offsets(st.shapes[g], st.align[g])[1]
                part_len = zero12_partition(length, worlds[g])
                want.append(max(0, min(part_len, length - (r // st.replicas[g]) * part_len)))
        for g, (flat, m) in enumerate(zip(flats, want)):
            if not isinstance(flat, torch.Tensor) or flat.dim() != 1 or flat.numel() != m:
                got = flat.numel() if isinstance(flat, torch.Tensor) else type(flat).__name__
                raise CheckpointError(f"{where}: group {g}'s {field} holds {got} elements where param_shapes and the "
                                      f"world size {self.ck.dp} put {m} (param_shapes disagree with the partitions)")
        return flats

    def piece(self, field: str, name: str, a: int, b: int) -> torch.Tensor | None:
        """Elements [a, b) of parameter `name` (fnzero's slot name) of `field`, None where this
        read holds none of it (below ZeRO-3, a frozen parameter: read whole by `consolidate`)."""
        name = self.names.get(name, name)
        held = self.pieces.get(field, {}).get(name)
        if held is None:
            return None
        lo, buf = held
        if a < lo or b - lo > buf.numel():
            raise CheckpointError(f"elements [{a}, {b}) of {name!r} ({field}) were not read for this rank's shard")
        return buf[a - lo: b - lo]


def _saved_names(like: TrainState, unit, slot) -> tuple[str, ...]:
    """The names a slot of `like` may have in the checkpoint: its own and its aliases; an expert's
    under fnzero's expert parallelism (named locally on every ep rank) as in the whole model, the
    global expert ids DeepSpeed's files use."""
    names = (slot.name, *slot.aliases)
    ep = like.sharding.ep
    if ep is None or not unit.is_expert:
        return names
    prefix, out = unit.module + ".", []
    for n in names:
        there, stacked = ep.renames[unit.module](n[len(prefix):], ep.rank)
        if stacked:
            raise CheckpointError(f"{slot.name!r}: experts stacked in one tensor are not in a DeepSpeed checkpoint, "
                                  "which keeps each expert's parameters apart (deepspeed_experts.N...)")
        out.append(prefix + there)
    return tuple(out)


def leaf_needs(like: TrainState, known) -> tuple[dict[str, dict[str, tuple[int, int]]], dict[str, str]]:
    """(field -> checkpoint name -> the element range [a, b) this rank's leaves of `like` hold of
    it, fnzero's slot name -> the checkpoint's name for it): the parameters' weights (`params`,
    `master`, and `frozen`: a frozen unit's share, or all of a frozen parameter held whole) and
    Adam's moments, each parameter under the first of its names (a tied one's aliases, an expert's
    global name: `_saved_names`) that `known` holds."""
    units = units_by_key(like.sharding.plan)
    out: dict[str, dict[str, tuple[int, int]]] = {f: {} for f in (WEIGHTS, *MOMENTS)}
    names: dict[str, str] = {}

    def need(field: str, slot_name: str, candidates: tuple, a: int, b: int) -> None:
        name = next((n for n in candidates if n in known), None)
        if a >= b or name is None:  # (a name the checkpoint lacks is refused by the model check)
            return
        names[slot_name] = name
        lo, hi = out[field].get(name, (a, b))
        out[field][name] = (min(lo, a), max(hi, b))

    for leaf in state_leaves(like):
        top, _, rest = leaf.path.partition("/")
        field = WEIGHTS if top in ("params", "master", "frozen") else rest.partition("/")[0] if top == "opt_state" else ""
        if leaf.per_rank or field not in out:
            continue
        if leaf.unit is None:
            if top == "frozen":
                need(WEIGHTS, rest, (rest,), 0, leaf.tensor.numel())
            continue
        u = units[leaf.unit]
        for s in u.slots:
            need(field, s.name, _saved_names(like, u, s), max(leaf.lo, s.offset) - s.offset,
                 min(leaf.hi, s.offset + s.numel) - s.offset)
    return out, names
