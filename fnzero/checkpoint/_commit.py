"""The commit protocol's files (`_save.py`): merging the ranks' index parts, renaming the staging
directory into place, `latest`, and how the other ranks see that it is done."""

from __future__ import annotations

import os
import shutil

from .._errors import CheckpointError
from . import _format as F
from ._io import fsync_dir, write_atomic
from ._load import Reader, read_latest

__all__ = ["merge_parts", "read_part", "commit", "committed", "clean_stale", "failure_marker"]


def merge_parts(parts: list[dict], head: dict) -> dict:
    tensors: dict[str, dict] = {}
    for p in parts:
        for key, t in p["tensors"].items():
            cur = tensors.setdefault(key, {k: v for k, v in t.items() if k != "segments"} | {"segments": []})
            cur["segments"].extend(t["segments"])
            for rng in t.get("cover", ()):
                cur.update(F.with_cover(cur, tuple(rng)))
    for t in tensors.values():
        t["segments"].sort(key=lambda s: s[2])
    return dict(head, files=[p["size"] for p in parts], rng=[p["rng"] for p in parts], tensors=tensors)


def read_part(staging: str, r: int, nonce: int):
    p = os.path.join(staging, F.part_name(r))
    fail = os.path.join(staging, f"rank{r:05d}.failed")
    if os.path.exists(fail):
        with open(fail, encoding="utf-8", errors="replace") as f:
            raise CheckpointError(f"rank {r} failed to write its part of the checkpoint: {f.read(2000)}")
    if not os.path.exists(p):
        return None
    with open(p, "rb") as f:
        part = F.unpack(f.read(), p)
    if part.get("nonce") != nonce:
        raise CheckpointError(f"{p} belongs to another save (nonce mismatch)")
    return part


def commit(root: str, tag: str, staging: str, index: dict, nonce: int, update_latest: bool) -> None:
    # The index every loader will validate, validated before it is committed: a merge that made a
    # bad one fails here, and the failure marker tells the waiting ranks at once, where they would
    # otherwise read a committed index that never validates as "not committed yet" until the timeout.
    sealed = F.seal(index)
    F.validate_index(F.unpack(sealed, "the merged checkpoint index"))
    write_atomic(os.path.join(staging, F.INDEX_NAME), sealed)
    fsync_dir(staging)
    final = os.path.join(root, tag)
    if os.path.exists(final):
        old = os.path.join(root, f".{tag}.{nonce:016x}.old")
        os.rename(final, old)  # loaders fall back to this name if we die before the next rename
    os.rename(staging, final)
    fsync_dir(root)
    if update_latest:
        write_atomic(os.path.join(root, F.LATEST_NAME), (tag + "\n").encode())
    # The copy moved aside, and any left by an earlier save of this tag that died mid-replace.
    for name in os.listdir(root):
        if name.startswith(f".{tag}.") and name.endswith(".old"):
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)


def failure_marker(root: str, tag: str, nonce: int, rank: int) -> str:
    """Where rank `rank` says its part of a save failed: beside the staging directory, so the
    marker outlives the rename of staging into place (a commit can fail after it: `latest`)."""
    return os.path.join(root, f".{tag}.{nonce:016x}.rank{rank:05d}.failed")


def committed(root: str, tag: str, nonce: int, staging: str, committer: int, update_latest: bool) -> bool:
    """Whether the committing rank is done: `tag` carries this save's nonce and, when the save
    updates it, `latest` names `tag` (else a rank could return, load `latest` and get the previous
    checkpoint, or none)."""
    if os.path.exists(os.path.join(staging, f"rank{committer:05d}.failed")) or os.path.exists(
        failure_marker(root, tag, nonce, committer)
    ):
        raise CheckpointError(f"rank {committer} failed to commit the checkpoint; see its error")
    try:  # an untrusted read: a FIFO or a device there must not block or flood this rank
        with Reader(os.path.join(root, tag), verify=False) as rd:
            if rd.index.get("nonce") != nonce:
                return False
        if not update_latest:
            return True
        return read_latest(root) == tag
    except (OSError, CheckpointError):
        return False


def clean_stale(root: str, keep: str | None = None) -> None:
    for name in os.listdir(root):
        if keep is not None and os.path.join(root, name) == keep:
            continue
        if name.startswith(f".{F.LATEST_NAME}.tmp."):  # a `latest` update killed before its rename
            os.unlink(os.path.join(root, name))
        elif name.startswith(".") and name.endswith(".failed"):  # markers of earlier failed saves
            os.unlink(os.path.join(root, name))
        elif name.startswith(".") and name.endswith(".partial"):
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
        elif name.startswith(".") and name.endswith(".old"):
            tag = name[1:].rsplit(".", 2)[0]
            if os.path.isdir(os.path.join(root, tag)):  # else it is the only copy: keep for recovery
                shutil.rmtree(os.path.join(root, name), ignore_errors=True)
