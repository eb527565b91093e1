"""An fnzero checkpoint written as a DeepSpeed universal checkpoint (`to_deepspeed_universal`), the
directory DeepSpeed 0.19.8 resumes with ``{"checkpoint": {"load_universal": true}}`` at ZeRO stage
1, 2 or 3 and any data-parallel world size. Files and what is refused: `specs/checkpoint-format.md`
§DeepSpeed universal (written).

One parameter at a time: its fp32 weights and both Adam moments are read from the rank files (only
the elements of that parameter, whatever world size and stage saved them), written with
`torch.save` as DeepSpeed's own `ds_to_universal` writes them, and dropped before the next, so
the peak is one parameter's three tensors. The model-states file holds the buffers whole and each
parameter as an empty placeholder, as DeepSpeed's ZeRO-3 model files do: a universal load reads
no module state (DeepSpeed's `_load_checkpoint` skips `module` when `load_universal` is set).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import warnings
from collections import OrderedDict
from typing import Any

import torch

from .._errors import CheckpointError, ConfigError
from ..config import ConfigWarning, load_config
from ..optim import optimizer_kind, params_dict
from ..schedules import from_config as schedule_from_config
from . import _format as F
from ._io import fsync_dir, write_atomic
from ._load import Reader, resolve

__all__ = ["to_deepspeed_universal", "DS_VERSION", "recorded_world"]

# The DeepSpeed version whose loader this layout is checked against; its `_load_global_state`
# asserts that the optimizer state names one (stage_1_and_2.py).
DS_VERSION = "0.19.8"
# Universal checkpoints hold exactly these optimizer tensors per parameter (ds_to_universal.py:155),
# so only the Adam family fits; fnzero's optimizer types that are it, and the state class they save.
_ADAM_KINDS = ("adam", "adamw")
_ADAM_STATE = "AdamState"


def to_deepspeed_universal(
    path: str | os.PathLike,
    out: str | os.PathLike,
    *,
    tag: str | None = None,
    ds_tag: str | None = None,
    config: Any = None,
) -> str:
    """Write fnzero checkpoint `path/tag` (default latest; saved at any world size and stage) as a
    DeepSpeed universal checkpoint under `out`: the directory `out/ds_tag` (default
    ``global_step{step}``) and `out/latest_universal` naming it. Returns the tag directory.

    DeepSpeed 0.19.8 resumes it with ``"checkpoint": {"load_universal": true}`` in its config, at
    ZeRO stage 1, 2 or 3 and any data-parallel world size: ``engine.load_checkpoint(out)`` restores
    the fp32 weights, Adam's moments and step, the optimizer's lr, betas, eps and weight decay, the
    schedule's position and the step counts. It never restores buffers or frozen parameters (its
    universal load reads no module state): the model given to `deepspeed.initialize` must hold them.

    Not a collective: call it in one process (one rank of a job, or `fnzero checkpoint convert`).
    `config`: the run's config (a `Config`, dict, JSON text or path) when the checkpoint was saved
    without `save(..., config=)`; the optimizer's hyper-parameters and the schedule come from it.
    Refused (`CheckpointError`, before anything is written): an optimizer other than Adam/AdamW,
    an fp16 run's loss scale, a pipeline checkpoint, a checkpoint without a config when none is
    given, and an `out/ds_tag` that exists.

    >>> fnzero.checkpoint.to_deepspeed_universal("ckpt", "ds_ckpt")  # doctest: +SKIP
    '.../ds_ckpt/global_step1000'
    """
    with Reader(resolve(path, tag)) as rd:
        ix = rd.index
        cfg = _config(ix, config)
        _check_convertible(ix, cfg)
        name = F.check_tag(ds_tag if ds_tag is not None else f"global_step{ix['step']}", "ds_tag")
        root = os.path.abspath(os.fspath(out))
        final = os.path.join(root, name)
        if os.path.lexists(final):
            raise CheckpointError(f"{final} exists; remove it or pass another ds_tag")
        os.makedirs(root, exist_ok=True)
        tmp = os.path.join(root, f".{name}.{os.getpid()}.partial")
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            _write_tag(rd, cfg, tmp)
            os.rename(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    fsync_dir(root)
    write_atomic(os.path.join(root, "latest_universal"), name.encode())
    return final


def _config(ix: dict, given: Any):
    """The run's Config: `given` (read at the saving world size), else the one the checkpoint
    recorded (read at the data-parallel size its own batch numbers give)."""
    src, world = given, int(ix["world_size"])
    if given is None:
        src = ix.get("config")
        if src is None:
            raise CheckpointError(
                "the checkpoint was saved without its config (save(..., config=cfg)), and a DeepSpeed universal "
                "checkpoint needs the optimizer's hyper-parameters and the schedule from it: pass config="
            )
        world = recorded_world(src, world)
    try:
        with warnings.catch_warnings():
            # Its no-effect keys were warned about when the run loaded it; converting changes nothing.
            warnings.simplefilter("ignore", ConfigWarning)
            return load_config(src, world_size=world)
    except ConfigError as e:
        raise CheckpointError(f"the run's config cannot be read: {e}") from None


def recorded_world(config, default: int) -> int:
    """The data-parallel size a recorded config (JSON text or dict) was resolved at: train_batch_size
    / micro / gas. Under tensor parallelism or MiCS it is not the index's world size, and a converted
    checkpoint's files may come from one process; `default` where the numbers do not say."""
    try:
        d = json.loads(config) if isinstance(config, str) else config
        return max(1, int(d["train_batch_size"]) // (int(d["train_micro_batch_size_per_gpu"]) *
                                                      int(d["gradient_accumulation_steps"])))
    except (ValueError, TypeError, KeyError, ZeroDivisionError):
        return default


def _check_convertible(ix: dict, cfg) -> None:
    """Refuse what a universal checkpoint cannot hold, naming it."""
    if cfg.optimizer is None:
        raise CheckpointError("the config has no optimizer block; a DeepSpeed universal checkpoint holds Adam's state")
    kind = optimizer_kind(cfg)
    if kind not in _ADAM_KINDS or ix.get("optimizer") != _ADAM_STATE:
        raise CheckpointError(
            f"optimizer {cfg.optimizer.type} (state {ix.get('optimizer')}) cannot be written as a DeepSpeed universal "
            "checkpoint: it holds exp_avg and exp_avg_sq per parameter only (Adam, AdamW)"
        )
    if ix.get("loss_scale") is not None:
        raise CheckpointError(
            "this fp16 run's loss scale cannot be written: DeepSpeed keeps it as a pickled DeepSpeed object "
            "(LossScaler) that fnzero does not write, and the overflow-skipped steps are not counted in an fnzero "
            "checkpoint; convert a bf16 or fp32 run's checkpoint"
        )
    if ix.get("pipeline_stages") is not None:
        raise CheckpointError(
            "a pipeline checkpoint cannot be written as a DeepSpeed universal checkpoint yet (DeepSpeed's pipeline "
            "engine names its layers' parameters by stage files); export its weights with `fnzero export` instead"
        )
    for key in ix["tensors"]:
        if "@rank" in key:
            raise CheckpointError(f"{key!r} is per-rank optimizer state, which a universal checkpoint cannot hold")
    if ix["tensors"].get("opt_state/count", {}).get("shape") != []:
        raise CheckpointError("the checkpoint has no scalar Adam step count (opt_state/count)")


def _slots(ix: dict) -> list[tuple[str, dict, dict]]:
    """(unit name, unit, slot) of every trainable parameter, names checked as directory names."""
    out = []
    for u in ix["units"]:
        for s in u["slots"]:
            n = s["name"]
            if n in (".", "..") or "/" in n or os.sep in n or n.startswith("."):
                raise CheckpointError(f"parameter name {n[:60]!r} cannot name a directory of the universal checkpoint")
            out.append((u["name"], u, s))
    return out


def _read_slot(rd: Reader, key: str, s: dict) -> torch.Tensor:
    numel = math.prod(s["shape"])
    t = rd.read(key, s["offset"], s["offset"] + numel, torch.empty(numel, dtype=torch.float32))
    return t.reshape(s["shape"])


def _read_count(rd: Reader) -> int:
    return int(rd.read("opt_state/count", 0, 1, torch.empty(1, dtype=torch.int64))[0])


def _write_tag(rd: Reader, cfg, d: str) -> None:
    """The whole tag directory `d`: per-parameter files, optimizer state, model states."""
    ix = rd.index
    zero = os.path.join(d, "zero")
    os.makedirs(zero)
    count = _read_count(rd)
    step = torch.tensor(float(count))
    shapes: OrderedDict[str, torch.Size] = OrderedDict()
    for unit, _, s in _slots(ix):
        weights = f"master/{unit}" if f"master/{unit}" in rd.tensors else f"params/{unit}"
        pd = os.path.join(zero, s["name"])
        os.makedirs(pd)
        for file, key in (("fp32", weights), ("exp_avg", f"opt_state/exp_avg/{unit}"),
                          ("exp_avg_sq", f"opt_state/exp_avg_sq/{unit}")):
            if key not in rd.tensors:
                raise CheckpointError(f"the checkpoint has no {key!r} for parameter {s['name']!r}")
            torch.save({"param": _read_slot(rd, key, s), "cat_dim": 0}, os.path.join(pd, f"{file}.pt"))
        torch.save(step.clone(), os.path.join(pd, "step.pt"))
        shapes[s["name"]] = torch.Size(s["shape"])
    torch.save(_optimizer_state(cfg, int(ix["step"]), step), os.path.join(zero, "optimizer_state.pt"))
    states = _model_states(rd, cfg, shapes)
    # A ZeRO-1/2 engine reads mp_rank_00_..., a ZeRO-3 engine zero_pp_rank_0_mp_rank_00_...: both, the same.
    for fname in ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_model_states.pt"):
        torch.save(states, os.path.join(d, fname))
    for sub in (zero, d):
        fsync_dir(sub)


def _param_group(cfg, step: int) -> dict:
    """The optimizer's hyper-parameters for its next step, as torch's Adam/AdamW name them: the lr
    the schedule gives step `step` (fnzero's and DeepSpeed's convention, `fnzero.schedules`), and
    the momentum for OneCycle's cycled beta1."""
    params = params_dict(cfg.optimizer.params)
    sched = schedule_from_config(cfg)
    beta1, beta2 = (float(b) for b in params.get("betas", (0.9, 0.999)))
    if sched.momentum is not None:
        beta1 = float(sched.momentum(step))
    return {"lr": float(sched(step)), "betas": (beta1, beta2), "eps": float(params.get("eps", 1e-8)),
            "weight_decay": float(params.get("weight_decay", 0.0)), "params": [0]}


def _optimizer_state(cfg, step: int, adam_step: torch.Tensor) -> dict:
    """zero/optimizer_state.pt. ZeRO-1/2 read `param_groups`, `clip_grad` and `ds_version`
    (`_load_global_state`); ZeRO-3 reads the step and the hyper-parameters from
    `optimizer_state_dict` (stage3.py `load_hp_checkpoint_state_from_checkpoint_dir_stage3`).
    No `loss_scaler`, `zero_stage` or `partition_count`: the loaders keep their own when absent."""
    group = _param_group(cfg, step)
    return {
        "param_groups": [group],
        "optimizer_state_dict": {"state": {0: {"step": adam_step.clone()}}, "param_groups": [dict(group)]},
        "dynamic_loss_scale": False,
        "overflow": False,
        "clip_grad": float(cfg.gradient_clipping),
        "ds_version": DS_VERSION,
    }


def _model_states(rd: Reader, cfg, shapes: OrderedDict) -> dict:
    """The model-states dict DeepSpeed's `_load_checkpoint` reads: step counts, the schedule's
    position, world sizes; `module` with the persistent buffers whole and every parameter (frozen
    ones too) as an empty placeholder."""
    ix = rd.index
    step = int(ix["step"])
    frozen = OrderedDict((s["name"], torch.Size(s["shape"])) for u in ix.get("frozen_units", []) for s in u["slots"])
    for key, t in rd.tensors.items():
        if key.startswith("frozen/") and "unit" not in t:
            frozen[key[len("frozen/"):]] = torch.Size(t["shape"])
    module: OrderedDict[str, torch.Tensor] = OrderedDict((n, torch.empty(0)) for n in [*shapes, *frozen])
    buffers = []
    for key, t in rd.tensors.items():
        name = key[len("buffers/"):]
        if key.startswith("buffers/") and name not in ix.get("non_persistent", ()):
            numel = math.prod(t["shape"])
            module[name] = rd.read(key, 0, numel, torch.empty(numel, dtype=rd.dtype(key))).reshape(t["shape"])
            buffers.append(name)
    return {
        "module": module,
        "buffer_names": buffers,
        "optimizer": None,
        "param_shapes": [shapes],
        "frozen_param_shapes": frozen or None,
        "shared_params": {a: s["name"] for u in ix["units"] for s in u["slots"] for a in s["aliases"]},
        "frozen_param_fragments": None,
        "lr_scheduler": {"last_batch_iteration": step - 1} if cfg.scheduler is not None else None,
        "data_sampler": None,
        "random_ltd": None,
        "skipped_steps": 0,  # fp16 runs (the only ones that skip steps) are refused
        "global_steps": step,
        "global_samples": step * int(cfg.train_batch_size),
        "dp_world_size": int(ix["world_size"]),
        "mp_world_size": 1,
        "checkpoint_parallel_dimensions": {"pp_degree": 1, "tp_degree": 1},
        "ds_config": json.loads(cfg.to_json()),
        "ds_version": DS_VERSION,
    }
