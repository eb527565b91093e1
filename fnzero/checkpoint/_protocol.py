"""The steps of the commit protocol every save shares (`_save.py` documents the protocol): write
this rank's data file and index part, wait for the others' parts and commit on rank 0, or wait
for the commit; on failure, leave the markers that tell the other ranks at once."""

from __future__ import annotations

import dataclasses
import os
import random
import time

import torch

from .._state import TrainState
from . import _format as F
from ._commit import clean_stale, commit, committed, failure_marker, read_part
from ._io import AlignedWriter, wait_for, write_atomic

__all__ = ["Where", "index_head", "start", "write_rank", "write_and_commit", "mark_failed", "SEGMENT_BYTES"]

SEGMENT_BYTES = 32 << 20  # a resharding reader reads at most one extra segment per range end


@dataclasses.dataclass(frozen=True)
class Where:
    """Where and how one save writes: its directories, its identity and its rank's place."""

    root: str
    staging: str
    tag: str
    nonce: int
    rank: int
    world: int
    update_latest: bool
    timeout: float


def start(root: str, comm, rank: int, world: int, tag: str, device) -> tuple[int, str]:
    """Step 1: rank 0 makes the root, removes stale staging dirs and draws the save's nonce,
    which every rank receives; (nonce, this save's staging directory)."""
    if rank == 0:
        os.makedirs(root, exist_ok=True)
        clean_stale(root)
        nonce = random.SystemRandom().getrandbits(62)
    else:
        nonce = 0
    if world > 1:  # same nonce everywhere, and rank 0 has made the root
        nonce = int(comm.broadcast(torch.tensor([nonce], dtype=torch.int64, device=device), 0).cpu()[0])
    return nonce, os.path.join(root, f".{tag}.{nonce:016x}.partial")


def index_head(state: TrainState, tag: str, nonce: int, world: int, cfg_json, client_state, **more) -> dict:
    """The index fields that describe the save (every field but the tensors and files)."""
    plan, ls = state.sharding.plan, state.loss_scale
    return {
        "format": F.FORMAT, "version": F.VERSION, "tag": tag, "nonce": nonce, "created": time.time(),
        "world_size": world, "stage": plan.stage, "param_dtype": F.dtype_name(plan.param_dtype),
        "has_master": state.master is not None, "optimizer": type(state.opt_state).__name__,
        "step": int(state.step), "config": cfg_json, "client_state": client_state,
        "loss_scale": None if ls is None else {
            "scale": float(ls.scale), "good_steps": int(ls.good_steps), "hysteresis": int(ls.hysteresis)},
        **saved_meta(plan),
        **more,
    }


def saved_meta(plan) -> dict:
    """The index fields that say what the model's own save writes (`ShardPlan.saved`), which an
    export from the files follows: its non-persistent buffers, and a transformers model's
    save_pretrained names ([name, saved name or nil] where they differ; nil for another model)."""
    saved = plan.saved
    return {"non_persistent": list(saved.non_persistent),
            "pretrained_names": None if saved.pretrained is None else [list(p) for p in saved.pretrained]}


def write_and_commit(at: Where, metas: dict, pieces, extra: dict, merge) -> None:
    """Steps 2-4 of the protocol: write this rank's part; rank 0 waits for every part and commits
    `merge(parts)`, the others wait for the commit. A failure leaves a marker so no rank waits
    for the timeout."""
    try:
        write_rank(at.staging, at.rank, metas, pieces, extra)
        if at.rank == 0:
            parts = [wait_for(lambda r=r: read_part(at.staging, r, at.nonce), at.timeout, f"rank {r}'s part of {at.tag!r}")
                     for r in range(at.world)]
            commit(at.root, at.tag, at.staging, merge(parts), at.nonce, at.update_latest)
        else:
            wait_for(lambda: committed(at.root, at.tag, at.nonce, at.staging, 0, at.update_latest), at.timeout,
                     f"rank 0 to commit {at.tag!r}")
    except BaseException as e:
        mark_failed(at, e)
        raise


def mark_failed(at: Where, e: BaseException) -> None:
    """Tell the other ranks this one failed (its staging marker and the root's), instead of
    letting them wait for the timeout."""
    for marker in (os.path.join(at.staging, f"rank{at.rank:05d}.failed"),
                   failure_marker(at.root, at.tag, at.nonce, at.rank)):
        try:
            with open(marker, "w") as f:
                f.write(f"{type(e).__name__}: {e}")
        except OSError:
            pass


def write_rank(staging: str, rank: int, metas: dict, pieces, extra: dict) -> dict:
    """Write this rank's data file, then its index part (its done marker); returns the part."""
    w = AlignedWriter(os.path.join(staging, F.data_name(rank)))
    tensors = {k: dict(m, segments=[]) for k, m in metas.items()}
    try:
        for key, lo, hi, flat in pieces:
            step = max(1, SEGMENT_BYTES // max(1, flat.element_size()))
            for a in range(0, hi - lo, step):
                b = min(hi - lo, a + step)
                off, crc = w.write(flat[a:b])
                tensors[key]["segments"].append([rank, off, lo + a, lo + b, crc])
        size = w.close()
    except BaseException:
        w.abort()
        raise
    part = dict(extra, rank=rank, size=size, tensors=tensors)
    # The part's appearance is this rank's done marker: the committer may rename the staging
    # directory as soon as it sees it, so this rank's own fsync of that directory could find it
    # gone. The committer fsyncs the staging directory before its rename (`commit`).
    write_atomic(os.path.join(staging, F.part_name(rank)), F.pack(part), sync_dir=False)
    return part
