"""`SaveHandle`: what `save` returns, a save's outcome that a caller may wait for; and the saves one
rank of a group writes for the group (a tensor-parallel group's consolidated state, a MiCS state's
first shard group, `specs/checkpoint-format.md` §MiCS), which hand the other ranks a finished one.
Apart from the save protocol (`_save.py`), which calls them and hands itself in."""

from __future__ import annotations

import os
import threading
from typing import Callable

import torch

from .._errors import CheckpointError
from .._state import Sharding, TrainState
from . import _format as F

__all__ = ["SaveHandle", "checked_tag", "save_first_replica", "saved_by_one"]


def checked_tag(tag, state: TrainState) -> str:
    """`tag` checked (`_format.check_tag`), or by default `step_{state.step}`."""
    return F.check_tag(tag if tag is not None else f"step_{int(state.step)}")


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
        handle = SaveHandle(os.path.abspath(os.fspath(path)), checked_tag(tag, state))
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
