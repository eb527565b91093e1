"""A DeepSpeed checkpoint's full weights by name (`specs/checkpoint-format.md` §DeepSpeed,
"Weights"): the fp32 master where the run had one, else the module's own tensors.

Each file is read once, one at a time, and copied into the output tensors, which are allocated
first from `param_shapes`: the peak is the output plus one (mapped) file.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

import torch

from .._errors import CheckpointError
from ._ds_layout import DsCheckpoint, check_meta, optim_of as _optim
from ._ds_offsets import (EXPERT_ID, expert_names, expert_replicas, frozen_shapes, list_of as _list,
                          shapes_of as _shapes, zero12_offsets, zero3_offsets)
from ._ds_pickle import load_ds_file

__all__ = ["DsWeights", "consolidate", "ties", "zero3_frozen", "group_shapes", "pipeline_module", "expert_files"]


@dataclass
class DsWeights:
    """`tensors`: one per stored tensor, under its first name, in the model's state_dict order;
    `aliases`: first name -> the tied names that share it; `frozen`, `buffers`: names."""

    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    aliases: dict[str, list[str]] = field(default_factory=dict)
    frozen: set[str] = field(default_factory=set)
    buffers: set[str] = field(default_factory=set)
    frozen_known: bool = True  # stage 0 does not record which parameters were frozen
    master: bool = False  # trainable weights came from an fp32 master copy


def _fragment_shapes(ck: DsCheckpoint, mp: int, module: dict) -> list[list[tuple[str, tuple[int, ...]]]]:
    """A group's names and shapes where the model file records no `param_shapes` (BF16_Optimizer
    without ZeRO, as a bf16 pipeline runs): the names of every rank's `param_slice_mappings`, in
    order, shaped as the module's tensors (a first pass over the files' small fields only)."""
    groups: list[dict[str, None]] = []
    for r in range(ck.dp):
        osd, where = _optim(ck, r, mp)
        maps = osd.get("param_slice_mappings")
        if not isinstance(maps, list) or (groups and len(maps) != len(groups)):
            raise CheckpointError(f"{where}: no param_shapes in the model file and no usable param_slice_mappings")
        groups = groups or [{} for _ in maps]
        for g, m in enumerate(maps):
            groups[g].update(dict.fromkeys(str(n) for n in m))
    for g in groups:
        for n in g:
            if not isinstance(module.get(n), torch.Tensor):
                raise CheckpointError(f"{ck.dir}: param_slice_mappings name {n!r}, which no layer file holds")
    return [[(n, tuple(module[n].shape)) for n in g] for g in groups]


def _partitions(ck: DsCheckpoint, mp: int, shapes: list) -> tuple[list[list[torch.Tensor]], list[list[int]]]:
    """Each group's flat fp32 buffer (one per expert replica), filled from every rank's file in
    rank order; the alignment paddings after each parameter."""
    align: list[list[int]] = [[0] * len(g) for g in shapes]
    flats, filled, reps = [], [], []
    for r in range(ck.dp):
        osd, where = _optim(ck, r, mp)
        parts = _list(osd, "single_partition_of_fp32_groups", len(shapes), where)
        pads = _list(osd, "group_paddings", len(shapes), where)
        if r == 0:
            reps = expert_replicas(ck, osd, len(shapes), where)
            align = osd.get("param_alignment_paddings") or align  # (absent before DeepSpeed 0.19)
            flats = [[torch.empty(sum(math.prod(s) for _, s in g) + sum(a), dtype=torch.float32) for _ in range(e)]
                     for g, a, e in zip(shapes, _list({"a": align}, "a", len(shapes), where), reps)]
            filled = [[0] * e for e in reps]
        for g, (part, pad) in enumerate(zip(parts, pads)):
            if not isinstance(part, torch.Tensor) or part.dim() != 1:
                raise CheckpointError(f"{where}: single_partition_of_fp32_groups[{g}] is not a flat tensor")
            # ZeRO-1/2 store the partition without its padding; BF16_Optimizer (no zero_stage) with it.
            content = part if "zero_stage" in osd else part[: max(0, part.numel() - int(pad))]
            e = r % reps[g]
            flat, at = flats[g][e], filled[g][e]
            if at + content.numel() > flat.numel():
                raise CheckpointError(
                    f"{where}: group {g} partition holds {content.numel()} elements past the {flat.numel()} "
                    "that param_shapes account for (param_shapes disagree with the partition sizes)")
            flat[at: at + content.numel()] = content
            filled[g][e] += content.numel()
        del osd, parts
    for g, (f, n) in enumerate(zip(flats, filled)):
        if any(a != b.numel() for a, b in zip(n, f)):
            raise CheckpointError(f"{ck.dir}: group {g}: the ranks' partitions hold {n} elements, param_shapes account "
                                  f"for {f[0].numel()} (param_shapes disagree with the partition sizes)")
    return flats, align


def group_shapes(ck: DsCheckpoint, mp: int, meta: dict | None = None, module: dict | None = None) -> list:
    """Model-parallel rank `mp`'s (a pipeline stage's) optimizer groups, each its parameters' (name,
    shape) in order: the model file's `param_shapes`, else (BF16_Optimizer without ZeRO) the names
    of its optimizer files' `param_slice_mappings`. `meta`, `module`: that model file's (a
    pipeline's module: its layer files), read here when not given."""
    meta = meta if meta is not None else _module_of(ck, mp)[1]
    if meta.get("param_shapes") is None and ck.meta.get("bf16_optimizer"):
        if module is None:
            module = pipeline_module(ck) if ck.layer_files else _module_of(ck, mp)[0].get("module")
        return _fragment_shapes(ck, mp, module if isinstance(module, dict) else {})
    return _shapes(meta, ck.path(ck.model_files[(0, mp)]))


def _zero12(ck: DsCheckpoint, mp: int, meta: dict, module: dict, read: bool = True) -> dict[str, torch.Tensor]:
    """Stages 1-2 (and BF16_Optimizer): each group's flat fp32 buffer, cut into `dp` partitions,
    rank r holding partition r less the tail padding (`group_paddings`). `meta`: model-parallel
    rank `mp`'s model-states file. `read=False`: no optimizer file is opened, each parameter is a
    meta tensor of its shape (what a resume reads itself, `_ds_shard.py`)."""
    shapes = group_shapes(ck, mp, meta, module)
    if not read:  # (a MoE expert group: every expert-parallel rank's experts, by global id)
        osd, where = _optim(ck, 0, mp) if ck.expert_files else ({}, "")
        reps = expert_replicas(ck, osd, len(shapes), where)
        return {n: torch.empty(s, device="meta") for g, e_count in zip(shapes, reps) for e in range(e_count)
                for n, (_, s) in zip(expert_names(g, e), g)}
    flats, align = _partitions(ck, mp, shapes)
    out = {}
    for g, group in enumerate(shapes):
        offsets = zero12_offsets(group, align[g])[0]
        for e, flat in enumerate(flats[g]):
            names = expert_names(group, e) if len(flats[g]) > 1 else [n for n, _ in group]
            for name, (_, shape), (_, off, n) in zip(names, group, offsets):
                out[name] = flat[off: off + n].view(shape)
    return out


def _zero3_fill(out: dict, shapes_of: list[list[tuple[str, tuple]]], flats: list, r: int, w: int,
                where: str, what: str) -> None:
    for i, group in enumerate(shapes_of):
        flat = flats[i]
        offsets = zero3_offsets(group, w)
        for name, off, ps in offsets:
            if off + ps > flat.numel():
                raise CheckpointError(f"{where}: {what}[{i}] holds {flat.numel()} elements, fewer than param_shapes "
                                      f"need (param_shapes disagree with the partition sizes at {name!r})")
            out[name][r * ps: (r + 1) * ps] = flat[off: off + ps]
        total = sum(ps for _, _, ps in offsets)
        if total != flat.numel():
            raise CheckpointError(f"{where}: {what}[{i}] holds {flat.numel()} elements, param_shapes account for "
                                  f"{total} (param_shapes disagree with the partition sizes)")


def _zero3(ck: DsCheckpoint, w: DsWeights, read: bool = True, frozen: bool = True) -> dict[str, torch.Tensor]:
    """Stage 3: each parameter padded to a multiple of `dp`, rank r holding its r-th slice, the
    slices of one sub-group concatenated (`fp32_flat_groups`); frozen ones alike, per model file.
    `read=False`: the trainable ones are meta tensors and no optimizer file is opened; `frozen=False`:
    the frozen ones too and no model file is opened (a resume reads its shard of both, `_ds_shard.py`)."""
    shapes = _shapes(ck.meta, ck.path(ck.model_files[(0, 0)]))
    fshapes = frozen_shapes(ck.meta)
    w.frozen |= {n for n, _ in fshapes}
    out = {n: torch.empty(-(-math.prod(s) // ck.dp) * ck.dp, dtype=torch.float32) if read else
           torch.empty(math.prod(s), device="meta") for g in shapes for n, s in g}
    out.update({} if frozen else {n: torch.empty(math.prod(s), device="meta") for n, s in fshapes})
    for r in range(ck.dp):
        if read:
            osd, where = _optim(ck, r, 0)
            flats = _list(osd, "fp32_flat_groups", len(shapes), where)
            _zero3_fill(out, shapes, flats, r, ck.dp, where, "fp32_flat_groups")
            del osd
        if frozen and fshapes:
            name = ck.model_files[(r, 0)]
            frags = load_ds_file(ck.dir, name).get("frozen_param_fragments") or {}
            for n, s in fshapes:
                if n not in frags:
                    raise CheckpointError(f"{ck.path(name)}: frozen_param_fragments has no {n!r}")
                out.setdefault(n, torch.empty(-(-math.prod(s) // ck.dp) * ck.dp, dtype=frags[n].dtype))
            _zero3_fill(out, [[(n, s)] for n, s in fshapes], [frags[n].reshape(-1) for n, _ in fshapes], r,
                        ck.dp, ck.path(name), "frozen_param_fragments")
    return {n: out[n][: math.prod(s)].view(s) for g in [*shapes, fshapes] for n, s in g}


def zero3_frozen(ck: DsCheckpoint) -> dict[str, torch.Tensor]:
    """A ZeRO-3 checkpoint's frozen parameters, whole, from every rank's `frozen_param_fragments`
    (no optimizer file opened)."""
    w = DsWeights()
    got = _zero3(ck, w, read=False, frozen=True)
    return {n: got[n] for n in w.frozen}


def _stage0_list(opt, where: str) -> list[torch.Tensor]:
    """Stage 0 with a low-precision model: the unfused fp16/bf16 optimizer's `fp32_groups`, one fp32
    copy per trainable parameter in the order the optimizer was given them (none: no master)."""
    if isinstance(opt, dict) and "fp32_groups_flat" in opt:
        raise CheckpointError(f"{where}: a stage-0 fused fp16/bf16 optimizer (fp32_groups_flat) is not read yet")
    if not isinstance(opt, dict) or "fp32_groups" not in opt:
        return []
    groups = opt["fp32_groups"]
    if not isinstance(groups, list) or not all(isinstance(g, list) for g in groups):
        raise CheckpointError(f"{where}: optimizer 'fp32_groups' is not a list of lists of tensors")
    return [t for g in groups for t in g]


def _stage0_masters(masters: list, params: list[tuple[str, torch.Tensor]], where: str) -> dict:
    """The masters matched to parameters: frozen ones have none, so each master goes to the next
    parameter (in the module's order) of its shape whose value it rounds to."""
    out, i = {}, 0
    for m in masters:
        if not isinstance(m, torch.Tensor):
            raise CheckpointError(f"{where}: optimizer 'fp32_groups' holds a {type(m).__name__}, not a tensor")
        while i < len(params) and not (params[i][1].shape == m.shape and torch.equal(m.to(params[i][1].dtype),
                                                                                  params[i][1])):
            i += 1
        if i == len(params):
            raise CheckpointError(f"{where}: fp32_groups hold a {tuple(m.shape)} master that matches no parameter of "
                                  "the module in order (the module and its optimizer disagree)")
        out[params[i][0]] = m.float()
        i += 1
    return out


def ties(module: dict, skip: set) -> dict[str, str]:
    """alias -> first name, for module tensors that share storage (what `shared_params` says at ZeRO)."""
    seen, out = {}, {}
    for name, t in module.items():
        if name in skip or not isinstance(t, torch.Tensor) or t.numel() == 0:
            continue
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()))
        if key in seen:
            out[name] = seen[key]
        else:
            seen[key] = name
    return out


def _refuse_unread(ck: DsCheckpoint) -> None:
    if ck.tp > 1:
        raise CheckpointError(f"{ck.dir}: a tensor-parallel DeepSpeed checkpoint (tp degree {ck.tp}) is not read "
                              "yet: its model-parallel shards join along dimensions the files do not record")
    if ck.expert_files and (ck.layout == "per_param" or ck.layer_files or
                            (ck.layout == "whole" and ck.precision != "fp32")):
        raise CheckpointError(f"{ck.dir}: a DeepSpeed MoE checkpoint (expert files such as "
                              f"{sorted(ck.expert_files)[0]}) is read at ZeRO-1/2, or at stage 0 in fp32, not this "
                              "one (ZeRO-3, pipeline, or a stage-0 low-precision optimizer) yet")


_EXPERT_FILE = re.compile(r"^(?:layer_(\d+)_)?expert_(\d+)_mp_rank_\d+_model_states\.pt$")


def expert_files(ck: DsCheckpoint) -> list[tuple[int, int, dict]]:
    """The MoE expert files as (layer, global expert id, the expert's own tensors under their
    global names), in layer and id order."""
    out = []
    for name in (n for n in ck.expert_files if n.endswith("_model_states.pt")):
        m = _EXPERT_FILE.match(name)
        sd = load_ds_file(ck.dir, name)
        if m is None or not isinstance(sd, dict) or not all(isinstance(t, torch.Tensor) for t in sd.values()):
            raise CheckpointError(f"{ck.path(name)}: not an expert state dict (name -> tensor)")
        for key in sd:
            if not EXPERT_ID.search(str(key)):
                raise CheckpointError(f"{ck.path(name)}: {str(key)[:60]!r} is not a DeepSpeed expert's parameter")
        out.append((int(m[1] or 0), int(m[2]), sd))
    return sorted(out, key=lambda f: f[:2])


def _experts(ck: DsCheckpoint) -> dict:
    """The MoE expert files' tensors (the experts' own weights, under their global ids)."""
    return {n: t for *_, sd in expert_files(ck) for n, t in sd.items()}


def _module_of(ck: DsCheckpoint, mp: int) -> tuple[dict, dict]:
    name = ck.model_files[(0, mp)]
    state = load_ds_file(ck.dir, name)
    if not isinstance(state, dict):
        raise CheckpointError(f"{ck.path(name)}: not a DeepSpeed model-states dict")
    check_meta(state, ck.path(name))
    return state, {k: v for k, v in state.items() if k not in ("module", "optimizer")}


def pipeline_module(ck: DsCheckpoint) -> dict:
    """The pipeline's layer files as one state dict, each layer's keys under its index (`3.weight`),
    as `PipelineModule` names its layers."""
    module = {}
    for (layer, _), name in sorted(ck.layer_files.items()):
        sd = load_ds_file(ck.dir, name)
        if not isinstance(sd, dict) or not all(isinstance(t, torch.Tensor) for t in sd.values()):
            raise CheckpointError(f"{ck.path(name)}: not a layer state dict (name -> tensor)")
        module.update({f"{layer}.{k}": t for k, t in sd.items()})
    return module


def _sources(ck: DsCheckpoint, read: bool = True) -> tuple[dict, set, dict, set | None]:
    """(module state dict, buffer names, masters by name, names with no master that are frozen
    or None when the files do not say). `read=False`: the masters are meta tensors (`_zero12`)."""
    mps = sorted({mp for _, mp in ck.model_files})
    module = pipeline_module(ck) if ck.layer_files else {}
    buffers, masters, stage0 = set(), {}, []
    for mp in mps:
        state, meta = _module_of(ck, mp)
        buffers |= set(meta.get("buffer_names") or ())
        if not ck.layer_files:
            if not isinstance(state.get("module"), dict):
                raise CheckpointError(f"{ck.path(ck.model_files[(0, mp)])}: 'module' is not a state dict")
            module.update(state["module"])
            if mp == mps[0]:
                module.update(_experts(ck))
        if ck.layout == "flat":
            masters.update(_zero12(ck, mp, meta, module, read=read))
        else:
            stage0 += _stage0_list(state.get("optimizer"), ck.path(ck.model_files[(0, mp)]))
        del state
    if ck.layout == "whole":
        params = [(n, t) for n, t in module.items() if n not in buffers and isinstance(t, torch.Tensor)]
        masters = _stage0_masters(stage0, params, ck.path(ck.model_files[(0, mps[0])]))
    return module, buffers, masters, (None if ck.layout == "whole" and not stage0 else set())


def consolidate(ck: DsCheckpoint, trainable: bool = True) -> DsWeights:
    """The full weights of checkpoint `ck` (`describe`), checked against its `param_shapes`.
    `trainable=False`: the trainable weights of a ZeRO-1/2/3 checkpoint are meta tensors of their
    shapes and no optimizer file is opened (a resume reads its shard of them, `_ds_shard.py`)."""
    _refuse_unread(ck)
    w = DsWeights()
    if ck.layout == "per_param":
        module = _module_of(ck, 0)[0].get("module") or {}
        buffers, masters = set(ck.meta.get("buffer_names") or ()), _zero3(ck, w, read=trainable, frozen=trainable)
    else:
        module, buffers, masters, known = _sources(ck, read=trainable)
        w.frozen_known = known is not None
    shared = ck.meta.get("shared_params")  # (ZeRO records ties; elsewhere they share storage)
    shared = dict(shared) if isinstance(shared, dict) else ties(module, buffers)
    w.master = bool(masters) and (ck.precision != "fp32" or ck.layout == "per_param")
    for name, t in module.items():
        if name in buffers:
            w.buffers.add(name)
            w.tensors[name] = t
        elif name in shared:
            w.aliases.setdefault(shared[name], []).append(name)
        elif name in masters:
            m = masters.pop(name)
            if ck.layout != "per_param" and tuple(m.shape) != tuple(t.shape):
                raise CheckpointError(f"{ck.dir}: {name!r} is {tuple(t.shape)} in the module but {tuple(m.shape)} "
                                      "in param_shapes")
            w.tensors[name] = m
        elif ck.layout == "per_param":
            raise CheckpointError(f"{ck.dir}: parameter {name!r} is in no optimizer or frozen fragment file")
        else:
            w.tensors[name] = t
            if w.frozen_known:
                w.frozen.add(name)
    if masters:
        raise CheckpointError(f"{ck.dir}: param_shapes name {sorted(masters)[:5]} which the module does not have")
    missing = sorted(set(w.aliases) - set(w.tensors))
    if missing:
        raise CheckpointError(f"{ck.dir}: shared_params tie names to {missing[:5]}, which hold no tensor")
    return w

