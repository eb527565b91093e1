"""Adam's state of a DeepSpeed ZeRO stage-0 checkpoint (`specs/checkpoint-format.md` §DeepSpeed,
"Resuming in fnzero"): the one model file's `optimizer` entry, the torch optimizer's `state_dict()`
(fp32) or, under the unfused bf16 optimizer, its `optimizer_state_dict` beside `fp32_groups`.

Its state is keyed by parameter index in `param_groups` order, which DeepSpeed does not name: the
indices are the module's parameters in order (ties once), all of them (the optimizer was given
`model.parameters()`) or the trainable ones only (the bf16 wrapper keeps those); which, the count
says, and each state's shapes are checked against the parameter's. A parameter without state (it
never had a gradient) resumes with zero moments. The same interface as `_ds_shard.ShardRead`: the
whole model is in one file, so every rank reads it.

A pipeline writes one model file per stage, each with its stage's optimizer, and its weights in
`layer_*` files. Which layers a stage ran is not recorded: the stages' parameters are the layer
files' parameters in layer order, cut by the count each stage's optimizer holds (in stage order),
which must add up to all of them; every state's shapes are checked against its parameter's.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from .._errors import CheckpointError
from .._state import TrainState
from ._ds_layout import DsCheckpoint
from ._ds_optim import MOMENTS, states_step
from ._ds_pickle import load_ds_file
from ._ds_weights import expert_files, pipeline_module, ties

__all__ = ["Stage0Read", "stage0_frozen"]

_EXPP = re.compile(r"^expp_rank_(\d+)_mp_rank_00_optim_states\.pt$")


class Stage0Read:
    """Adam's moments by name and its step, from a stage-0 checkpoint's model file (a pipeline's:
    one per stage)."""

    extra_steps = 0  # Adam's count less the steps applied (`adam_step`)

    def __init__(self, ck: DsCheckpoint, like: TrainState):
        self.ck = ck
        self.trainable = {n for u in like.sharding.plan.units for s in u.slots for n in (s.name, *s.aliases)}
        self.pieces: dict[str, dict[str, torch.Tensor]] = {}
        self._stages: list[_Stage] | None = None

    def stages(self) -> list["_Stage"]:
        if self._stages is None:
            self._stages = _stages(self.ck)
        return self._stages

    def adam_step(self) -> int:
        """The optimizer steps applied: the step every parameter's state records (they must agree),
        less the one `extra_steps` counts."""
        stages = self.stages()
        steps = {}
        for st in stages:
            if not st.osd["state"]:
                raise CheckpointError(f"{st.where}: the optimizer holds no state (no step was taken)")
            steps.setdefault(states_step(st.osd["state"], st.where, "parameter"), st.where)
        if len(steps) > 1:
            raise CheckpointError(f"{self.ck.dir}: the pipeline stages' optimizers are at different steps "
                                  f"({', '.join(f'{s} in {w}' for s, w in sorted(steps.items()))})")
        # The unfused fp16/bf16 wrapper (its `fp32_groups`) steps its optimizer once with zero
        # gradients when it is built (unfused_optimizer.py `initialize_optimizer_states`): Adam's
        # count runs one ahead of the steps applied, and its bias correction goes on from there.
        self.extra_steps = int(stages[0].osd is not stages[0].opt)
        return next(iter(steps)) - self.extra_steps

    def read(self) -> None:
        self.pieces = {m: {} for m in MOMENTS}
        self.names: dict[str, str] = {}
        for st in self.stages():
            trainable = [n for n in st.params if n in self.trainable]
            order = st.params if len(st.indices) == len(st.params) else trainable if len(st.indices) == len(
                trainable) else None
            if order is None:
                raise CheckpointError(f"{st.where}: the optimizer holds {len(st.indices)} parameters, the module "
                                      f"{len(st.params)} of which {len(trainable)} trainable here; which is which "
                                      "cannot be told")
            for i, name in zip(st.indices, order):  # (a MoE run's other parameters: the same in every file)
                if name in self.trainable and name not in self.pieces[MOMENTS[0]]:
                    self._take(st, i, name)
            self.names.update(st.tied)

    def _take(self, st: "_Stage", i: int, name: str) -> None:
        """Parameter `name`'s moments: optimizer state `i` (zeros where it has none)."""
        state = st.osd["state"].get(i)
        for m in MOMENTS:
            t = state.get(m) if isinstance(state, dict) else torch.zeros_like(st.module[name], dtype=torch.float32)
            if not isinstance(t, torch.Tensor) or tuple(t.shape) != tuple(st.module[name].shape):
                got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                raise CheckpointError(f"{st.where}: optimizer state {i}'s {m!r} is {got}, parameter {name!r} (its "
                                      f"index in param_groups order) is {tuple(st.module[name].shape)}; only Adam "
                                      "and AdamW state is read")
            self.pieces[m][name] = t.reshape(-1)

    def piece(self, field: str, name: str, a: int, b: int) -> torch.Tensor | None:
        """Elements [a, b) of `name`'s moment `field`; None for the weights (`consolidate` reads them)."""
        held = self.pieces.get(field, {})
        name = name if name in held else self.names.get(name, name)
        return held[name][a:b] if name in held else None


@dataclass
class _Stage:
    """One model file's optimizer (`osd`: Adam's torch state_dict; `opt`: the file's `optimizer`
    entry), the parameters it was given in index order (`params`, ties once; `indices` in
    param_groups order) and their tensors (`module`), the ties (alias -> name)."""

    osd: dict
    opt: dict
    module: dict
    params: list[str]
    indices: list
    tied: dict
    where: str


def _stage0_optimizer(ck: DsCheckpoint, mp: int = 0) -> tuple[dict, dict, dict | None, dict, str]:
    """(Adam's torch state_dict, the model file's `optimizer` entry, its `module` (None in a
    pipeline's), its other fields, the file) of model-parallel rank `mp`."""
    name = ck.model_files[(0, mp)]
    where = ck.path(name)
    sd = load_ds_file(ck.dir, name)
    opt = sd.get("optimizer") if isinstance(sd, dict) else None
    if isinstance(opt, dict) and "fp32_groups_flat" in opt:
        raise CheckpointError(f"{where}: a stage-0 fused fp16/bf16 optimizer (fp32_groups_flat) is not resumed yet")
    osd = opt.get("optimizer_state_dict") if isinstance(opt, dict) and "state" not in opt else opt
    if not isinstance(osd, dict) or not isinstance(osd.get("state"), dict) or not isinstance(
            osd.get("param_groups"), list) or not all(isinstance(g, dict) for g in osd["param_groups"]):
        raise CheckpointError(f"{where}: 'optimizer' holds no torch optimizer state_dict (state, param_groups)")
    if not isinstance(sd.get("module"), dict) and not ck.layer_files:
        raise CheckpointError(f"{where}: 'module' is not a state dict")
    return osd, opt, sd.get("module"), sd, where


def _indices(osd: dict) -> list:
    return [i for g in osd["param_groups"] for i in (g.get("params") or [])]


def _stages(ck: DsCheckpoint) -> list[_Stage]:
    """Every model file's optimizer with the parameters it was given (a pipeline: the layer files'
    parameters in layer order, cut by each stage's count; MoE: each expert-parallel rank's file)."""
    if not ck.layer_files:
        osd, opt, module, sd, where = _stage0_optimizer(ck)
        buffers = set(sd.get("buffer_names") or ())
        tied = ties(module, buffers)
        params = [n for n, t in module.items() if n not in buffers and n not in tied and isinstance(t, torch.Tensor)]
        if ck.expert_files:
            return _expert_stages(ck, module, params, tied)
        return [_Stage(osd, opt, module, params, _indices(osd), tied, where)]
    found = [_stage0_optimizer(ck, mp) for mp in sorted({mp for _, mp in ck.model_files})]
    buffers = {b for *_, sd, _ in found for b in (sd.get("buffer_names") or ())}
    module = pipeline_module(ck)
    params = [n for n in module if n not in buffers]
    out, at = [], 0
    for osd, opt, _, _, where in found:
        indices = _indices(osd)
        out.append(_Stage(osd, opt, module, params[at: at + len(indices)], indices, {}, where))
        at += len(indices)
    if at != len(params):
        raise CheckpointError(f"{ck.dir}: the pipeline stages' optimizers hold {at} parameters, the layer files "
                              f"{len(params)}; which stage held which (and which were frozen) is not recorded, so "
                              "this stage-0 pipeline checkpoint is not resumed")
    return out


def _expert_stages(ck: DsCheckpoint, module: dict, dense: list[str], tied: dict) -> list[_Stage]:
    """A stage-0 MoE run: each expert-parallel rank e's torch optimizer in its own file
    (`expp_rank_{e}_mp_rank_00_optim_states.pt`), its groups as `split_params_into_different_moe_groups_for_optimizer`
    made them: the module's other parameters in order, and (`moe` groups) its experts, global ids
    e * (experts per rank) ... in layer and id order."""
    files = sorted((int(m[1]), n) for n in ck.expert_files if (m := _EXPP.match(n)))
    experts = expert_files(ck)
    tensors = {**module, **{n: t for *_, sd in experts for n, t in sd.items()}}
    per_layer: dict[int, int] = {}
    for layer, _, _ in experts:
        per_layer[layer] = per_layer.get(layer, 0) + 1
    if not files or [e for e, _ in files] != list(range(len(files))) or any(c % len(files) for c in per_layer.values()):
        raise CheckpointError(f"{ck.dir}: the expert-parallel ranks' optimizer files (expp_rank_*) do not match the "
                              f"expert files ({dict(per_layer)} experts per layer over {len(files)} ranks)")
    out = []
    for e, name in files:
        where = ck.path(name)
        opt = load_ds_file(ck.dir, name).get("optimizer")
        osd = opt.get("optimizer_state_dict") if isinstance(opt, dict) and "state" not in opt else opt
        if not isinstance(osd, dict) or not isinstance(osd.get("state"), dict) or not isinstance(
                osd.get("param_groups"), list) or not all(isinstance(g, dict) for g in osd["param_groups"]):
            raise CheckpointError(f"{where}: 'optimizer' holds no torch optimizer state_dict (state, param_groups)")
        mine = [n for layer, i, sd in experts if i // (per_layer[layer] // len(files)) == e for n in sd]
        sources, params = {False: iter(dense), True: iter(mine)}, []
        for g in osd["param_groups"]:
            params += [n for _, n in zip(g.get("params") or [], sources[bool(g.get("moe"))])]
        if len(params) != len(_indices(osd)) or len(params) != len(dense) + len(mine):
            raise CheckpointError(f"{where}: the optimizer holds {len(_indices(osd))} parameters, the module "
                                  f"{len(dense)} and expert-parallel rank {e}'s experts {len(mine)}")
        out.append(_Stage(osd, opt, tensors, params, _indices(osd), tied, where))
    return out


def stage0_frozen(ck: DsCheckpoint) -> set[str]:
    """The frozen parameters of a stage-0 checkpoint that records none (fp32: no `frozen_param_shapes`,
    no masters): those the optimizer, given every parameter, holds no state for (they never had a
    gradient). Where it holds fewer parameters than the module, which are which is not recorded."""
    out = set()
    for st in _stages(ck):
        if len(st.indices) != len(st.params):
            raise CheckpointError(f"{st.where}: the optimizer holds {len(st.indices)} of the module's "
                                  f"{len(st.params)} parameters, and a stage-0 checkpoint does not record which are "
                                  "frozen; load it into the model (fnzero.checkpoint.load(path, like=state)) and save "
                                  "that state instead")
        out |= {n for i, n in zip(st.indices, st.params) if st.osd["state"].get(i) is None}
    return out
