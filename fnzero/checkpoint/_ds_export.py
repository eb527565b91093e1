"""`export` and `info` of a DeepSpeed checkpoint directory (`specs/checkpoint-format.md`
§DeepSpeed): the same writer, options and report as fnzero's own checkpoints, fed from
`_ds_weights.consolidate` (a universal checkpoint: `_ds_universal_read.universal_weights`)."""

from __future__ import annotations

import json
import os
from typing import Any

import torch

from .._errors import CheckpointError
from ._ds_layout import LATEST_UNIVERSAL, DsCheckpoint, describe, ds_tags, find_tag_dir, malformed
from ._ds_pickle import load_ds_file
from ._ds_universal_read import check_universal, universal_optimizer_state, universal_weights
from ._ds_weights import DsWeights, consolidate
from ._load import read_latest

__all__ = ["ds_weights", "ds_info"]

_PRECISION = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def ds_weights(path, tag: str | None, exclude_frozen: bool) -> tuple[DsCheckpoint, DsWeights]:
    """The checkpoint and its full weights, frozen ones dropped with `exclude_frozen`."""
    with malformed(os.fspath(path)):
        ck = describe(path, tag)
        w = universal_weights(ck, frozen=not exclude_frozen) if ck.layout == "universal" else consolidate(ck)
    if exclude_frozen:
        if not w.frozen_known:
            raise CheckpointError(f"{ck.dir}: exclude_frozen: this stage-0 DeepSpeed checkpoint (an fp32 run, no "
                                  "master copy) does not record which parameters were frozen")
        for n in w.frozen:
            w.tensors.pop(n, None)
            w.aliases.pop(n, None)
    return ck, w


def _num_params(ck: DsCheckpoint) -> int:
    """Parameters (tied ones once, frozen ones too) from what `describe` read, without the data."""
    if ck.layout == "universal":
        w = universal_weights(ck, trainable=False, frozen=False)
        return sum(t.numel() for n, t in w.tensors.items() if n not in w.buffers)
    shapes = [s for g in ck.meta.get("param_shapes") or [] for s in g.values()]
    shapes += list((ck.meta.get("frozen_param_shapes") or {}).values())
    if ck.layout == "per_param":
        return sum(torch.Size(s).numel() for s in shapes)
    if ck.layer_files:
        module = {}
        for (layer, _), name in ck.layer_files.items():
            module.update({f"{layer}.{k}": t for k, t in load_ds_file(ck.dir, name).items()})
    else:
        module = dict(load_ds_file(ck.dir, ck.model_files[(0, 0)])["module"])
        for name in (n for n in ck.expert_files if n.endswith("_model_states.pt")):  # MoE experts
            module.update(load_ds_file(ck.dir, name))
    buffers = set(ck.meta.get("buffer_names") or ())
    seen, n = set(), 0
    for name, t in module.items():
        if name in buffers or name in (ck.meta.get("shared_params") or {}) or not isinstance(t, torch.Tensor):
            continue
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape))
        if key not in seen:
            seen.add(key)
            n += t.numel()
    return n


def _bytes(d: str) -> int:
    """The bytes of the files under `d` (a universal checkpoint's zero/ too), links not followed."""
    total = 0
    for top, dirs, files in os.walk(d):
        total += sum(os.stat(os.path.join(top, n), follow_symlinks=False).st_size for n in files)
    return total


def _entry(ck: DsCheckpoint, verify: bool) -> dict[str, Any]:
    meta, cfg = ck.meta, ck.meta.get("ds_config") or {}
    universal = ck.layout == "universal"
    w = (check_universal(ck) if universal else consolidate(ck)) if verify else None
    scaler = None
    if ck.precision == "fp16" and (ck.optim_files or universal):
        osd = (universal_optimizer_state(ck)[0] if universal else
               load_ds_file(ck.dir, ck.optim_files[(0, 0)]).get("optimizer_state_dict") or {})
        scaler = getattr(osd.get("loss_scaler"), "get", lambda *_: None)("cur_scale")
    master = (w.master if w is not None else ck.precision != "fp32" or ck.layout == "per_param")
    return {
        "tag": ck.tag, "format": "deepspeed", "step": meta.get("global_steps"), "world_size": ck.dp,
        "stage": ck.stage, "version": f"deepspeed {meta.get('ds_version', '?')}",
        "param_dtype": _PRECISION[ck.precision], "master_dtype": "float32" if master else None,
        "master_weights": master, "optimizer": (cfg.get("optimizer") or {}).get("type"),
        "fp16_loss_scale": scaler, "num_params": _num_params(ck),
        "bytes": _bytes(ck.dir),
        "created": None, "config": json.dumps(cfg, indent=2, default=str) if cfg else None,
        "deepspeed": {
            "tp_degree": ck.tp, "pp_degree": ck.pp, "skipped_steps": meta.get("skipped_steps"),
            "global_samples": meta.get("global_samples"), "lr_scheduler": meta.get("lr_scheduler"),
            "bf16_optimizer": bool(meta.get("bf16_optimizer")), "expert_files": len(ck.expert_files),
            "layer_files": len(ck.layer_files), "universal": universal,
        },
        "health": "ok (every tensor read and checked)" if verify else "ok",
    }


def ds_info(path, verify: bool) -> dict[str, Any]:
    """`info` of a DeepSpeed save directory or tag directory (same keys as fnzero's, plus
    `format: 'deepspeed'` and a `deepspeed` dict per checkpoint)."""
    root, only = os.path.abspath(os.fspath(path)), None
    try:
        root, only = find_tag_dir(root)
        only = only if os.path.abspath(os.fspath(path)) == os.path.join(root, only) else None
    except CheckpointError:
        pass
    latest, universal, problem = None, None, None
    try:
        latest = read_latest(root)
        universal = read_latest(root, name=LATEST_UNIVERSAL)
    except CheckpointError as e:
        problem = f"BROKEN: {e}"
    tags = [only] if only else ds_tags(root)
    out: dict[str, Any] = {"path": root, "latest": latest, "latest_universal": universal, "format": "deepspeed",
                           "checkpoints": []}
    for tag in tags:
        try:
            with malformed(os.path.join(root, tag)):
                out["checkpoints"].append(_entry(describe(root, tag), verify))
        except (CheckpointError, OSError) as e:
            out["checkpoints"].append({"tag": tag, "format": "deepspeed", "health": f"BROKEN: {e}"})
    if problem is not None:
        out["latest_health"] = problem
    else:
        for name, named in (("latest", latest), (LATEST_UNIVERSAL, universal)):
            if named is not None and named not in ds_tags(root):
                out["latest_health"] = f"BROKEN: '{name}' names {named!r}, which is not a DeepSpeed checkpoint here"
    return out
