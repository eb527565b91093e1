"""A simulated world: n ranks as threads of one process, connected by in-memory collectives.

No ports, no launcher, ~no startup cost, so hypothesis can draw hundreds of sharded cases. Results
equal a real gloo world's up to summation order: reductions here add contributions in rank order.
"""

from __future__ import annotations

import threading
import traceback
from typing import Any, Callable

import torch

from .._errors import DistributedError
from .._shard._collectives import PendingTensor

__all__ = ["ThreadCollectives", "simulated_world", "SimulatedWorld"]


class _Exchange:
    def __init__(self, n: int, timeout: float):
        self.n = n
        self.timeout = timeout
        self.barrier = threading.Barrier(n)
        self.slots: list[Any] = [None] * n
        self.ops: list[str | None] = [None] * n

    def wait(self):
        try:
            self.barrier.wait(self.timeout)
        except threading.BrokenBarrierError:
            raise DistributedError("a simulated rank failed or timed out inside a collective") from None

    def exchange(self, rank: int, op: str, value: Any) -> list[Any]:
        self.slots[rank] = value
        self.ops[rank] = op
        self.wait()
        ops, values = list(self.ops), list(self.slots)
        self.wait()  # nobody may overwrite a slot before everyone has read
        if len(set(ops)) != 1:
            raise DistributedError(f"ranks issued different collectives at the same point: {ops}")
        return values


class ThreadCollectives:
    """The `Collectives` interface for one rank of a simulated world."""

    def __init__(self, exchange: _Exchange, rank: int):
        self._x = exchange
        self.rank = rank
        self.world_size = exchange.n

    def all_gather(self, shard):
        parts = self._x.exchange(self.rank, f"all_gather:{shard.numel()}:{shard.dtype}", shard.detach().reshape(-1).clone())
        return torch.cat(parts)

    def all_gather_async(self, shard):
        return PendingTensor(self.all_gather(shard))

    def reduce_scatter(self, full):
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


class SimulatedWorld:
    """n ranks as threads. `run(fn)` calls `fn(comm)` on every rank with its ThreadCollectives and
    returns the results in rank order; an exception on any rank is re-raised naming the rank."""

    def __init__(self, n: int, timeout: float = 120.0):
        if n < 1:
            raise ValueError(f"a world needs at least one rank, got {n}")
        self.n = n
        self.timeout = timeout

    def run(self, fn: Callable[[ThreadCollectives], Any]) -> list[Any]:
        x = _Exchange(self.n, self.timeout)
        results: list[Any] = [None] * self.n
        errors: list[tuple[int, str]] = []

        def body(rank):
            try:
                results[rank] = fn(ThreadCollectives(x, rank))
            except BaseException:  # noqa: BLE001
                errors.append((rank, traceback.format_exc()))
                x.barrier.abort()  # release the other ranks instead of leaving them waiting

        threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(self.n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(self.timeout + 5)
        if any(t.is_alive() for t in threads):
            x.barrier.abort()
            raise DistributedError(f"simulated world of {self.n} did not finish within {self.timeout}s")
        if errors:
            first = min(errors)
            # Ranks that only saw the broken barrier are followers; report the rank that failed first.
            real = [e for e in errors if "BrokenBarrier" not in e[1] and "simulated rank failed" not in e[1]]
            rank, tb = min(real) if real else first
            raise DistributedError(f"rank {rank} of the simulated world raised:\n{tb}")
        return results


def simulated_world(n: int, timeout: float = 120.0) -> SimulatedWorld:
    """A SimulatedWorld of n thread ranks (usable as a context manager)."""
    return SimulatedWorld(n, timeout)


SimulatedWorld.__enter__ = lambda self: self  # type: ignore[attr-defined]
SimulatedWorld.__exit__ = lambda self, *exc: False  # type: ignore[attr-defined]
