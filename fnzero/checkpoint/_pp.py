"""Checkpoints of pipeline-parallel states (`specs/checkpoint-format.md` §Pipeline parallelism).

Every rank of the job writes the bytes it owns of its stage's units to its own data file (named
by its rank in the job), and the job's rank 0 commits one index whose units are the union of the
stages' units, in layer order. Unit names are the layers' indices in the whole pipeline, so the
checkpoint is the one a single-stage run of the same PipelineModule would write: it loads at any
stage count, data-parallel size and ZeRO stage, and exports, with no conversion.
"""

from __future__ import annotations

import os
import random
import time


import torch

from .._errors import CheckpointError
from .._state import TrainState
from . import _format as F
from ._commit import clean_stale, commit, committed, failure_marker, read_part
from ._io import wait_for
from ._nodes import discover_groups

__all__ = ["save_pipelined", "merge_pipelined"]


def save_pipelined(path, state: TrainState, pp, *, tag, client_state, config, update_latest: bool, timeout: float,
                   pieces, units: list | None, rng: dict) -> str:
    """Save a pipeline stage's state as part of the job's one checkpoint (blocking: every rank of
    the job calls it). `pp`: the stage's PipelineInfo; `pieces` are `_save._pieces(state)`, what
    this rank owns within its stage (none on a tensor-parallel rank other than 0); `units`: the
    stage's unit_meta, given by the one rank that reports it."""
    sh = state.sharding
    world = pp.world
    rank, n = world.rank, world.world_size
    root = os.path.abspath(os.fspath(path))
    tag = F.check_tag(tag if tag is not None else f"step_{int(state.step)}")
    F.check_client_state(client_state)
    cfg_json = config.to_json() if config is not None and hasattr(config, "to_json") else config
    if rank == 0:
        os.makedirs(root, exist_ok=True)
        clean_stale(root)
        nonce = random.SystemRandom().getrandbits(62)
    else:
        nonce = 0
    nonce = int(world.broadcast(torch.tensor([nonce], dtype=torch.int64, device=sh.device), 0).cpu()[0])
    staging = os.path.join(root, f".{tag}.{nonce:016x}.partial")
    groups = discover_groups(world, staging, rank, n, sh.device)
    if not groups.shared:
        raise CheckpointError(f"the checkpoint directory {root!r} is not shared by every rank ({groups.describe()}); "
                              "a pipeline-parallel save needs one directory every rank sees (node-local saves of "
                              "pipelines are not implemented)")
    metas, data = pieces
    from ._save import _write_rank

    extra = {"nonce": nonce, "rng": rng, "stage_units": units, "pipeline_stage": pp.stage_index}
    plan, ls = sh.plan, state.loss_scale
    head = {
        "format": F.FORMAT, "version": F.VERSION, "tag": tag, "nonce": nonce, "created": time.time(),
        "world_size": n, "stage": plan.stage, "param_dtype": F.dtype_name(plan.param_dtype),
        "has_master": state.master is not None, "optimizer": type(state.opt_state).__name__,
        "step": int(state.step), "config": cfg_json, "client_state": client_state,
        "loss_scale": None if ls is None else {
            "scale": float(ls.scale), "good_steps": int(ls.good_steps), "hysteresis": int(ls.hysteresis)},
        "pipeline_stages": pp.stages,
    }
    try:
        _write_rank(staging, rank, metas, data, extra)
        if rank == 0:
            parts = [wait_for(lambda r=r: read_part(staging, r, nonce), timeout, f"rank {r}'s part of {tag!r}")
                     for r in range(n)]
            commit(root, tag, staging, merge_pipelined(parts, head), nonce, update_latest)
        else:
            wait_for(lambda: committed(root, tag, nonce, staging, 0, update_latest), timeout,
                     f"rank 0 to commit {tag!r}")
    except BaseException as e:
        for marker in (os.path.join(staging, f"rank{rank:05d}.failed"), failure_marker(root, tag, nonce, rank)):
            try:  # tell the other ranks instead of letting them wait for the timeout
                with open(marker, "w") as f:
                    f.write(f"{type(e).__name__}: {e}")
            except OSError:
                pass
        raise
    return tag


def merge_pipelined(parts: list[dict], head: dict) -> dict:
    """The index of a pipeline's checkpoint: the stages' units in stage order, each
    tensor's segments from every rank, and a replicated tensor (the optimizer's step count, equal
    on every stage) from the first stage that wrote it."""
    units, tensors, owner = [], {}, {}
    for p in sorted(parts, key=lambda p: (p["pipeline_stage"], p["rank"])):
        units += p.get("stage_units") or []
        for key, t in p["tensors"].items():
            cur = tensors.setdefault(key, {k: v for k, v in t.items() if k != "segments"} | {"segments": []})
            if "unit" not in t and owner.setdefault(key, p["pipeline_stage"]) != p["pipeline_stage"]:
                continue
            cur["segments"].extend(t["segments"])
    for t in tensors.values():
        t["segments"].sort(key=lambda s: s[2])
    return dict(head, units=units, files=[p["size"] for p in parts], rng=[p["rng"] for p in parts], tensors=tensors)
