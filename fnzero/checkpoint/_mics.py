"""Saves one rank of a group writes for the group: a tensor-parallel group's consolidated state,
a MiCS state's first shard group (`specs/checkpoint-format.md` §MiCS)."""

from __future__ import annotations

import os
from typing import Callable

import torch

from .._errors import CheckpointError
from .._state import Sharding, TrainState
from . import _format as F
from ._handle import SaveHandle

__all__ = ["save_first_replica", "saved_by_one"]


def saved_by_one(comm, writes: bool, save_it: Callable[[], SaveHandle], path, tag, state: TrainState, who: str):
    """`save_it()` (a blocking save) where `writes`; every rank of `comm` then hears whether it
    failed (one all-reduce), and the others get a finished handle: the same outcome everywhere."""
    handle, error = None, None
    if writes:
        try:
            handle = save_it()
        except BaseException as e:  # noqa: BLE001 - re-raised below, after telling the group
            error = e
    failed = int(comm.all_reduce(torch.tensor([1.0 if error is not None else 0.0], device=state.sharding.device))[0])
    if error is not None:
        raise error
    if failed:
        raise CheckpointError(f"{who} failed to save the checkpoint (its error says why); nothing of it was committed "
                              "by this group")
    if handle is None:
        handle = SaveHandle(os.path.abspath(os.fspath(path)), F.check_tag(tag if tag is not None else f"step_{int(state.step)}"))
        handle._finished.set()
    return handle


def save_first_replica(save: Callable[..., SaveHandle], path, state: TrainState, node_local: bool, **kw) -> SaveHandle:
    """A MiCS state (`specs/checkpoint-format.md` §MiCS): every shard group holds the same state,
    so the first one saves it with `save` (the whole protocol, `_save.py`, which calls this
    first and hands itself in), as a run of that group's size would, and the others wait for it and
    hear whether it failed. Blocking."""
    if node_local:
        raise CheckpointError("a node-local save (checkpoint.use_node_local_storage) of a MiCS state "
                              "(zero_optimization.mics_shard_size) is not implemented: save to a directory every rank "
                              "sees. Nothing was written")
    replicas = state.sharding.replicas
    alone = state.replace(sharding=_without_replicas(state.sharding))
    return saved_by_one(replicas, replicas.rank == 0, lambda: save(path, alone, blocking=True, **kw), path,
                        kw.get("tag"), state, "the first MiCS shard group")


def _without_replicas(sh: Sharding) -> Sharding:
    """The same sharding seen as the run of one shard group (its mesh without MiCS's replica groups)."""
    out = Sharding(sh.plan, sh.mesh.replace(replicas=None, hpz=None), sh.device, sh.watchdog)
    out.shard_sources = sh.shard_sources
    return out
