"""`save`: every rank writes the bytes it owns to its own data file; rank 0 commits.

Who writes what and the commit protocol (all through files, so an async save's background thread
issues no collectives): `specs/checkpoint-format.md` §Who writes what, §Atomicity and durability.
A crash anywhere before the final rename leaves only a staging dir, which loaders never look at.
"""

from __future__ import annotations

import atexit
import math
import os
import shutil
import threading
from typing import Any

import torch

from .._errors import CheckpointError
from .._state import TrainState
from ..sharding import read_placeholders
from ..config import Config
from . import _format as F
from ._commit import clean_stale, commit, committed, merge_parts
from ._ep import ExpertPlaces, check_ep_supported, expert_places
from ._io import wait_for
from ._handle import SaveHandle, checked_tag, save_first_replica, saved_by_one
from ._nodes import discover_groups, exchange_parts, merge_for_group
from ._pp import save_pipelined
from ._protocol import Where, index_head, start, mark_failed, write_and_commit, write_rank
from ._tree import state_leaves, unit_meta, units_by_key

__all__ = ["save", "SaveHandle"]

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


def _save_tensor_parallel(path, state: TrainState, **kw) -> SaveHandle:
    """A tensor-parallel state: consolidated over the tp ranks (`_tp.py`), then saved by the tp
    rank 0 of each data-parallel rank as the same run without tensor parallelism would save it.
    Blocking: the other tp ranks wait for it, and hear whether it failed."""
    from ._tp import check_supported, consolidated

    check_supported(state)
    tp = state.sharding.tp
    whole = consolidated(state)  # collective over dp and tp
    return saved_by_one(tp.comm, tp.rank == 0, lambda: save(path, whole, blocking=True, **kw), path, kw.get("tag"), state,
                        "tensor-parallel rank 0 of this rank's group")


def _save_pipelined(path, state: TrainState, tag, client_state, config, update_latest, timeout, node_local) -> SaveHandle:
    """A pipeline stage's part of the job's one checkpoint (`_pp.py`); with tensor parallelism the
    stage is consolidated over its tp ranks first and their rank 0 writes it. Blocking."""
    from ..offload import is_nvme, materialize
    from ._tp import check_supported, consolidated

    if _node_local(node_local, config):
        raise CheckpointError("a node-local save of a pipeline-parallel state is not implemented yet: save to a "
                              "directory every rank sees")
    pp, tp = state.sharding.pp, state.sharding.tp
    split = tp is not None and tp.size > 1
    if split:
        check_supported(state)  # not with the optimizer on NVMe
    if is_nvme(state):  # the store's files, read now in the layout a CPU-offload run holds (specs/offload.md)
        state = materialize(state)
    whole, writes = (consolidated(state), tp.rank == 0) if split else (state, True)  # consolidated: over dp and tp
    places = expert_places(whole.sharding)  # expert units: stored as their whole layers' (`_ep.py`)
    pieces = _pieces(whole, copy=False, places=places) if writes else ({}, [])
    plan = places.whole if places is not None else whole.sharding.plan
    units = unit_meta(plan) if writes and whole.sharding.rank == 0 else None
    handle = SaveHandle(os.path.abspath(os.fspath(path)), checked_tag(tag, state))
    handle._run(lambda: save_pipelined(path, whole, pp, tag=handle.tag, client_state=client_state, config=config,
                                       update_latest=update_latest, timeout=timeout, pieces=pieces, units=units,
                                       rng=_rng_state()))
    handle.wait()  # its collectives run over the whole job
    return handle


def _rng_state() -> dict:
    out: dict[str, Any] = {"cpu": bytes(torch.get_rng_state().numpy().tobytes()), "cuda": None}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = [bytes(s.numpy().tobytes()) for s in torch.cuda.get_rng_state_all()]
    return out


def _pieces(state: TrainState, copy: bool, group: tuple[int, ...] | None = None, exclude_frozen: bool = False,
            places: ExpertPlaces | None = None):
    """What this rank writes: (key, meta, lo, hi, 1-D CPU tensor) in a deterministic order;
    nothing of the frozen parameters with `exclude_frozen`. `group` (a node-local save): the ranks
    sharing this rank's directory, which write a whole copy of what is replicated
    (`specs/checkpoint-format.md` §Directories that are not shared). `places` (expert
    parallelism, `_ep.py`): an expert unit's elements go to their places in the whole layer's unit."""
    plan, rank = state.sharding.plan, state.sharding.rank
    units = units_by_key(plan)
    seen: set[tuple[str, int, int]] = set()
    metas: dict[str, dict] = {}
    out = []
    for leaf in state_leaves(state):
        if exclude_frozen and leaf.path.startswith("frozen/"):
            continue
        t = leaf.tensor.detach()
        if leaf.key in metas and metas[leaf.key]["dtype"] != F.dtype_name(t.dtype):
            raise CheckpointError(f"{leaf.path}: dtype {t.dtype} differs from another leaf stored as {leaf.key!r}")
        if leaf.per_rank:  # this rank's own, whole, under its own key
            metas[leaf.key] = {"dtype": F.dtype_name(t.dtype), "shape": list(t.shape)}
            out.append((leaf.key, 0, t.numel(), _to_cpu(t.reshape(-1), copy)))
            continue
        if leaf.unit is None:
            metas[leaf.key] = {"dtype": F.dtype_name(t.dtype), "shape": list(t.shape)}
            if rank != (0 if group is None else group[0]):
                continue
            lo, hi, flat = 0, t.numel(), t.reshape(-1)
        else:
            meta = metas.get(leaf.key) or {"dtype": F.dtype_name(t.dtype), "unit": leaf.unit}
            metas[leaf.key] = F.with_cover(meta, leaf.slot)
            u = units[leaf.unit]
            s_lo, s_hi = u.real_range(rank)
            if leaf.held_alone:  # no other rank holds these elements
                s_lo, s_hi = leaf.lo, leaf.hi
            elif group is not None and (leaf.lo, leaf.hi) != u.shard_range(rank):  # held by every rank: split in the group
                a, b = leaf.lo, min(leaf.hi, u.numel)
                per = -(-(b - a) // len(group))
                s_lo = a + per * group.index(rank)
                s_hi = min(b, s_lo + per)
            lo, hi = max(s_lo, leaf.lo), min(s_hi, leaf.hi)
            if lo >= hi or (leaf.key, lo, hi) in seen:  # tied aliases: the same range once
                continue
            seen.add((leaf.key, lo, hi))
            flat = t.reshape(-1)[lo - leaf.lo : hi - leaf.lo]
            if places is not None:
                for a, b, at in places.places(leaf.unit, lo, hi):
                    out.append((leaf.key, a, b, _to_cpu(flat[at: at + b - a], copy)))
                continue
        out.append((leaf.key, lo, hi, _to_cpu(flat, copy)))
    return metas, out


def _to_cpu(flat: torch.Tensor, copy: bool) -> torch.Tensor:
    return (flat.to("cpu", copy=True) if copy else flat.cpu()).contiguous()


def _node_local(node_local: bool | None, config: Any) -> bool:
    if node_local is not None:
        return bool(node_local)
    # A config given as a JSON string is only stored; its checkpoint block is not read here.
    return isinstance(config, Config) and config.checkpoint.use_node_local_storage


def _node_local_save(at: Where, comm, device, groups, metas, pieces, extra, head, plan) -> None:
    """Write this rank's part, exchange every rank's index part (each rank reaches the exchange,
    failed or not, so no rank waits on one that gave up), and commit this group's copy."""
    staging, rank, world, tag, nonce = at.staging, at.rank, at.world, at.tag, at.nonce
    try:
        part = write_rank(staging, rank, metas, pieces, extra)
    except BaseException as e:  # noqa: BLE001 - reported to every rank through the exchange, then raised
        part, failure = {"failed": f"{type(e).__name__}: {e}"}, e
    else:
        failure = None
    parts = exchange_parts(comm, part, world, device)
    failed = {r: p["failed"] for r, p in enumerate(parts) if "failed" in p}
    if failed:
        if failure is not None:
            raise failure
        raise CheckpointError(f"rank(s) {sorted(failed)} failed to write their part of {tag!r}: {failed}")
    leader = groups.leader(rank)
    if rank == leader:
        units = {k: u.numel for k, u in units_by_key(plan).items()}
        numel = {k: units[m["unit"]] if "unit" in m else math.prod(m["shape"]) for k, m in metas.items()}
        commit(at.root, tag, staging, merge_for_group(parts, head, groups, rank, numel), nonce, at.update_latest)
    else:
        wait_for(lambda: committed(at.root, tag, nonce, staging, leader, at.update_latest), at.timeout, f"rank {leader} to commit {tag!r}")


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
    node_local: bool | None = None,
    exclude_frozen_parameters: bool = False,
) -> SaveHandle:
    """Write `state` as checkpoint `path/tag` (default tag `step_{state.step}`). Every rank calls it.

    `client_state`: plain data (msgpack-able) returned by `load`. `config`: a `fnzero.Config`
    stored as JSON. `blocking=False` copies this rank's part of the state to CPU memory, writes it in
    a background thread and returns at once; the handle's `wait()` gives the same result a blocking
    save would. A save waits for this rank's previous async save to the same directory first.
    `path` must be one directory every rank sees, unless `node_local` (default: the config's
    `checkpoint.use_node_local_storage`; `specs/checkpoint-format.md` §Directories that are not
    shared). `exclude_frozen_parameters` (DeepSpeed's keyword): leave the frozen parameters out,
    as a LoRA run's small checkpoint (§Frozen parameters).
    """
    if not isinstance(state, TrainState):
        raise CheckpointError(f"save expects a fnzero.TrainState, got {type(state).__name__}")
    # Shards kept in NVMe stores (`offload_param: nvme`) are read now, as the optimizer store's are
    # below: the checkpoint is an ordinary one (`specs/offload.md` §Parameters).
    state = read_placeholders(state, frozen=not exclude_frozen_parameters)
    check_ep_supported(state, _node_local(node_local, config))
    kw = dict(tag=tag, client_state=client_state, config=config, update_latest=update_latest, timeout=timeout)
    handle = _saved_through_a_group(path, state, node_local, exclude_frozen_parameters, **kw)
    if handle is not None:
        return handle
    state = _writable(state)
    root, tag, cfg_json, node_local = _checked_arguments(path, state, tag, client_state, config, node_local, blocking)
    sh = state.sharding
    with _PENDING_LOCK:
        prev = _PENDING.get((root, sh.rank))
    if prev is not None:
        prev.wait()
    # The protocol (module docstring): 1. in the foreground, then 2.-4. in `work`.
    at, groups, group = _stage(root, sh, tag, node_local, update_latest, timeout)
    work = _writer(state, at, groups, group, copy=not blocking, exclude_frozen=exclude_frozen_parameters,
                   cfg_json=cfg_json, client_state=client_state)
    return _run(work, root, tag, sh.rank, blocking)


def _saved_through_a_group(path, state: TrainState, node_local, exclude_frozen_parameters: bool, **kw) -> SaveHandle | None:
    """A state that one rank of a group saves for the group (MiCS's shard groups, a tensor-parallel
    group) or whose stages each save their part (a pipeline): its blocking save. None for the
    others, which every rank saves itself."""
    config, sh = kw["config"], state.sharding
    if sh.replicas is not None and sh.replicas.world_size > 1:
        return save_first_replica(save, path, state, _node_local(node_local, config),
                                  exclude_frozen_parameters=exclude_frozen_parameters, **kw)
    if sh.pp is not None and sh.pp.stages > 1:
        if exclude_frozen_parameters:
            raise CheckpointError("save(..., exclude_frozen_parameters=True) of a pipeline-parallel state is not "
                                  "implemented yet")
        return _save_pipelined(path, state, kw["tag"], kw["client_state"], config, kw["update_latest"], kw["timeout"],
                               node_local)
    if sh.tp is not None and sh.tp.size > 1:
        return _save_tensor_parallel(path, state, node_local=node_local,
                                     exclude_frozen_parameters=exclude_frozen_parameters, **kw)
    return None


def _writable(state: TrainState) -> TrainState:
    """`state` as it is written: an NVMe optimizer store's files read into memory, and refused when
    its optimizer says it cannot be saved now (the same verdict on every rank: nothing started)."""
    from ..offload import is_nvme, materialize

    if is_nvme(state):
        # The store's files change with every step: read them now, in the layout a CPU-offload
        # run holds, so the checkpoint is an ordinary one (`specs/offload.md` §Checkpoints).
        state = materialize(state)
    problem = getattr(state.opt_state, "checkpoint_problem", None)
    if callable(problem) and problem() is not None:
        raise CheckpointError(f"this state cannot be saved now: {problem()}")
    return state


def _checked_arguments(path, state: TrainState, tag, client_state, config, node_local, blocking: bool):
    """(the root directory, the tag, the config as JSON, whether the save is node-local), each
    checked before anything is written."""
    root = os.path.abspath(os.fspath(path))
    tag = checked_tag(tag, state)
    F.check_client_state(client_state)
    cfg_json = config.to_json() if config is not None and hasattr(config, "to_json") else config
    if cfg_json is not None and not isinstance(cfg_json, str):
        raise CheckpointError(f"config must be a fnzero.Config or a JSON string, got {type(config).__name__}")
    node_local = _node_local(node_local, config)
    if node_local and not blocking:
        raise CheckpointError(
            "a node-local save (checkpoint.use_node_local_storage) is blocking: the nodes exchange their parts of the "
            "index by collectives, which a background thread may not issue; pass blocking=True"
        )
    return root, tag, cfg_json, node_local


def _stage(root: str, sh, tag: str, node_local: bool, update_latest: bool, timeout: float):
    """Step 1 of the protocol, on every rank: a fresh staging directory and the groups of ranks that
    see it; a directory not every rank sees is refused unless the save is node-local. Returns
    (where this save writes, the groups, this rank's group or None when the directory is shared)."""
    comm, rank, world = sh.comm, sh.rank, sh.world_size
    nonce, staging = start(root, comm, rank, world, tag, sh.device)
    groups = discover_groups(comm, staging, rank, world, sh.device)
    leader = groups.leader(rank)
    if not groups.shared and not node_local:
        if rank == leader:
            shutil.rmtree(staging, ignore_errors=True)
        comm.barrier()  # every rank raises once the staging directories are gone
        raise CheckpointError(
            f"the checkpoint directory {root!r} is not shared by every rank: {groups.describe()} (no shared filesystem "
            "between the nodes?). A checkpoint's files must all be in one directory every rank sees: save to a shared "
            "directory, or set checkpoint.use_node_local_storage (save(..., node_local=True)) to keep each node's "
            "copy on its own disk. Nothing was written; the previous checkpoint is intact"
        )
    group = None if groups.shared else groups.of(rank)
    if rank == leader != 0:
        clean_stale(root, keep=staging)
    return Where(root, staging, tag, nonce, rank, world, update_latest, timeout), groups, group


def _writer(state: TrainState, at: Where, groups, group, *, copy: bool, exclude_frozen: bool, cfg_json, client_state):
    """Steps 2-4 of the protocol, as a function to run now or in a background thread: this rank's
    part (taken here, in the foreground; copied to CPU memory when `copy`), written and committed."""
    sh = state.sharding
    places = expert_places(sh)  # expert units: stored as their whole layers' (`_ep.py`)
    metas, pieces = _pieces(state, copy=copy, group=group, exclude_frozen=exclude_frozen, places=places)
    extra = {"nonce": at.nonce, "rng": _rng_state()}
    plan = places.whole if places is not None else sh.plan
    head = index_head(state, at.tag, at.nonce, at.world, cfg_json, client_state, units=unit_meta(plan),
                      frozen_units=unit_meta(plan, frozen=True), frozen_excluded=bool(exclude_frozen))

    def work():
        if group is not None:
            try:
                _node_local_save(at, sh.comm, sh.device, groups, metas, pieces, extra, head, plan)
            except BaseException as e:
                mark_failed(at, e)
                raise
            return
        write_and_commit(at, metas, pieces, extra, lambda parts: merge_parts(parts, head))

    return work


def _run(work, root: str, tag: str, rank: int, blocking: bool) -> SaveHandle:
    """`work` now (blocking), or in a background thread that a later save, and interpreter exit, wait for."""
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
