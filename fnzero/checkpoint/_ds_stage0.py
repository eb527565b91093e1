"""Adam's state of a DeepSpeed ZeRO stage-0 checkpoint (`specs/checkpoint-format.md` §DeepSpeed,
"Resuming in fnzero"): the one model file's `optimizer` entry, the torch optimizer's `state_dict()`
(fp32) or, under the unfused bf16 optimizer, its `optimizer_state_dict` beside `fp32_groups`.

Its state is keyed by parameter index in `param_groups` order, which DeepSpeed does not name: the
indices are the module's parameters in order (ties once), all of them (the optimizer was given
`model.parameters()`) or the trainable ones only (the bf16 wrapper keeps those); which, the count
says, and each state's shapes are checked against the parameter's. A parameter without state (it
never had a gradient) resumes with zero moments. The same interface as `_ds_shard.ShardRead`: the
whole model is in one file, so every rank reads it.
"""

from __future__ import annotations

import torch

from .._errors import CheckpointError
from .._state import TrainState
from ._ds_layout import DsCheckpoint
from ._ds_optim import MOMENTS, states_step
from ._ds_pickle import load_ds_file
from ._ds_weights import ties

__all__ = ["Stage0Read", "stage0_frozen"]


class Stage0Read:
    """Adam's moments by name and its step, from a stage-0 checkpoint's model file."""

    ranks: list[int] = []  # (no optimizer file: the state is in the model file)
    extra_steps = 0  # Adam's count less the steps applied (`adam_step`)

    def __init__(self, ck: DsCheckpoint, like: TrainState):
        self.ck = ck
        self.trainable = {n for u in like.sharding.plan.units for s in u.slots for n in (s.name, *s.aliases)}
        self.pieces: dict[str, dict[str, torch.Tensor]] = {}

    def _optimizer(self) -> tuple[dict, dict, str]:
        osd, self._opt, module, where = _stage0_optimizer(self.ck)
        return osd, module, where

    def adam_step(self) -> int:
        """The optimizer steps applied: the step every parameter's state records (they must agree),
        less the one `extra_steps` counts."""
        osd, _, where = self._optimizer()
        if not osd["state"]:
            raise CheckpointError(f"{where}: the optimizer holds no state (no step was taken)")
        # The unfused fp16/bf16 wrapper (its `fp32_groups`) steps its optimizer once with zero
        # gradients when it is built (unfused_optimizer.py `initialize_optimizer_states`): Adam's
        # count runs one ahead of the steps applied, and its bias correction goes on from there.
        self.extra_steps = int(osd is not self._opt)
        return states_step(osd["state"], where, "parameter") - self.extra_steps

    def read(self) -> None:
        osd, module, where = self._optimizer()
        params, tied, indices = _indexed(self.ck, osd, module)
        trainable = [n for n in params if n in self.trainable]
        order = params if len(indices) == len(params) else trainable if len(indices) == len(trainable) else None
        if order is None:
            raise CheckpointError(f"{where}: the optimizer holds {len(indices)} parameters, the module {len(params)} "
                                  f"of which {len(trainable)} trainable here; which is which cannot be told")
        self.pieces = {m: {} for m in MOMENTS}
        for i, name in zip(indices, order):
            state = osd["state"].get(i)
            for m in MOMENTS:
                t = state.get(m) if isinstance(state, dict) else torch.zeros_like(module[name], dtype=torch.float32)
                if not isinstance(t, torch.Tensor) or tuple(t.shape) != tuple(module[name].shape):
                    got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                    raise CheckpointError(f"{where}: optimizer state {i}'s {m!r} is {got}, parameter {name!r} (its "
                                          f"index in param_groups order) is {tuple(module[name].shape)}; only Adam and "
                                          "AdamW state is read")
                self.pieces[m][name] = t.reshape(-1)
        self.names = {a: first for a, first in tied.items()}

    def piece(self, field: str, name: str, a: int, b: int) -> torch.Tensor | None:
        """Elements [a, b) of `name`'s moment `field`; None for the weights (`consolidate` reads them)."""
        held = self.pieces.get(field, {})
        name = name if name in held else self.names.get(name, name)
        return held[name][a:b] if name in held else None


def _stage0_optimizer(ck: DsCheckpoint) -> tuple[dict, dict, dict, str]:
    """(Adam's torch state_dict, the model file's `optimizer` entry, its `module`, the file)."""
    name = ck.model_files[(0, 0)]
    where = ck.path(name)
    sd = load_ds_file(ck.dir, name)
    opt = sd.get("optimizer") if isinstance(sd, dict) else None
    if isinstance(opt, dict) and "fp32_groups_flat" in opt:
        raise CheckpointError(f"{where}: a stage-0 fused fp16/bf16 optimizer (fp32_groups_flat) is not resumed yet")
    osd = opt.get("optimizer_state_dict") if isinstance(opt, dict) and "state" not in opt else opt
    if not isinstance(osd, dict) or not isinstance(osd.get("state"), dict) or not isinstance(
            osd.get("param_groups"), list) or not all(isinstance(g, dict) for g in osd["param_groups"]):
        raise CheckpointError(f"{where}: 'optimizer' holds no torch optimizer state_dict (state, param_groups)")
    if not isinstance(sd.get("module"), dict):
        raise CheckpointError(f"{where}: 'module' is not a state dict")
    return osd, opt, sd["module"], where


def _indexed(ck: DsCheckpoint, osd: dict, module: dict) -> tuple[list[str], dict, list]:
    """(the module's parameter names in order, ties once; the ties; the optimizer's indices in
    param_groups order)."""
    buffers = set(ck.meta.get("buffer_names") or ())
    tied = ties(module, buffers)
    params = [n for n, t in module.items() if n not in buffers and n not in tied and isinstance(t, torch.Tensor)]
    return params, tied, [i for g in osd["param_groups"] for i in (g.get("params") or [])]


def stage0_frozen(ck: DsCheckpoint) -> set[str]:
    """The frozen parameters of a stage-0 checkpoint that records none (fp32: no `frozen_param_shapes`,
    no masters): those the optimizer, given every parameter, holds no state for (they never had a
    gradient). Where it holds fewer parameters than the module, which are which is not recorded."""
    osd, _, module, where = _stage0_optimizer(ck)
    params, _, indices = _indexed(ck, osd, module)
    if len(indices) != len(params):
        raise CheckpointError(f"{where}: the optimizer holds {len(indices)} of the module's {len(params)} parameters, "
                              "and a stage-0 checkpoint does not record which are frozen; load it into the model "
                              "(fnzero.checkpoint.load(path, like=state)) and save that state instead")
    return {n for i, n in zip(indices, params) if osd["state"].get(i) is None}
