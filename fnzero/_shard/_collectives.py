"""The collectives fnzero uses, behind one small interface.

Every method returns a new tensor and leaves its input alone, so the sharding code reads like
math and tests can swap in a recording or an in-process implementation (`specs/collectives.md`).
"""

from __future__ import annotations

import dataclasses
import os
import threading
from typing import Protocol, runtime_checkable

import torch
import torch.distributed as dist

from ._direct import start_direct_all_gather, start_direct_reduce_scatter

__all__ = [
    "Collectives",
    "LocalCollectives",
    "ProcessGroupCollectives",
    "CollectiveRecord",
    "RecordingCollectives",
    "default_collectives",
    "CheckedCollectives",
    "PendingTensor",
    "start_all_gather_into",
    "start_all_reduce",
    "start_reduce_scatter",
]

_AVG = "avg"
_SUM = "sum"
_MAX = "max"


@runtime_checkable
class Collectives(Protocol):
    """What a data-parallel step needs from a communication backend.

    `all_gather(shard)` concatenates every rank's shard (same numel on each rank) in rank order;
    `reduce_scatter(full)` sums `full` across ranks and returns this rank's `1/world_size` slice;
    `all_reduce(t, op)` with op in {"sum", "max"}. `all_gather_async` returns a handle whose
    `wait()` gives the gathered tensor: stage 3 uses it to prefetch the next unit.
    """

    rank: int
    world_size: int

    def all_gather(self, shard: torch.Tensor) -> torch.Tensor: ...
    def all_gather_async(self, shard: torch.Tensor) -> "PendingTensor": ...
    def reduce_scatter(self, full: torch.Tensor) -> torch.Tensor: ...
    def all_reduce(self, t: torch.Tensor, op: str = _SUM) -> torch.Tensor: ...
    def broadcast(self, t: torch.Tensor, src: int = 0) -> torch.Tensor: ...
    def barrier(self) -> None: ...


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


def start_all_gather_into(comm, shard: torch.Tensor, out: torch.Tensor) -> PendingTensor:
    """Gather `shard` from every rank into `out` (no overlap with `shard`); implementations
    without an `out=` option gather into a new tensor that is copied into `out` on wait."""
    try:
        return comm.all_gather_async(shard, out=out)
    except TypeError:
        pending = comm.all_gather_async(shard)
        return PendingTensor(_CopyInto(pending, out).wait(), None)


class _CopyInto:
    __slots__ = ("pending", "out")

    def __init__(self, pending, out):
        self.pending, self.out = pending, out

    def wait(self):
        return self.out.copy_(self.pending.wait())


def start_reduce_scatter(comm, full: torch.Tensor) -> PendingTensor:
    """`comm.reduce_scatter_async` where the implementation has it, else a completed result."""
    fn = getattr(comm, "reduce_scatter_async", None)
    return fn(full) if fn is not None else PendingTensor(comm.reduce_scatter(full))


def reduce_scatter_donated(comm, full: torch.Tensor) -> torch.Tensor:
    """`comm.reduce_scatter(full)` for a caller that never reads `full` again: an implementation
    may receive into its memory instead of allocating (N-1)/N of it anew."""
    try:
        return comm.reduce_scatter(full, donate=True)
    except TypeError:  # an implementation without the donate option
        return comm.reduce_scatter(full)


def start_all_reduce(comm, t: torch.Tensor, donate: bool = False) -> PendingTensor:
    """`comm.all_reduce_async` (sum) where the implementation has it, else a completed result.
    `donate=True` lets an implementation reduce `t` in place."""
    fn = getattr(comm, "all_reduce_async", None)
    if fn is None:
        return PendingTensor(comm.all_reduce(t))
    try:
        return fn(t, donate=donate)
    except TypeError:  # an implementation without the donate option
        return fn(t)


class LocalCollectives:
    """World of one: every collective is the identity (a copy, so results never alias inputs)."""

    rank = 0
    world_size = 1

    def all_gather(self, shard):
        return shard.clone()

    def all_gather_async(self, shard):
        return PendingTensor(shard.clone())

    def reduce_scatter(self, full, donate: bool = False):
        return full if donate else full.clone()

    def reduce_scatter_async(self, full):
        return PendingTensor(full.clone())

    def all_reduce(self, t, op=_SUM):
        return t.clone()

    def all_reduce_async(self, t, donate: bool = False):
        return PendingTensor(t if donate else t.clone())

    def broadcast(self, t, src=0):
        return t.clone()

    def barrier(self):
        return None


_REDUCE_OPS = {_SUM: dist.ReduceOp.SUM, _MAX: dist.ReduceOp.MAX}


def _all_gather_fn():
    # torch >= 2.13 renamed the tensor-in/tensor-out collectives; older releases have the old names.
    return getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _reduce_scatter_fn():
    return getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class ProcessGroupCollectives:
    """Collectives over a torch.distributed process group (gloo on CPU, NCCL on CUDA)."""

    def __init__(self, group=None):
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        # On gloo, all-gather and reduce-scatter run as direct point-to-point exchanges
        # (`_direct.py`: same bytes, 4x faster there); FNZERO_GLOO_DIRECT=0 uses gloo's own.
        self._direct = (
            self.world_size > 1
            and dist.get_backend(group) == "gloo"
            and os.environ.get("FNZERO_GLOO_DIRECT", "1") != "0"
        )

    def _use_direct(self, t: torch.Tensor) -> bool:
        return self._direct and t.device.type == "cpu"

    def all_gather(self, shard):
        return self.all_gather_async(shard).wait()

    def all_gather_async(self, shard, out: torch.Tensor | None = None):
        # `out`: gather straight into this buffer (it must not overlap `shard`).
        shard = shard.contiguous()
        if out is None:
            out = shard.new_empty(shard.numel() * self.world_size)
        if self._use_direct(shard):
            return start_direct_all_gather(shard.reshape(-1), out, self.rank, self.world_size, self.group)
        work = _all_gather_fn()(out, shard.reshape(-1), group=self.group, async_op=True)
        return PendingTensor(out, work)

    def reduce_scatter(self, full, donate: bool = False):
        if donate and self._use_direct(full) and full.is_contiguous():
            full = full.reshape(-1)
            assert full.numel() % self.world_size == 0, "reduce_scatter input must be padded to the world size"
            return start_direct_reduce_scatter(full, self.rank, self.world_size, self.group, donate=True).wait()
        return self.reduce_scatter_async(full).wait()

    def reduce_scatter_async(self, full):
        full = full.contiguous().reshape(-1)
        assert full.numel() % self.world_size == 0, "reduce_scatter input must be padded to the world size"
        if self._use_direct(full):
            return start_direct_reduce_scatter(full, self.rank, self.world_size, self.group)
        out = full.new_empty(full.numel() // self.world_size)
        work = _reduce_scatter_fn()(out, full, op=dist.ReduceOp.SUM, group=self.group, async_op=True)
        # `full` must outlive the collective: the handle keeps it.
        return PendingTensor(out, _KeepAlive(work, full))

    def all_reduce(self, t, op=_SUM):
        out = t.clone()
        dist.all_reduce(out, op=_REDUCE_OPS[op], group=self.group)
        return out

    def all_reduce_async(self, t, donate: bool = False):
        # donate=True: the caller gives `t` up, so it is reduced in place (no copy of the gradient).
        out = t if donate else t.clone()
        work = dist.all_reduce(out, op=dist.ReduceOp.SUM, group=self.group, async_op=True)
        return PendingTensor(out, work)

    def broadcast(self, t, src=0):
        out = t.clone()
        dist.broadcast(out, src=src, group=self.group)
        return out

    def barrier(self):
        dist.barrier(group=self.group)


def default_collectives() -> Collectives:
    """Collectives over the default process group, or a world of one when none is initialized.

    Inside `fnzero.testing.simulated_world(n).run(fn)` it is the calling thread's simulated rank,
    so the same user code runs unchanged there and under `fnzero launch`."""
    import sys

    # Only fnzero.testing starts simulated worlds: if it was never imported, none is running.
    sim = sys.modules.get("fnzero.testing._context")
    if sim is not None and sim.current_comm() is not None:
        return sim.current_comm()
    if dist.is_available() and dist.is_initialized():
        return ProcessGroupCollectives()
    return LocalCollectives()


@dataclasses.dataclass(frozen=True)
class CollectiveRecord:
    """One collective call as seen by this rank: its name, dtype and logical bytes (input side)."""

    op: str
    dtype: torch.dtype
    numel: int
    bytes: int


class RecordingCollectives:
    """Wraps another `Collectives` and records every call: the comms logger and traffic tests use it.

    Logical bytes follow `specs/collectives.md`: all_gather counts the gathered output,
    reduce_scatter and all_reduce count the full input, so that ring-equivalent bytes sent per rank
    are `all_reduce * 2(N-1)/N` and `all_gather/reduce_scatter * (N-1)/N`.
    """

    def __init__(self, inner: Collectives):
        self.inner = inner
        self.rank = inner.rank
        self.world_size = inner.world_size
        self.records: list[CollectiveRecord] = []
        self._lock = threading.Lock()
        # Optional callback: the debug checker uses it to compare call sequences across ranks.
        self.on_record = None

    def _record(self, op: str, t: torch.Tensor, numel: int) -> None:
        rec = CollectiveRecord(op, t.dtype, numel, numel * t.element_size())
        with self._lock:
            self.records.append(rec)
        if self.on_record is not None:
            self.on_record(rec)

    def all_gather(self, shard):
        self._record("all_gather", shard, shard.numel() * self.world_size)
        return self.inner.all_gather(shard)

    def all_gather_async(self, shard, out=None):
        self._record("all_gather", shard, shard.numel() * self.world_size)
        if out is not None:
            return start_all_gather_into(self.inner, shard, out)
        return self.inner.all_gather_async(shard)

    def reduce_scatter(self, full, donate: bool = False):
        self._record("reduce_scatter", full, full.numel())
        return reduce_scatter_donated(self.inner, full) if donate else self.inner.reduce_scatter(full)

    def reduce_scatter_async(self, full):
        self._record("reduce_scatter", full, full.numel())
        return start_reduce_scatter(self.inner, full)

    def all_reduce(self, t, op=_SUM):
        self._record("all_reduce", t, t.numel())
        return self.inner.all_reduce(t, op)

    def all_reduce_async(self, t, donate: bool = False):
        self._record("all_reduce", t, t.numel())
        return start_all_reduce(self.inner, t, donate)

    def broadcast(self, t, src=0):
        self._record("broadcast", t, t.numel())
        return self.inner.broadcast(t, src)

    def barrier(self):
        return self.inner.barrier()

    def reset(self) -> list[CollectiveRecord]:
        with self._lock:
            out, self.records = self.records, []
        return out

    def ring_bytes_sent(self, records=None) -> float:
        """Ring-equivalent bytes this rank sends for `records` (default: all recorded so far)."""
        n = self.world_size
        if n == 1:
            return 0.0
        total = 0.0
        for r in self.records if records is None else records:
            if r.op == "all_reduce":
                total += r.bytes * 2 * (n - 1) / n
            elif r.op in ("all_gather", "reduce_scatter"):
                total += r.bytes * (n - 1) / n
            elif r.op == "broadcast":
                total += r.bytes
        return total


class CheckedCollectives:
    """Debug wrapper: before each collective, every rank shares a fingerprint of the call it is
    about to make (op, dtype, element count, call index); a mismatch raises on every rank, naming
    the first divergent call and what each rank issued, instead of a hang or silent garbage.

    Costs one small all-gather per collective: for debugging, not for production runs.
    """

    _OPS = {"all_gather": 1, "reduce_scatter": 2, "all_reduce": 3, "broadcast": 4, "barrier": 5}

    def __init__(self, inner: Collectives):
        self.inner = inner
        self.rank = inner.rank
        self.world_size = inner.world_size
        self.calls = 0

    def _check(self, op: str, t: torch.Tensor | None) -> None:
        from .._errors import DistributedError

        dtype_code = hash(str(t.dtype)) % 1_000_003 if t is not None else 0
        mine = torch.tensor([self.calls, self._OPS[op], dtype_code, t.numel() if t is not None else 0], dtype=torch.int64)
        if t is not None and t.device.type != "cpu":
            mine = mine.to(t.device)
        everyone = self.inner.all_gather(mine).cpu().view(self.world_size, 4)
        self.calls += 1
        if not bool((everyone == everyone[0]).all()):
            names = {v: k for k, v in self._OPS.items()}
            desc = [f"rank {r}: {names.get(int(row[1]), '?')} of {int(row[3])} elements" for r, row in enumerate(everyone)]
            raise DistributedError(
                f"ranks diverged at collective #{self.calls - 1} (this is rank {self.rank}): " + "; ".join(desc)
            )

    def all_gather(self, shard):
        self._check("all_gather", shard)
        return self.inner.all_gather(shard)

    def all_gather_async(self, shard, out=None):
        self._check("all_gather", shard)
        if out is not None:
            return start_all_gather_into(self.inner, shard, out)
        return self.inner.all_gather_async(shard)

    def reduce_scatter(self, full, donate: bool = False):
        self._check("reduce_scatter", full)
        return reduce_scatter_donated(self.inner, full) if donate else self.inner.reduce_scatter(full)

    def reduce_scatter_async(self, full):
        self._check("reduce_scatter", full)
        return start_reduce_scatter(self.inner, full)

    def all_reduce(self, t, op=_SUM):
        self._check("all_reduce", t)
        return self.inner.all_reduce(t, op)

    def all_reduce_async(self, t, donate: bool = False):
        self._check("all_reduce", t)
        return start_all_reduce(self.inner, t, donate)

    def broadcast(self, t, src=0):
        self._check("broadcast", t)
        return self.inner.broadcast(t, src)

    def barrier(self):
        self._check("barrier", None)
        return self.inner.barrier()
