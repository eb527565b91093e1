"""Checkpoints of pipeline-parallel states (`specs/checkpoint-format.md` §Pipeline parallelism):
every rank writes its stage's units to its own data file and the job's rank 0 commits one index,
the one a single-stage run of the same PipelineModule would write.
"""

from __future__ import annotations

import os

from .._errors import CheckpointError
from .._state import TrainState
from . import _format as F
from ._nodes import discover_groups
from ._protocol import Where, index_head, start, write_and_commit

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
    F.check_client_state(client_state)
    cfg_json = config.to_json() if config is not None and hasattr(config, "to_json") else config
    nonce, staging = start(root, world, rank, n, tag, sh.device)
    groups = discover_groups(world, staging, rank, n, sh.device)
    if not groups.shared:
        raise CheckpointError(f"the checkpoint directory {root!r} is not shared by every rank ({groups.describe()}); "
                              "a pipeline-parallel save needs one directory every rank sees (node-local saves of "
                              "pipelines are not implemented)")
    metas, data = pieces

    # Each stage's own non-persistent buffers: the index lists every stage's (`merge_pipelined`).
    extra = {"nonce": nonce, "rng": rng, "stage_units": units, "pipeline_stage": pp.stage_index,
             "stage_non_persistent": list(sh.plan.saved.non_persistent)}
    head = index_head(state, tag, nonce, n, cfg_json, client_state, pipeline_stages=pp.stages)
    at = Where(root, staging, tag, nonce, rank, n, update_latest, timeout)
    write_and_commit(at, metas, data, extra, lambda parts: merge_pipelined(parts, head))
    return tag


def merge_pipelined(parts: list[dict], head: dict) -> dict:
    """The index of a pipeline's checkpoint: the stages' units in stage order, each
    tensor's segments from every rank, and a replicated tensor (the optimizer's step count, equal
    on every stage) from the first stage that wrote it."""
    units, tensors, owner, transient = [], {}, {}, {}
    for p in sorted(parts, key=lambda p: (p["pipeline_stage"], p["rank"])):
        units += p.get("stage_units") or []
        transient.update(dict.fromkeys(p.get("stage_non_persistent") or []))
        for key, t in p["tensors"].items():
            cur = tensors.setdefault(key, {k: v for k, v in t.items() if k != "segments"} | {"segments": []})
            if "unit" not in t and owner.setdefault(key, p["pipeline_stage"]) != p["pipeline_stage"]:
                continue
            cur["segments"].extend(t["segments"])
    for t in tensors.values():
        t["segments"].sort(key=lambda s: s[2])
    return dict(head, units=units, files=[p["size"] for p in parts], rng=[p["rng"] for p in parts], tensors=tensors,
                non_persistent=list(transient))
