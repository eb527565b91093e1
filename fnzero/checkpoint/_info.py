"""`info`: what a checkpoint directory holds and whether each checkpoint is healthy (read-only)."""

from __future__ import annotations

import os
from typing import Any

import torch

from .._errors import CheckpointError
from . import _format as F
from ._ds_export import ds_info
from ._ds_layout import is_deepspeed
from ._load import Reader, list_tags, read_latest
from ._safe import entry_kind

__all__ = ["info", "check"]


def check(ckpt_dir: str, verify: bool = True) -> Reader:
    """Open and validate one checkpoint; with `verify`, read every segment and check its crc32."""
    rd = Reader(ckpt_dir, verify=True)
    if verify:
        try:
            for key, t in rd.tensors.items():
                dt = F.DTYPES[t["dtype"]]
                for seg in t["segments"]:  # one segment at a time: bounded memory
                    if seg[0] not in rd.present:  # another node's file (a node-local save)
                        continue
                    lo, hi = seg[2], seg[3]
                    rd.read(key, lo, hi, torch.empty(hi - lo, dtype=dt))
        except BaseException:
            rd.close()
            raise
    return rd


def _stored_dtype(ix: dict, top: str) -> str | None:
    """The dtype the unit tensors under `top/` ('params', 'master') are stored in: the run's own
    (bf16 params of a bf16 run, its fp32 master), where the index's `param_dtype` is the model's
    as it was sharded. None when there are none; several joined by '/'."""
    units = {u["name"] for u in ix["units"]}
    found = sorted({t["dtype"] for k, t in ix["tensors"].items() if k.startswith(top + "/") and k[len(top) + 1:] in units})
    return "/".join(found) or None


def info(path: str | os.PathLike, *, verify: bool = False) -> dict[str, Any]:
    """A summary of checkpoint directory `path`: `latest`, and per tag its step, world size, stage,
    precision (`param_dtype`: the dtype the parameters are stored in; `master_dtype`: the master
    copy's, None without one), optimizer, bytes on disk, config JSON and `health` ('ok' or the
    error a load would raise). `verify=True` also checks every checksum (reads everything)."""
    if is_deepspeed(path):  # a DeepSpeed save or tag directory (`specs/checkpoint-format.md` §DeepSpeed)
        return ds_info(path, verify)
    root = os.path.abspath(os.fspath(path))
    if entry_kind(os.path.join(root, F.INDEX_NAME)) is not None:  # a single checkpoint directory
        root, tags = os.path.dirname(root), [os.path.basename(root)]
        committed = list_tags(root)  # `latest` is judged against every checkpoint beside it
    else:
        tags = committed = list_tags(root)
    latest, latest_problem = None, None
    try:  # (list_tags has found the root a readable directory)
        latest = read_latest(root)
    except CheckpointError as e:
        latest_problem = f"BROKEN: {e}"
    out: dict[str, Any] = {"path": root, "latest": latest, "checkpoints": []}
    for tag in tags:
        d = os.path.join(root, tag)
        entry: dict[str, Any] = {"tag": tag}
        try:
            with check(d, verify) as rd:
                ix = rd.index
                entry.update(
                    step=ix["step"], world_size=ix["world_size"], stage=ix["stage"], version=ix["version"],
                    param_dtype=_stored_dtype(ix, "params") or ix.get("param_dtype"),
                    master_dtype=_stored_dtype(ix, "master"), master_weights=bool(ix.get("has_master")),
                    optimizer=ix.get("optimizer"), fp16_loss_scale=ix.get("loss_scale"),
                    num_params=sum(u["numel"] for u in ix["units"]), bytes=sum(ix["files"]),
                    created=ix.get("created"), config=ix.get("config"),
                    health=("ok (checksums verified)" if len(rd.present) == ix["world_size"] else
                            "ok (node-local: this node's files verified)") if verify else "ok",
                )
        except CheckpointError as e:
            entry["health"] = f"BROKEN: {e}"
        except OSError as e:
            entry["health"] = f"BROKEN: {type(e).__name__}: {e}"
        out["checkpoints"].append(entry)
    if latest_problem is not None:
        out["latest_health"] = latest_problem
    elif latest is not None and latest not in committed:
        out["latest_health"] = f"BROKEN: 'latest' names {latest!r}, which is not a committed checkpoint here"
    return out
