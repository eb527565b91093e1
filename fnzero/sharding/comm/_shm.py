"""Small all-reduces and all-gathers among the ranks of one host through shared memory (`specs/collectives.md`
§Shared memory).

[Note: why]
On CPU every gloo all-reduce is a rendezvous of the ranks' gloo threads over loopback sockets:
measured on 2 cores, a 12 KiB all-reduce between two ranks that compute between calls costs 1.25 ms
(0.63 ms when they do nothing else); through a shared segment it costs 0.15 ms. Tensor parallelism
makes two such calls per layer and token, so generation at tp 2 spent more time in them than in its
half of the matrix products. DeepSpeed's CPU AutoTP does the same (a shared-memory all-reduce below
1 MiB).

The scheme: one segment per group, a line of flags (this rank's call count and pid) and two slots per
rank, used by call parity. A rank copies its tensor into its slot of this parity, publishes its count,
waits until every rank has published it, and sums the slots in rank order, so every rank gets the
same bits (two ranks: the same as gloo's sum, which is commutative). A rank can only write this
parity's slot again two calls later, when every rank has published the call in between, which it
does only after it finished reading this one. Stores become visible in program order on x86-64
(total store order); elsewhere this path is off and gloo serves.
"""

from __future__ import annotations

import os
import platform
import time

import torch

from ..._errors import DistributedError

__all__ = ["SharedSegment", "shared_memory_enabled"]

LINE = 64  # bytes: each rank's flags on a cache line of their own
CAPACITY = 1 << 20  # bytes per slot: larger all-reduces go to gloo (its bandwidth, not its latency)


def shared_memory_enabled() -> bool:
    """Whether this process may use the shared-memory path: x86-64 (its store order), a /dev/shm,
    and FNZERO_GLOO_SHM not 0."""
    return (platform.machine().lower() in ("x86_64", "amd64") and os.path.isdir("/dev/shm")
            and os.environ.get("FNZERO_GLOO_SHM", "1") != "0")


class SharedSegment:
    """One group's segment, mapped on this rank: `start(t)` publishes this rank's part of a call,
    whose `wait()` is the sum (or the concatenation) once every rank has published."""

    def __init__(self, segment: torch.Tensor, rank: int, world_size: int, capacity: int = CAPACITY,
                 timeout_s: float = 1800.0):
        self.rank, self.world_size, self.capacity = rank, world_size, capacity
        self.timeout_s = timeout_s  # a rank not there after this long is named (a dead one within ~1 s)
        flags = segment[: LINE * world_size].view(torch.int64).view(world_size, LINE // 8)
        self.count, self.pids = flags[:, 0], flags[:, 1]
        self.slots = segment[LINE * world_size:].view(2, world_size, capacity)
        self.calls = 0  # this rank's calls through the segment
        self.pids[rank] = os.getpid()

    @staticmethod
    def segment_bytes(world_size: int, capacity: int = CAPACITY) -> int:
        return LINE * world_size + 2 * world_size * capacity

    @classmethod
    def open(cls, comm, capacity: int = CAPACITY) -> "SharedSegment | None":
        """The group's segment, made by every rank of `comm` (a collective over its gloo group); None
        on every rank when some rank cannot map it (another host, another /dev/shm, the path off)."""
        ok = shared_memory_enabled()
        token = int.from_bytes(os.urandom(6), "little") if comm.rank == 0 else 0
        agreed = comm._gloo_all_reduce(torch.tensor([token, 0 if ok else 1], dtype=torch.int64))
        token, unable = int(agreed[0]), int(agreed[1])
        if unable:
            return None
        path = os.path.join("/dev/shm", f"fnzero-shm-{token:x}-{comm.world_size}")
        size = cls.segment_bytes(comm.world_size, capacity)
        segment = None
        try:  # every rank maps the same file (created by whichever comes first), then rank 0 writes a mark
            segment = torch.from_file(path, shared=True, size=size, dtype=torch.uint8)
        except (OSError, RuntimeError):
            pass
        mark = token & 0x7FFFFFFF
        if segment is not None and comm.rank == 0:
            segment[:LINE].view(torch.int64)[2] = mark  # rank 0's line, past its count and pid
        comm._gloo_all_reduce(torch.zeros(1, dtype=torch.int64))  # everyone mapped; the mark is written
        sees = segment is not None and int(segment[:LINE].view(torch.int64)[2]) == mark
        every = int(comm._gloo_all_reduce(torch.tensor([0 if sees else 1], dtype=torch.int64))[0]) == 0
        if comm.rank == 0:
            try:
                os.unlink(path)  # the mappings stay; nothing is left in /dev/shm, even after a crash
            except OSError:
                pass
        return cls(segment, comm.rank, comm.world_size, capacity) if every else None

    def start(self, t: torch.Tensor, gather: bool = False) -> "_Published":
        """Publish `t` for call number `calls + 1`; the result's `wait()` sums every rank's, added in
        rank order (with `gather`, concatenates them in rank order, flat). One call in flight at a
        time: wait it before the next `start`."""
        self.calls += 1
        seq, parity = self.calls, self.calls & 1
        n = t.numel() * t.element_size()
        self.slots[parity, self.rank, :n].view(t.dtype).copy_(t.reshape(-1))
        self.count[self.rank] = seq  # published after the data (x86-64's store order)
        return _Published(self, seq, [self.slots[parity, r, :n].view(t.dtype) for r in range(self.world_size)],
                          None if gather else t.shape)

    def _wait(self, seq: int) -> None:
        """Until every rank has published call `seq`: spin, then yield the core, then sleep; a rank
        whose process is gone, or that is not there within `timeout_s`, is named."""
        spins, start, checked = 0, None, 0.0
        while int(self.count.min()) < seq:
            spins += 1
            if spins < 2000:
                continue
            now = time.monotonic()
            if start is None:
                start = checked = now
            if now - start < 0.002:
                os.sched_yield()
                continue
            time.sleep(5e-5 if now - start < 0.1 else 1e-3)
            if now - checked > min(1.0, self.timeout_s):
                checked = now
                self._check_peers(seq, now - start)

    def _check_peers(self, seq: int, waited: float) -> None:
        late = [r for r in range(self.world_size) if int(self.count[r]) < seq]
        for r in late:
            pid = int(self.pids[r])
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                raise DistributedError(
                    f"shared-memory all_reduce #{seq}: rank {r} (pid {pid}) exited before it arrived; it failed "
                    "first, see its own error", ranks=[r]) from None
            except PermissionError:
                pass
        if waited > self.timeout_s:
            raise DistributedError(f"shared-memory all_reduce #{seq}: rank(s) {late} did not arrive within "
                                   f"{self.timeout_s:.0f} s", ranks=late)


class _Published:
    """A call published by this rank: `wait()` is its sum (or, `shape` None, the concatenation), once
    every rank has published it."""

    __slots__ = ("_shm", "_seq", "_parts", "_shape")

    def __init__(self, shm: SharedSegment, seq: int, parts: list, shape):
        self._shm, self._seq, self._parts, self._shape = shm, seq, parts, shape

    def wait(self) -> torch.Tensor:
        self._shm._wait(self._seq)
        parts = self._parts
        if self._shape is None:
            return torch.cat(parts)
        result = parts[0] + parts[1] if len(parts) > 1 else parts[0].clone()
        for p in parts[2:]:
            result.add_(p)
        return result.view(self._shape)
