"""The collectives fnzero uses, behind one small interface whose methods return new tensors and
leave their inputs alone, so tests can swap in a recording or in-process one (`specs/collectives.md`)."""

from __future__ import annotations

import contextlib
import contextvars
import os
from typing import Iterator, NoReturn, Protocol, Sequence, runtime_checkable

import torch
import torch.distributed as dist

from ..._errors import DistributedError
from ._all_to_all import gathered_all_to_all, resolve_splits
from ._direct import start_direct_all_gather, start_direct_reduce_scatter
from ._failure import explain_failure
from ._shm import CAPACITY as _SHM_CAPACITY, SharedSegment
from ._watchdog import process_watchdog

__all__ = [
    "Collectives", "CollectivesBase", "LocalCollectives", "ProcessGroupCollectives", "default_collectives",
    "current_world_size", "provided_collectives", "providing_collectives", "PendingTensor",
]

_AVG = "avg"
_SUM = "sum"
_MAX = "max"


@runtime_checkable
class Collectives(Protocol):
    """What a data-parallel step needs from a communication backend (`specs/collectives.md` §Interface).

    `all_gather(shard)` concatenates every rank's shard (same numel on each rank) in rank order;
    `reduce_scatter(full)` sums `full` across ranks and returns this rank's `1/world_size` slice;
    `all_reduce(t, op)` with op in {"sum", "max"}; `all_to_all` as torch's `all_to_all_single`. The
    `_async` forms return a `PendingTensor`; `send_async`/`recv`: point-to-point, for pipelines."""

    rank: int
    world_size: int

    def all_gather(self, shard: torch.Tensor) -> torch.Tensor: ...
    def all_gather_async(self, shard: torch.Tensor, out: torch.Tensor | None = None, label: str = "") -> "PendingTensor": ...
    def reduce_scatter(self, full: torch.Tensor, donate: bool = False) -> torch.Tensor: ...
    def reduce_scatter_async(self, full: torch.Tensor, label: str = "") -> "PendingTensor": ...
    def all_reduce(self, t: torch.Tensor, op: str = _SUM) -> torch.Tensor: ...
    def all_reduce_async(self, t: torch.Tensor, donate: bool = False, label: str = "") -> "PendingTensor": ...
    def broadcast(self, t: torch.Tensor, src: int = 0) -> torch.Tensor: ...
    def barrier(self) -> None: ...
    def all_to_all(self, tensor: torch.Tensor, *, input_split_sizes: Sequence[int] | None = None,
                   output_split_sizes: Sequence[int] | None = None, label: str = "") -> torch.Tensor: ...
    def all_to_all_async(self, tensor: torch.Tensor, *, input_split_sizes: Sequence[int] | None = None,
                         output_split_sizes: Sequence[int] | None = None, label: str = "") -> "PendingTensor": ...


def waited_all_to_all(self, tensor, *, input_split_sizes=None, output_split_sizes=None, label: str = ""):
    """`all_to_all` as a class's `all_to_all_async`, waited for."""
    return self.all_to_all_async(tensor, input_split_sizes=input_split_sizes, output_split_sizes=output_split_sizes,
                                 label=label).wait()


class CollectivesBase:
    """The optional forms of `Collectives` from the five blocking ones a subclass defines: async calls
    complete at once, `out=` is a copy; all-to-all is made of all-gathers (N times the bytes)."""

    def all_to_all(self, tensor: torch.Tensor, *, input_split_sizes: Sequence[int] | None = None,
                   output_split_sizes: Sequence[int] | None = None, label: str = "") -> torch.Tensor:
        ins, outs = resolve_splits(self, tensor, input_split_sizes, output_split_sizes)
        return gathered_all_to_all(self, tensor, ins, outs)

    def all_to_all_async(self, tensor: torch.Tensor, *, input_split_sizes: Sequence[int] | None = None,
                         output_split_sizes: Sequence[int] | None = None, label: str = "") -> "PendingTensor":
        return PendingTensor(self.all_to_all(tensor, input_split_sizes=input_split_sizes,
                                             output_split_sizes=output_split_sizes, label=label))

    def all_gather_async(self, shard: torch.Tensor, out: torch.Tensor | None = None, label: str = "") -> "PendingTensor":
        t = self.all_gather(shard)
        return PendingTensor(out.copy_(t) if out is not None else t)

    def reduce_scatter_async(self, full: torch.Tensor, label: str = "") -> "PendingTensor":
        return PendingTensor(self.reduce_scatter(full))

    def all_reduce_async(self, t: torch.Tensor, donate: bool = False, label: str = "") -> "PendingTensor":
        return PendingTensor(self.all_reduce(t))


class PendingTensor:
    """A tensor that a collective is still filling; `wait()` returns it."""

    __slots__ = ("_tensor", "_work")

    def __init__(self, tensor: torch.Tensor, work=None):
        self._tensor = tensor
        self._work = work

    def wait(self) -> torch.Tensor:
        if self._work is not None:
            self._work.wait()
            self._work = None
        return self._tensor


class _KeepAlive:
    """A collective's work handle plus the input it reads, so the input cannot be freed early."""

    __slots__ = ("work", "ref")

    def __init__(self, work, ref):
        self.work, self.ref = work, ref

    def wait(self):
        self.work.wait()
        self.ref = None


class LocalCollectives(CollectivesBase):
    """World of one: every collective is the identity (a copy, so results never alias inputs)."""

    rank = 0
    world_size = 1

    def all_gather(self, shard):
        return shard.clone()

    def all_gather_async(self, shard, out: torch.Tensor | None = None, label: str = ""):
        return PendingTensor(out.copy_(shard) if out is not None else shard.clone())

    def reduce_scatter(self, full, donate: bool = False):
        return full if donate else full.clone()

    def reduce_scatter_async(self, full, label: str = ""):
        return PendingTensor(full.clone())

    def all_reduce(self, t, op=_SUM):
        return t.clone()

    def all_reduce_async(self, t, donate: bool = False, label: str = ""):
        return PendingTensor(t if donate else t.clone())

    def broadcast(self, t, src=0):
        return t.clone()

    def barrier(self):
        return None

    def all_to_all(self, tensor, *, input_split_sizes=None, output_split_sizes=None, label: str = ""):
        resolve_splits(self, tensor, input_split_sizes, output_split_sizes)  # the same errors as N > 1
        return tensor.clone()


_REDUCE_OPS = {_SUM: dist.ReduceOp.SUM, _MAX: dist.ReduceOp.MAX}


_BACKEND_WORDS = ("gloo", "nccl", "connection", "timed out", "timeout", "peer", "socket", "c10d")


def _backend_error(e: RuntimeError) -> bool:
    """A failure of the communication backend (a peer gone, a timeout), as opposed to an error of
    this rank's own (out of memory, a wrong argument), which is raised as it is."""
    if isinstance(e, torch.OutOfMemoryError):
        return False
    backend_type = getattr(dist, "DistBackendError", None)
    if backend_type is not None and isinstance(e, backend_type):
        return True
    text = str(e).lower()
    return any(w in text for w in _BACKEND_WORDS)


def _raise_failure(e: RuntimeError, wd, seq: int, kind: str, label: str) -> NoReturn:
    """`e` as a `DistributedError` naming the rank and collective #seq when the backend failed;
    any other error as it is."""
    if not _backend_error(e):
        raise e
    message, ranks = explain_failure(wd, seq, kind, e, label)
    raise DistributedError(message, ranks=ranks) from e


class _Watched:
    """A collective in flight under the watchdog: its wait is marked as blocked on #seq, and a
    backend error becomes a `DistributedError` that names the rank and the collective."""

    __slots__ = ("_pending", "_wd", "_seq", "_kind", "_label")

    def __init__(self, pending, wd, seq: int, kind: str, label: str):
        self._pending, self._wd, self._seq, self._kind, self._label = pending, wd, seq, kind, label

    def wait(self) -> torch.Tensor:
        try:
            if self._wd is None:
                return self._pending.wait()
            with self._wd.waiting(self._seq, self._kind, self._label):
                return self._pending.wait()
        except RuntimeError as e:  # gloo/NCCL: "Connection closed by peer", "Timed out waiting ..."
            _raise_failure(e, self._wd, self._seq, self._kind, self._label)


class ProcessGroupCollectives:
    """Collectives over a torch.distributed process group (gloo on CPU, NCCL on CUDA), watched over
    the default group by the process's watchdog (`specs/collectives.md` §Watchdog, §Faults)."""

    # torch's functional collectives can run over this group inside a graph (`fnzero.jit(scope="step")`).
    traceable = True

    def __init__(self, group=None):
        self.group = group
        self.watchdog = process_watchdog() if group is None else None
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        # On gloo, all-gather and reduce-scatter run as direct point-to-point exchanges
        # (`_direct.py`: same bytes, 4x faster there); FNZERO_GLOO_DIRECT=0 uses gloo's own.
        self._direct = (
            self.world_size > 1
            and dist.get_backend(group) == "gloo"
            and os.environ.get("FNZERO_GLOO_DIRECT", "1") != "0"
        )
        # Small all-reduces among one host's gloo ranks go through shared memory (`_shm.py`):
        # None until the first one decides, False where the ranks cannot share a segment.
        self._shm: SharedSegment | None | bool = None if self._direct else False

    def _use_direct(self, t: torch.Tensor) -> bool:
        return self._direct and t.device.type == "cpu"

    def _start(self, kind: str, start, label: str = "") -> _Watched:
        """Issue collective `kind` (`start()` returns its pending result), numbered and watched."""
        seq = self.watchdog.issue(kind, label) if self.watchdog is not None else 0
        try:
            return _Watched(start(), self.watchdog, seq, kind, label)
        except RuntimeError as e:
            _raise_failure(e, self.watchdog, seq, kind, label)

    def all_gather(self, shard):
        shm = self._shared_memory(shard)
        if shm is not None:
            return self._start("all_gather", lambda: shm.start(shard.contiguous(), gather=True)).wait()
        return self.all_gather_async(shard).wait()

    def all_gather_async(self, shard, out: torch.Tensor | None = None, label: str = ""):
        # `out`: gather straight into this buffer (it must not overlap `shard`).
        shard = shard.contiguous()
        if out is None:
            out = shard.new_empty(shard.numel() * self.world_size)
        if self._use_direct(shard):
            return self._start("all_gather", lambda: start_direct_all_gather(
                shard.reshape(-1), out, self.rank, self.world_size, self.group), label)
        return self._start("all_gather", lambda: PendingTensor(
            out, dist.all_gather_single(out, shard.reshape(-1), group=self.group, async_op=True)), label)

    def reduce_scatter(self, full, donate: bool = False):
        if donate and self._use_direct(full) and full.is_contiguous():
            full = full.reshape(-1)
            assert full.numel() % self.world_size == 0, "reduce_scatter input must be padded to the world size"
            return self._start("reduce_scatter", lambda: start_direct_reduce_scatter(
                full, self.rank, self.world_size, self.group, donate=True)).wait()
        return self.reduce_scatter_async(full).wait()

    def reduce_scatter_async(self, full, label: str = ""):
        full = full.contiguous().reshape(-1)
        assert full.numel() % self.world_size == 0, "reduce_scatter input must be padded to the world size"
        if self._use_direct(full):
            return self._start("reduce_scatter", lambda: start_direct_reduce_scatter(
                full, self.rank, self.world_size, self.group), label)
        out = full.new_empty(full.numel() // self.world_size)
        # `full` must outlive the collective: the handle keeps it.
        return self._start("reduce_scatter", lambda: PendingTensor(out, _KeepAlive(
            dist.reduce_scatter_single(out, full, op=dist.ReduceOp.SUM, group=self.group, async_op=True), full)), label)

    def _shared_memory(self, t: torch.Tensor) -> SharedSegment | None:
        """The group's shared segment for this blocking all-reduce or all-gather, if it may take it: a
        CPU tensor of at most 1 MiB (the same answer on every rank: their tensors match); made at the
        first such call."""
        if self._shm is False or t.device.type != "cpu" or t.numel() * t.element_size() > _SHM_CAPACITY \
                or t.is_complex():  # fmt: skip
            return None
        if self._shm is None:
            self._shm = SharedSegment.open(self) or False
        return self._shm or None

    def _gloo_all_reduce(self, t: torch.Tensor, op: str = _SUM) -> torch.Tensor:
        """`all_reduce` through gloo itself (also the shared segment's own agreement)."""
        out = t.clone()
        return self._start("all_reduce", lambda: PendingTensor(
            out, dist.all_reduce(out, op=_REDUCE_OPS[op], group=self.group, async_op=True))).wait()

    def all_reduce(self, t, op=_SUM):
        shm = self._shared_memory(t) if op == _SUM else None
        if shm is not None:
            return self._start("all_reduce", lambda: shm.start(t)).wait()
        return self._gloo_all_reduce(t, op)

    def all_reduce_async(self, t, donate: bool = False, label: str = ""):
        # donate=True: the caller gives `t` up, so it is reduced in place (no copy of the gradient).
        out = t if donate else t.clone()
        return self._start("all_reduce", lambda: PendingTensor(
            out, dist.all_reduce(out, op=dist.ReduceOp.SUM, group=self.group, async_op=True)), label)

    def broadcast(self, t, src=0):
        out = t.clone()
        return self._start("broadcast", lambda: PendingTensor(
            out, dist.broadcast(out, src=src, group=self.group, async_op=True))).wait()

    def barrier(self):
        self._start("barrier", lambda: PendingTensor(None, dist.barrier(group=self.group, async_op=True))).wait()

    all_to_all = waited_all_to_all

    def all_to_all_async(self, tensor, *, input_split_sizes=None, output_split_sizes=None, label: str = ""):
        # Gloo and NCCL both have all_to_all_single, uneven splits included; it is one exchange
        # already, so gloo needs no direct form (§Interface.gloo). The handle keeps `tensor` alive.
        ins, outs = resolve_splits(self, tensor, input_split_sizes, output_split_sizes)
        out = tensor.new_empty((sum(outs), *tensor.shape[1:]))
        return self._start("all_to_all", lambda: PendingTensor(out, _KeepAlive(dist.all_to_all_single(
            out, tensor, outs, ins, group=self.group, async_op=True), tensor)), label)

    def send_async(self, t, dst: int, label: str = "", tag: int = 0):
        t = t.contiguous()  # kept alive by the handle until the send completes
        return self._start("send", lambda: PendingTensor(t, dist.isend(t, group=self.group, group_dst=dst, tag=tag)),
                           label)

    def recv(self, out, src: int, label: str = "", tag: int = 0):
        return self._start("recv", lambda: PendingTensor(out, dist.irecv(out, group=self.group, group_src=src,
                                                                           tag=tag)), label).wait()


# [Note: why a context variable] `fnzero.testing`'s simulated worlds run user code, one thread per
# rank, that calls `fnzero.shard(model)` or `init_distributed()` with no parameter for the rank: whoever
# starts a block provides its collectives (`providing_collectives`); `default_collectives` reads them.
_PROVIDED: contextvars.ContextVar["Collectives | None"] = contextvars.ContextVar("fnzero_provided_collectives",
                                                                              default=None)


@contextlib.contextmanager
def providing_collectives(comm: "Collectives") -> Iterator[None]:
    """Run the block with `comm` as the default collectives (this thread, and contexts copied
    from it): `shard`, `init_distributed` and `fnzero.load_config` called without a world use it."""
    token = _PROVIDED.set(comm)
    try:
        yield
    finally:
        _PROVIDED.reset(token)


def provided_collectives() -> "Collectives | None":
    """The collectives `providing_collectives` set for the calling code, or None."""
    return _PROVIDED.get()


def default_collectives() -> Collectives:
    """The provided collectives (a simulated rank's, `providing_collectives`), else the default
    process group's, else a world of one: the same code runs simulated and under `fnzero launch`."""
    comm = _PROVIDED.get()
    if comm is not None:
        return comm
    if dist.is_available() and dist.is_initialized():
        return ProcessGroupCollectives()
    return LocalCollectives()


def current_world_size() -> int:
    """The data-parallel world this code runs in: the provided collectives', torch.distributed's
    default group's, else 1 (as DeepSpeed reads its world)."""
    comm = _PROVIDED.get()
    if comm is not None:
        return int(comm.world_size)
    if dist.is_available() and dist.is_initialized():
        return int(dist.get_world_size())
    return 1
