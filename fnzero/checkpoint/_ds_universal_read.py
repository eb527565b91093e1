"""DeepSpeed universal checkpoints read (`specs/checkpoint-format.md` §DeepSpeed, "Universal (read)"):
what DeepSpeed 0.19.8's `ds_to_universal` writes, and fnzero's own `to_deepspeed_universal`.

A universal tag directory holds every trainable parameter whole, in files of its own:
`zero/<name>/fp32.pt`, `exp_avg.pt`, `exp_avg_sq.pt` (`{'param': tensor, 'cat_dim': ...}`, or for
DeepSpeed's ZeRO-3 converter the bare flat tensor) and, from a ZeRO-1/2 converter, `step.pt`
(Adam's step); `zero/optimizer_state.pt` (hyper-parameters, the loss scaler, a ZeRO-3 run's Adam
step) and the model-states files copied from the run (step counts, schedule, shapes, buffers).

A rank opens only the parameter directories its shard overlaps and copies only its elements out of
the mapped files (`leaf_needs`, as `_ds_shard.ShardRead` does with the flat partitions). Frozen
parameters are not in `zero/` (DeepSpeed's universal load takes them from the model): a resume
keeps `like`'s own; an export takes them from `module` where it holds them whole (ZeRO-1/2) or from
ZeRO-3's `frozen_param_fragments`, else refuses them by name.
"""

from __future__ import annotations

import math
import os

import torch

from .._errors import CheckpointError
from .._state import TrainState
from ._ds_layout import UNIVERSAL_DIR, UNIVERSAL_OPTIM, DsCheckpoint
from ._ds_offsets import shapes_of
from ._ds_optim import as_count, states_step
from ._ds_pickle import load_ds_file
from ._ds_shard import WEIGHTS, ShardRead, leaf_needs
from ._ds_weights import DsWeights, _module_of, zero3_frozen
from ._safe import entry_kind, open_dir

__all__ = ["UniversalRead", "universal_weights", "universal_optimizer_state", "check_universal"]

FILES = {WEIGHTS: "fp32", "exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq"}  # field -> zero/<name>/<file>.pt


class ParamFiles:
    """The files under a universal checkpoint's `zero/`, opened as fnzero opens its own (no links
    below the tag directory, regular files only). `opened`: the parameter directories read."""

    def __init__(self, ck: DsCheckpoint):
        self.ck, self.root, self.opened = ck, os.path.join(ck.dir, UNIVERSAL_DIR), []

    def __enter__(self) -> ParamFiles:
        tag_fd = open_dir(self.ck.dir, None, self.ck.dir)
        try:
            self.fd = open_dir(UNIVERSAL_DIR, tag_fd, self.root)
        finally:
            os.close(tag_fd)
        return self

    def __exit__(self, *exc) -> None:
        os.close(self.fd)

    def optimizer_state(self) -> tuple[dict, str]:
        where = os.path.join(self.root, UNIVERSAL_OPTIM)
        osd = load_ds_file(self.root, UNIVERSAL_OPTIM, dir_fd=self.fd)
        if not isinstance(osd, dict):
            raise CheckpointError(f"{where}: holds a {type(osd).__name__}, not the optimizer's state dict")
        return osd, where

    def load(self, name: str, file: str, required: bool = True):
        """What zero/<name>/<file>.pt holds; None for a file not `required` that is absent."""
        where = os.path.join(self.root, _dir_name(self.ck, name))
        try:
            fd = open_dir(name, self.fd, where)
        except FileNotFoundError:
            raise CheckpointError(f"{where}: missing; a universal checkpoint holds a directory per trainable "
                                  "parameter (param_shapes names it)") from None
        try:
            if where not in self.opened:
                self.opened.append(where)
            if not required and entry_kind(f"{file}.pt", fd) is None:
                return None
            return load_ds_file(where, f"{file}.pt", dir_fd=fd)
        finally:
            os.close(fd)


def _dir_name(ck: DsCheckpoint, name: str) -> str:
    """`name`, checked to be one directory's name (param_shapes is read from a file nobody vouches for)."""
    if name in ("", ".", "..") or "/" in name or "\0" in name:
        raise CheckpointError(f"{ck.dir}: parameter name {name[:60]!r} cannot name a directory under zero/")
    return name


def universal_optimizer_state(ck: DsCheckpoint) -> tuple[dict, str]:
    """(zero/optimizer_state.pt, its path): the loss scaler of an fp16 run, a ZeRO-3 run's step."""
    with ParamFiles(ck) as files:
        return files.optimizer_state()


def param_tensor(obj, where: str, shape: tuple[int, ...]) -> torch.Tensor:
    """The whole tensor a per-parameter file holds, flat, checked against the parameter's `shape`."""
    if isinstance(obj, dict):
        if obj.get("is_expert_param"):
            raise CheckpointError(f"{where}: an expert parameter (MoE); universal MoE checkpoints are not read yet")
        t = obj.get("param")
    else:  # DeepSpeed's ZeRO-3 converter saves the bare flat tensor
        t = obj
    if not isinstance(t, torch.Tensor) or not t.is_floating_point():
        got = f"a {t.dtype} tensor" if isinstance(t, torch.Tensor) else type(t).__name__
        raise CheckpointError(f"{where}: holds {got} where a universal checkpoint keeps the parameter's floating "
                              "point tensor ('param')")
    if t.numel() != math.prod(shape) or (t.dim() > 1 and tuple(t.shape) != tuple(shape)):
        vocab = " (a vocabulary tensor, stripped of its padding)" if isinstance(obj, dict) and obj.get(
            "vocab_tensor") else ""
        raise CheckpointError(f"{where}: holds a tensor of shape {tuple(t.shape)}{vocab}, the parameter's shape is "
                              f"{tuple(shape)}")
    return t.reshape(-1)


def universal_shapes(ck: DsCheckpoint, files: ParamFiles | None = None) -> dict[str, tuple[int, ...]]:
    """Every trainable parameter's whole shape, in `param_shapes` order. A tensor-parallel run's
    `param_shapes` are each rank's slices; its universal files are whole, and say their shapes."""
    shapes = {_dir_name(ck, n): s for g in shapes_of(ck.meta, ck.path(ck.model_files[min(ck.model_files)]))
              for n, s in g}
    if ck.tp == 1:
        return shapes
    if files is None:
        with ParamFiles(ck) as files:
            return universal_shapes(ck, files)
    out = {}
    for name in shapes:
        obj = files.load(name, FILES[WEIGHTS])
        t = obj.get("param") if isinstance(obj, dict) else None
        if not isinstance(t, torch.Tensor) or t.dim() == 0:
            raise CheckpointError(f"{files.root}/{name}/fp32.pt: a tensor-parallel run's file holds no shaped 'param'")
        out[name] = tuple(t.shape)
    return out


def _step_of(files: ParamFiles, name: str, required: bool) -> int | None:
    step = files.load(name, "step", required=required)
    return None if step is None else as_count(step, f"{files.root}/{name}/step.pt", "the step")


def _adam_step(files: ParamFiles, first: str | None) -> int:
    """Adam's step: a ZeRO-3 converter's (and fnzero's) in optimizer_state.pt, else parameter
    `first`'s step.pt (each other step.pt read is checked against it: `_check_step`)."""
    osd, where = files.optimizer_state()
    inner = osd.get("optimizer_state_dict")
    states = inner.get("state") if isinstance(inner, dict) else None
    if isinstance(states, dict) and states:
        return states_step(states, where, "group")
    if first is None:
        raise CheckpointError(f"{where}: no trainable parameter and no Adam step")
    return _step_of(files, first, required=True)


def _check_step(files: ParamFiles, name: str, step: int) -> None:
    got = _step_of(files, name, required=False)
    if got is not None and got != step:
        raise CheckpointError(f"{files.root}/{name}/step.pt: Adam's step {got}, the checkpoint's is {step} (the "
                              "parameters' files disagree on how far the run got)")


class UniversalRead:
    """What this rank of `like` needs of universal checkpoint `ck` (computed at once, no parameter
    file opened) and, after `read()`, those elements: `piece(field, name, a, b)`. The same
    interface as `_ds_shard.ShardRead`. A tensor-parallel `like` reads its split parameters whole
    and keeps its own slice of them, as fnzero's own tensor-parallel load does."""

    extra_steps = 0  # Adam's count less the steps applied: none

    def __init__(self, ck: DsCheckpoint, like: TrainState):
        self.ck = ck
        self.shapes = universal_shapes(ck)
        self.needs, self.names = leaf_needs(like, self.shapes)
        tp = like.sharding.tp
        self.tp = tp if tp is not None and tp.size > 1 else None
        self.splits = {}  # checkpoint name -> its tensor-parallel split in `like`
        if self.tp is not None:
            for u in like.sharding.plan.units:
                for s in u.slots:
                    split = self.tp.split_of(s.name, *s.aliases)
                    if split is not None and s.name in self.names:
                        self.splits[self.names[s.name]] = split
            for needs in self.needs.values():  # a split parameter is read whole, then cut to this rank's slice
                needs.update({n: (0, math.prod(self.shapes[n])) for n in needs if n in self.splits})
        self.order = [n for n in self.shapes if any(n in needs for needs in self.needs.values())]
        self.pieces: dict[str, dict[str, tuple[int, torch.Tensor]]] = {}
        self.elements = 0  # how many elements `read` copied out of the files
        self.opened: list[str] = []  # the parameter directories `read` opened
        self._step: int | None = None

    def adam_step(self) -> int:
        """Adam's step (of the first parameter this rank reads, where it is per parameter)."""
        if self._step is None:
            with ParamFiles(self.ck) as files:
                self._step = _adam_step(files, next(iter(self.order or self.shapes), None))
        return self._step

    def read(self) -> None:
        """Copy the needed elements out of the needed parameters' files, one file at a time."""
        step = self.adam_step()
        self.pieces = {f: {} for f in FILES}
        with ParamFiles(self.ck) as files:
            for name in self.order:
                for field in FILES:
                    if name not in self.needs[field]:
                        continue
                    a, b = self.needs[field][name]
                    where = f"{files.root}/{name}/{FILES[field]}.pt"
                    t = param_tensor(files.load(name, FILES[field]), where, self.shapes[name])
                    self.pieces[field][name] = (a, t[a:b].to(torch.float32, copy=True))
                    self.elements += b - a
                    del t
                _check_step(files, name, step)
            self.opened = files.opened
        for field, held in self.pieces.items():  # a split parameter: this rank's slice of the whole
            for name, split in self.splits.items():
                if name in held:
                    full = held[name][1].view(split.full_shape)
                    held[name] = (0, split.local(full, self.tp.rank).reshape(-1))

    # Elements [a, b) of a parameter (fnzero's slot name; a tensor-parallel one's: of this rank's
    # slice) of `field`, None where this read holds none of it: the lookup ShardRead makes.
    piece = ShardRead.piece


def _module(ck: DsCheckpoint) -> dict:
    """The first model file's `module` (read and checked as every DeepSpeed model file is)."""
    module = _module_of(ck, 0)[0].get("module")
    if not isinstance(module, dict):
        raise CheckpointError(f"{ck.path(ck.model_files[(0, 0)])}: 'module' is not a state dict")
    return module


def _frozen(ck: DsCheckpoint, module: dict, taken: set[str]) -> dict[str, tuple[int, ...]]:
    """The frozen parameters' shapes: `frozen_param_shapes` where the run recorded them (ZeRO-2/3),
    else the module's other tensors (ZeRO-1 keeps them whole there)."""
    recorded = ck.meta.get("frozen_param_shapes")
    if isinstance(recorded, dict):
        out = {str(n): tuple(int(d) for d in s) for n, s in recorded.items()}
    else:
        out = {}
    for name, t in module.items():
        if name in taken or name in out:
            continue
        if t.numel() == 0:  # a placeholder no shape describes
            raise CheckpointError(f"{ck.dir}: 'module' holds {name!r}, which neither param_shapes, "
                                  "frozen_param_shapes nor buffer_names account for")
        out[name] = tuple(t.shape)
    return out


def universal_weights(ck: DsCheckpoint, trainable: bool = True, frozen: bool = True) -> DsWeights:
    """The checkpoint's weights by name, as `_ds_weights.consolidate` gives a regular one's: the
    trainable ones from zero/<name>/fp32.pt (meta tensors of their shapes, no file opened, with
    `trainable=False`), the buffers from `module`, the frozen ones (meta with `frozen=False`) from
    `module` where it holds them whole, else ZeRO-3's `frozen_param_fragments`, else refused."""
    w = DsWeights(master=ck.precision != "fp32")
    module = _module(ck)
    w.buffers = set(ck.meta.get("buffer_names") or ()) & set(module)
    shared = ck.meta.get("shared_params") or {}
    shapes = universal_shapes(ck)
    frozen_shapes = _frozen(ck, module, w.buffers | set(shared) | set(shapes))
    for alias, first in shared.items():
        w.aliases.setdefault(first, []).append(alias)
    with ParamFiles(ck) as files:
        for name in [*module, *(n for n in [*shapes, *frozen_shapes] if n not in module)]:
            if name in shared:
                continue
            if name in w.buffers:
                w.tensors[name] = module[name]
            elif name in shapes:
                shape = shapes[name]
                w.tensors[name] = param_tensor(files.load(name, FILES[WEIGHTS]), f"{files.root}/{name}/fp32.pt",
                                               shape).view(shape) if trainable else torch.empty(shape, device="meta")
            else:
                shape, t = frozen_shapes[name], module.get(name)
                held = isinstance(t, torch.Tensor) and tuple(t.shape) == shape and t.numel() > 0
                w.tensors[name] = t if held else torch.empty(shape, device="meta")
                w.frozen.add(name)
    missing = sorted(n for n in w.frozen if w.tensors[n].is_meta)
    if frozen and missing:
        _fill_frozen(ck, w, missing)
    return w


def _fill_frozen(ck: DsCheckpoint, w: DsWeights, missing: list[str]) -> None:
    """Frozen parameters `module` does not hold whole: a ZeRO-3 run's every rank's fragments (which
    DeepSpeed's converter copies with the model-states files), else refused by name."""
    if all((r, 0) in ck.model_files for r in range(ck.dp)) and ck.meta.get("frozen_param_fragments"):
        got = zero3_frozen(ck)
        for name in missing:
            if name in got:
                w.tensors[name] = got[name]
    left = [n for n in missing if w.tensors[n].is_meta]
    if left:
        raise CheckpointError(f"{ck.dir}: this universal checkpoint does not hold the frozen parameters {left[:5]} "
                              "(DeepSpeed takes them from the model when it loads one); export without them "
                              "(exclude_frozen / --exclude-frozen), or load into a model that has them")


def check_universal(ck: DsCheckpoint) -> DsWeights:
    """Every parameter's three files read whole and checked against its shape, every step.pt against
    the checkpoint's step (`info(verify=True)`); the weights as `universal_weights(trainable=False)`."""
    w = universal_weights(ck, trainable=False, frozen=False)
    shapes = universal_shapes(ck)
    with ParamFiles(ck) as files:
        step = _adam_step(files, next(iter(shapes), None))
        for name, shape in shapes.items():
            for field in FILES:
                where = f"{files.root}/{name}/{FILES[field]}.pt"
                param_tensor(files.load(name, FILES[field]), where, shape).clone()  # (the bytes read)
            _check_step(files, name, step)
    return w
