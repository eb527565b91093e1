"""A simulated world: n ranks as threads of one process, connected by in-memory collectives that
reduce in rank order; inside `run(fn)` each thread is its rank for `fnzero.init_distributed()` and
`fnzero.shard(model)` (`_context.py`; `specs/testing.md` §Worlds, §Simulated vs real).
"""

from __future__ import annotations

import contextlib
import inspect
import queue
import threading
import time
import traceback
from typing import Any, Callable

import torch

from .._errors import DistributedError
from ..sharding import check_agreement, resolve_splits, CollectivesBase, PendingTensor
from ._context import RNG_LOCK, rank_context

__all__ = ["ThreadCollectives", "simulated_world", "SimulatedWorld", "World", "wants_comm"]


def _release_all(lock) -> int:
    """Release a re-entrant lock this thread holds, however deep; how many times it was held."""
    held = 0
    while True:
        try:
            lock.release()
        except RuntimeError:  # not (or no longer) held by this thread
            return held
        held += 1


class _Exchange:
    def __init__(self, n: int, timeout: float):
        self.n = n
        self.timeout = timeout
        self.barrier = threading.Barrier(n)
        self.slots: list[Any] = [None] * n
        self.ops: list[str | None] = [None] * n
        self._subs: dict[tuple[int, ...], _Exchange] = {}
        self._subs_lock = threading.Lock()
        self._boxes: dict[tuple[int, int, int], queue.Queue] = {}  # (src, dst, tag): messages in order

    def box(self, src: int, dst: int, tag: int = 0) -> queue.Queue:
        with self._subs_lock:
            return self._boxes.setdefault((src, dst, tag), queue.Queue())

    def sub(self, ranks: tuple[int, ...]) -> "_Exchange":
        """The exchange of the sub-world of `ranks`, shared by the threads that ask for it."""
        with self._subs_lock:
            x = self._subs.get(ranks)
            if x is None:
                x = self._subs[ranks] = _Exchange(len(ranks), self.timeout)
            return x

    def abort(self) -> None:
        """Release every rank waiting here or in a sub-world (one rank failed)."""
        self.barrier.abort()
        with self._subs_lock:
            subs = list(self._subs.values())
        for x in subs:
            x.abort()

    def wait(self):
        # A rank may reach a collective inside `seeded` (say `init_state`'s check that the ranks
        # built the same weights); holding the RNG lock there would block every other rank
        # before its own `seeded` block, so it is let go while this rank waits, and taken back.
        held = _release_all(RNG_LOCK)
        try:
            self.barrier.wait(self.timeout)
        except threading.BrokenBarrierError:
            raise DistributedError("a simulated rank failed or timed out inside a collective") from None
        finally:
            for _ in range(held):
                RNG_LOCK.acquire()

    def exchange(self, rank: int, op: str, value: Any) -> list[Any]:
        self.slots[rank] = value
        self.ops[rank] = op
        self.wait()
        ops, values = list(self.ops), list(self.slots)
        self.wait()  # nobody may overwrite a slot before everyone has read
        if len(set(ops)) != 1:
            raise DistributedError(f"ranks issued different collectives at the same point: {ops}")
        return values


class ThreadCollectives(CollectivesBase):
    """The `Collectives` interface for one rank of a simulated world (the async forms complete at
    once, from `CollectivesBase`)."""

    backend = "simulated"  # what `init_distributed` reports inside the world

    def __init__(self, exchange: _Exchange, rank: int):
        self._x = exchange
        self.rank = rank
        self.world_size = exchange.n

    def all_gather(self, shard):
        parts = self._x.exchange(self.rank, f"all_gather:{shard.numel()}:{shard.dtype}", shard.detach().reshape(-1).clone())
        return torch.cat(parts)

    def reduce_scatter(self, full, donate: bool = False):
        full = full.detach().reshape(-1)
        parts = self._x.exchange(self.rank, f"reduce_scatter:{full.numel()}:{full.dtype}", full.clone())
        n = full.numel() // self.world_size
        lo = self.rank * n
        out = parts[0][lo : lo + n].clone()
        for p in parts[1:]:
            out += p[lo : lo + n]
        return out

    def all_reduce(self, t, op="sum"):
        parts = self._x.exchange(self.rank, f"all_reduce:{op}:{t.numel()}:{t.dtype}", t.detach().clone())
        out = parts[0].clone()
        for p in parts[1:]:
            out = out + p if op == "sum" else torch.maximum(out, p)
        return out

    def broadcast(self, t, src=0):
        parts = self._x.exchange(self.rank, f"broadcast:{src}", t.detach().clone())
        return parts[src].clone()

    def barrier(self):
        self._x.exchange(self.rank, "barrier", None)

    def all_to_all(self, tensor, *, input_split_sizes=None, output_split_sizes=None, label: str = ""):
        ins, outs = resolve_splits(self, tensor, input_split_sizes, output_split_sizes)
        # Every rank sees every call, so a disagreement (dtype, row shape, sizes) is the same
        # error on all of them, naming the ranks, as the debug checker's on a real world.
        calls = self._x.exchange(self.rank, "all_to_all", (tensor.detach().clone(), ins, outs))
        check_agreement([(t.dtype, tuple(t.shape[1:]), i, o) for t, i, o in calls])
        return torch.cat([t.split(i)[self.rank] for t, i, _ in calls])

    def send_async(self, t, dst: int, label: str = "", tag: int = 0):
        self._x.box(self.rank, dst, tag).put(t.detach().clone())
        return PendingTensor(t)

    def recv(self, out, src: int, label: str = "", tag: int = 0):
        box, deadline = self._x.box(src, self.rank, tag), time.monotonic() + self._x.timeout
        while True:  # in short waits, so a failed rank (a broken barrier) releases this one
            try:
                value = box.get(timeout=0.05)
                break
            except queue.Empty:
                if self._x.barrier.broken:
                    raise DistributedError(f"a simulated rank failed or timed out inside a collective (rank "
                                           f"{self.rank} was waiting for a message from rank {src})") from None
                if time.monotonic() > deadline:
                    raise DistributedError(f"rank {self.rank} waited in vain for a message from rank {src}") from None
        if value.shape != out.shape or value.dtype != out.dtype:
            raise DistributedError(f"rank {self.rank} expected {tuple(out.shape)} {out.dtype} from rank {src}, "
                                   f"got {tuple(value.shape)} {value.dtype}")
        return out.copy_(value)

    def new_groups(self, partition: list[list[int]]) -> "ThreadCollectives":
        """The collectives of the group of `partition` (a partition of this world's ranks, the
        same on every rank) that holds this rank; as torch.distributed's
        `new_subgroups_by_enumeration`."""
        mine = [tuple(g) for g in partition if self.rank in g]
        if len(mine) != 1:
            raise ValueError(f"rank {self.rank} must be in exactly one group of {partition}")
        return ThreadCollectives(self._x.sub(mine[0]), mine[0].index(self.rank))


def wants_comm(fn: Callable[..., Any]) -> bool:
    """Whether `fn` takes the rank's collectives as its one argument (else it is called bare)."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # builtins and some C callables: keep the old convention
        return True
    # A required positional parameter (or *args) receives the comm; `fn()` and `fn(x=default)` do not.
    return any(
        p.kind is p.VAR_POSITIONAL
        or (p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty)
        for p in sig.parameters.values()
    )


class World(contextlib.AbstractContextManager):
    """What the simulated and the spawned world share: n >= 1 ranks, and a context manager whose
    exit does nothing (each `run` starts and ends its own ranks)."""

    def __init__(self, n: int, timeout: float):
        if n < 1:
            raise ValueError(f"a world needs at least one rank, got {n}")
        self.n, self.timeout = n, timeout

    @property
    def world_size(self) -> int:
        return self.n

    def __exit__(self, *exc) -> bool:
        return False


class SimulatedWorld(World):
    """n ranks as threads (`specs/testing.md` §Worlds): `run(fn)` calls `fn(comm)` (or `fn()`) on every
    rank and returns the results in rank order. `wrap_comm(comm) -> comm` wraps every rank's
    collectives; `init_lock` guards torch's RNG, which the threads share (`seeded` holds it)."""

    init_lock = RNG_LOCK
    backend = "simulated"

    def __init__(self, n: int, timeout: float = 120.0, wrap_comm: Callable[[Any], Any] | None = None):
        super().__init__(n, timeout)
        self.wrap_comm = wrap_comm

    def run(self, fn: Callable[..., Any]) -> list[Any]:
        x = _Exchange(self.n, self.timeout)
        results: list[Any] = [None] * self.n
        errors: list[tuple[int, str]] = []
        pass_comm = wants_comm(fn)

        def body(rank):
            try:
                comm = ThreadCollectives(x, rank)
                if self.wrap_comm is not None:
                    comm = self.wrap_comm(comm)
                with rank_context(comm):
                    results[rank] = fn(comm) if pass_comm else fn()
            except BaseException:  # noqa: BLE001
                errors.append((rank, traceback.format_exc()))
                x.abort()  # release the other ranks instead of leaving them waiting

        threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(self.n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(self.timeout + 5)
        if any(t.is_alive() for t in threads):
            x.abort()
            raise DistributedError(f"simulated world of {self.n} did not finish within {self.timeout}s")
        if errors:
            first = min(errors)
            # Ranks that only saw the broken barrier are followers; report the rank that failed first.
            real = [e for e in errors if "BrokenBarrier" not in e[1] and "simulated rank failed" not in e[1]]
            rank, tb = min(real) if real else first
            raise DistributedError(f"rank {rank} of the simulated world raised:\n{tb}")
        return results


def simulated_world(n: int, timeout: float = 120.0, wrap_comm: Callable[[Any], Any] | None = None) -> SimulatedWorld:
    """A SimulatedWorld of n thread ranks (usable as a context manager).

    >>> import fnzero
    >>> with simulated_world(2) as world:
    ...     world.run(lambda: fnzero.init_distributed().rank)
    [0, 1]
    """
    return SimulatedWorld(n, timeout, wrap_comm)
