"""`save`: every rank writes the bytes it owns to its own data file; rank 0 commits.

Ownership: of a unit-indexed tensor, rank r writes the elements of its shard range of the saving
plan that are real (not padding) and that its leaf holds. Replicated buffers (stage 0 params, the
stage 1-2 gathered params) are therefore written once in total, split across ranks in parallel;
replicated non-unit leaves (frozen, buffers, counts) are written by rank 0.

Commit protocol (all through files, so an async save's background thread issues no collectives):
  1. foreground: rank 0 removes stale staging dirs and broadcasts a fresh nonce (the only collective);
  2. rank r writes `.{tag}.{nonce}.partial/rank{r}.bin`, fsyncs it, then atomically writes its index
     part `rank{r}.msgpack` (its presence is rank r's done marker);
  3. rank 0 waits for every part, merges them into `index.msgpack`, fsyncs the staging dir, renames
     it to `{tag}` (an existing `{tag}` is first moved aside to `.{tag}.{nonce}.old`), fsyncs the root,
     then replaces `latest`; the old copy is deleted last;
  4. other ranks' handles complete when `{tag}/index.msgpack` carries their nonce.
A crash anywhere before the rename in 3 leaves only a staging dir, which loaders never look at.
"""

from __future__ import annotations

import atexit
import os
import random
import shutil
import threading
import time
from typing import Any

import torch

from .._errors import CheckpointError
from .._state import TrainState
from . import _format as F
from ._io import AlignedWriter, fsync_dir, wait_for, write_atomic
from ._tree import state_leaves, unit_meta

__all__ = ["save", "SaveHandle"]

SEGMENT_BYTES = 32 << 20  # a resharding reader reads at most one extra segment per range end
_PENDING: dict[tuple[str, int], "SaveHandle"] = {}
_PENDING_LOCK = threading.Lock()


@atexit.register
def _finish_pending() -> None:
    # The writer threads are daemons (a hung filesystem must not hang interpreter exit forever), so
    # a script that ends right after save(blocking=False) would lose the checkpoint without this.
    with _PENDING_LOCK:
        pending = list(_PENDING.values())
    for h in pending:
        try:
            h.wait(timeout=3600)
        except Exception:  # noqa: BLE001 - exiting; the error was the caller's to collect via wait()
            pass


class SaveHandle:
    """The result of `save`. `wait()` blocks until the checkpoint is committed (every rank's data
    durable, index and `latest` in place) and re-raises a failure; `done()` does not block."""

    def __init__(self, path: str, tag: str):
        self.path, self.tag = path, tag
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._finished = threading.Event()

    def _run(self, fn) -> None:
        try:
            fn()
        except BaseException as e:  # noqa: BLE001 - handed to wait()
            self._error = e
        finally:
            self._finished.set()

    def done(self) -> bool:
        return self._finished.is_set()

    def wait(self, timeout: float | None = None) -> str:
        """Block until committed; returns the checkpoint directory."""
        if not self._finished.wait(timeout):
            raise CheckpointError(f"save of {self.tag!r} did not finish within {timeout}s")
        if self._error is not None:
            err = self._error
            if isinstance(err, CheckpointError):
                raise err
            raise CheckpointError(f"saving checkpoint {self.tag!r} failed: {type(err).__name__}: {err}") from err
        return os.path.join(self.path, self.tag)

    def __repr__(self):
        return f"SaveHandle({self.path!r}, tag={self.tag!r}, done={self.done()})"


def _rng_state() -> dict:
    out: dict[str, Any] = {"cpu": bytes(torch.get_rng_state().numpy().tobytes()), "cuda": None}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = [bytes(s.numpy().tobytes()) for s in torch.cuda.get_rng_state_all()]
    return out


def _pieces(state: TrainState, copy: bool):
    """What this rank writes: (key, meta, lo, hi, 1-D CPU tensor) in a deterministic order."""
    plan, rank = state.sharding.plan, state.sharding.rank
    units = {u.name: u for u in plan.units}
    seen: set[tuple[str, int, int]] = set()
    metas: dict[str, dict] = {}
    out = []
    for leaf in state_leaves(state):
        t = leaf.tensor.detach()
        if leaf.key in metas and metas[leaf.key]["dtype"] != F.dtype_name(t.dtype):
            raise CheckpointError(f"{leaf.path}: dtype {t.dtype} differs from another leaf stored as {leaf.key!r}")
        if leaf.unit is None:
            metas[leaf.key] = {"dtype": F.dtype_name(t.dtype), "shape": list(t.shape)}
            if rank != 0:
                continue
            lo, hi, flat = 0, t.numel(), t.reshape(-1)
        else:
            metas[leaf.key] = {"dtype": F.dtype_name(t.dtype), "unit": leaf.unit}
            u = units[leaf.unit]
            s_lo, s_hi = u.real_range(rank)
            lo, hi = max(s_lo, leaf.lo), min(s_hi, leaf.hi)
            if lo >= hi or (leaf.key, lo, hi) in seen:  # tied aliases: the same range once
                continue
            seen.add((leaf.key, lo, hi))
            flat = t.reshape(-1)[lo - leaf.lo : hi - leaf.lo]
        flat = flat.to("cpu", copy=True) if copy else flat.cpu()
        out.append((leaf.key, lo, hi, flat.contiguous()))
    return metas, out


def _write_rank(staging: str, rank: int, metas: dict, pieces, extra: dict) -> None:
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
    write_atomic(os.path.join(staging, F.part_name(rank)), F.pack(dict(extra, rank=rank, size=size, tensors=tensors)))


def _merge(parts: list[dict], head: dict) -> dict:
    tensors: dict[str, dict] = {}
    for p in parts:
        for key, t in p["tensors"].items():
            cur = tensors.setdefault(key, {k: v for k, v in t.items() if k != "segments"} | {"segments": []})
            cur["segments"].extend(t["segments"])
    for t in tensors.values():
        t["segments"].sort(key=lambda s: s[2])
    return dict(head, files=[p["size"] for p in parts], rng=[p["rng"] for p in parts], tensors=tensors)


def _read_part(staging: str, r: int, nonce: int):
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


def _commit(root: str, tag: str, staging: str, index: dict, nonce: int, update_latest: bool) -> None:
    write_atomic(os.path.join(staging, F.INDEX_NAME), F.pack(index))
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


def _committed(root: str, tag: str, nonce: int, staging: str, world: int) -> bool:
    if os.path.exists(os.path.join(staging, "rank00000.failed")):
        raise CheckpointError("rank 0 failed to commit the checkpoint; see its error")
    p = os.path.join(root, tag, F.INDEX_NAME)
    try:
        with open(p, "rb") as f:
            return F.unpack(f.read(), p).get("nonce") == nonce
    except (OSError, CheckpointError):
        return False


def _clean_stale(root: str) -> None:
    for name in os.listdir(root):
        if name.startswith(f".{F.LATEST_NAME}.tmp."):  # a `latest` update killed before its rename
            os.unlink(os.path.join(root, name))
        elif name.startswith(".") and name.endswith(".partial"):
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
        elif name.startswith(".") and name.endswith(".old"):
            tag = name[1:].rsplit(".", 2)[0]
            if os.path.isdir(os.path.join(root, tag)):  # else it is the only copy: keep for recovery
                shutil.rmtree(os.path.join(root, name), ignore_errors=True)


def save(
    path: str | os.PathLike,
    state: TrainState,
    *,
    tag: str | None = None,
    client_state: Any = None,
    config: Any = None,
    blocking: bool = True,
    update_latest: bool = True,
    timeout: float = 1800.0,
) -> SaveHandle:
    """Write `state` as checkpoint `path/tag` (default tag `step_{state.step}`). Every rank calls it.

    `client_state`: plain data (msgpack-able) returned by `load`. `config`: a `fnzero.Config`
    stored as JSON. `blocking=False` copies this rank's part of the state to CPU memory, writes it in
    a background thread and returns at once; the handle's `wait()` gives the same result a blocking
    save would. A save waits for this rank's previous async save to the same directory first.
    """
    # Long: the atomic-save protocol (write, fsync, rename, then `latest`) is one sequence; split, its
    # crash-safety argument would span functions.
    if not isinstance(state, TrainState):
        raise CheckpointError(f"save expects a fnzero.TrainState, got {type(state).__name__}")
    from ..offload._checkpoint import is_nvme, materialize

    if is_nvme(state):
        # The store's files change with every step: read them now, in the layout a CPU-offload
        # run holds, so the checkpoint is an ordinary one (`specs/offload.md` §Checkpoints).
        state = materialize(state)
    sh = state.sharding
    comm, rank, world = sh.comm, sh.rank, sh.world_size
    root = os.path.abspath(os.fspath(path))
    tag = F.check_tag(tag if tag is not None else f"step_{int(state.step)}")
    F.check_client_state(client_state)
    cfg_json = config.to_json() if config is not None and hasattr(config, "to_json") else config
    if cfg_json is not None and not isinstance(cfg_json, str):
        raise CheckpointError(f"config must be a fnzero.Config or a JSON string, got {type(config).__name__}")
    with _PENDING_LOCK:
        prev = _PENDING.get((root, rank))
    if prev is not None:
        prev.wait()

    if rank == 0:
        os.makedirs(root, exist_ok=True)
        _clean_stale(root)
        nonce = random.SystemRandom().getrandbits(62)
    else:
        nonce = 0
    if world > 1:  # the one collective: same nonce everywhere, and rank 0 has made the root
        nonce = int(comm.broadcast(torch.tensor([nonce], dtype=torch.int64, device=sh.device), 0).cpu()[0])
    staging = os.path.join(root, f".{tag}.{nonce:016x}.partial")
    os.makedirs(staging, exist_ok=True)

    metas, pieces = _pieces(state, copy=not blocking)
    extra = {"nonce": nonce, "rng": _rng_state()}
    plan = sh.plan
    ls = state.loss_scale
    head = {
        "format": F.FORMAT, "version": F.VERSION, "tag": tag, "nonce": nonce, "created": time.time(),
        "world_size": world, "stage": plan.stage, "param_dtype": F.dtype_name(plan.param_dtype),
        "has_master": state.master is not None, "optimizer": type(state.opt_state).__name__,
        "step": int(state.step), "config": cfg_json, "client_state": client_state,
        "loss_scale": None if ls is None else {
            "scale": float(ls.scale), "good_steps": int(ls.good_steps), "hysteresis": int(ls.hysteresis)},
        "units": unit_meta(plan),
    }

    def work():
        try:
            _write_rank(staging, rank, metas, pieces, extra)
            if rank == 0:
                parts = [wait_for(lambda r=r: _read_part(staging, r, nonce), timeout, f"rank {r}'s part of {tag!r}")
                         for r in range(world)]
                _commit(root, tag, staging, _merge(parts, head), nonce, update_latest)
            else:
                wait_for(lambda: _committed(root, tag, nonce, staging, world), timeout, f"rank 0 to commit {tag!r}")
        except BaseException as e:
            try:  # tell the other ranks instead of letting them wait for the timeout
                with open(os.path.join(staging, f"rank{rank:05d}.failed"), "w") as f:
                    f.write(f"{type(e).__name__}: {e}")
            except OSError:
                pass
            raise

    handle = SaveHandle(root, tag)
    if blocking:
        handle._run(work)
        handle.wait()
        return handle
    t = threading.Thread(target=handle._run, args=(work,), name=f"fnzero-save-{tag}-r{rank}", daemon=True)
    handle._thread = t
    with _PENDING_LOCK:
        _PENDING[(root, rank)] = handle
    t.start()
    return handle
