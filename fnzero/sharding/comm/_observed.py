"""Collectives wrappers for observing a run: `RecordingCollectives` counts every call's logical
bytes and times it (the comms logger, traffic tests; `specs/collectives.md` §Comms logger timings),
`CheckedCollectives` compares each call across ranks
before making it (`FNZERO_DEBUG_COLLECTIVES=1`, `shard(..., debug_collectives=True)`)."""

from __future__ import annotations

import dataclasses
import threading
import time
import zlib

import torch

from ..._errors import DistributedError
from ._all_to_all import check_agreement, resolve_splits, sent_numel
from ._collectives import Collectives, PendingTensor, waited_all_to_all
from ._comms_summary import bus_factor, comms_summary, format_comms_summary

__all__ = ["CollectiveRecord", "RecordingCollectives", "CheckedCollectives", "checksum"]


@dataclasses.dataclass(frozen=True)
class CollectiveRecord:
    """One collective call as seen by this rank: its name, dtype and logical bytes (input side),
    and `seconds`, the time from its start until its result was ready here (None until then: an
    async call's `wait()` has not returned yet)."""

    op: str
    dtype: torch.dtype
    numel: int
    bytes: int
    # Filled once, when the call completes; outside equality so that records compare by what moved.
    _elapsed: list = dataclasses.field(default_factory=list, compare=False, repr=False)

    @property
    def seconds(self) -> float | None:
        return self._elapsed[0] if self._elapsed else None


def _settle(t: torch.Tensor) -> None:
    """On an accelerator a returned (or waited-for) result may still be in flight on the stream:
    wait for the device, so that the time covers the transfer. Host tensors are done already."""
    if t.device.type != "cpu":
        torch.accelerator.synchronize(t.device)


class _TimedPending:
    """An async call's pending result: its record's time is taken when `wait()` first returns."""

    __slots__ = ("_pending", "_rec", "_t0")

    def __init__(self, pending, rec: CollectiveRecord, t0: float):
        self._pending, self._rec, self._t0 = pending, rec, t0

    def wait(self):
        out = self._pending.wait()
        if not self._rec._elapsed:
            if isinstance(out, torch.Tensor):
                _settle(out)
            self._rec._elapsed.append(time.perf_counter() - self._t0)
        return out


def _recorded(method: str, count=lambda self, t: t.numel()):
    """`RecordingCollectives`' `method`: `inner`'s, recorded as `count(self, t)` logical elements and timed."""
    op = "send" if method == "send_async" else method.removesuffix("_async")

    def call(self, t, *args, **kwargs):
        timed = self._timed_async if method.endswith("_async") else self._timed
        return timed(op, t, count(self, t), getattr(self.inner, method), t, *args, **kwargs)

    call.__name__ = call.__qualname__ = method
    return call


class RecordingCollectives:
    """Wraps another `Collectives` and records every call's logical bytes (`specs/collectives.md`
    §Traffic): the comms logger and traffic tests use it."""

    def __init__(self, inner: Collectives):
        self.inner = inner
        self.rank = inner.rank
        self.world_size = inner.world_size
        self.records: list[CollectiveRecord] = []
        self._lock = threading.Lock()
        # Optional callback: the debug checker uses it to compare call sequences across ranks.
        self.on_record = None

    def _record(self, op: str, t: torch.Tensor, numel: int) -> CollectiveRecord:
        rec = CollectiveRecord(op, t.dtype, numel, numel * t.element_size())
        with self._lock:
            self.records.append(rec)
        if self.on_record is not None:
            self.on_record(rec)
        return rec

    def _timed_async(self, op: str, t: torch.Tensor, numel: int, call, *args, **kwargs) -> _TimedPending:
        """An async call, recorded; timed from its start until its `wait()` returns."""
        rec = self._record(op, t, numel)
        _settle(t)  # work queued before the call is not the collective's time
        t0 = time.perf_counter()
        return _TimedPending(call(*args, **kwargs), rec, t0)

    def _timed(self, op: str, t: torch.Tensor, numel: int, call, *args, **kwargs):
        """A blocking call, recorded and timed from its start until its result is ready."""
        return self._timed_async(op, t, numel, lambda: PendingTensor(call(*args, **kwargs))).wait()

    all_gather = _recorded("all_gather", lambda self, t: t.numel() * self.world_size)
    all_gather_async = _recorded("all_gather_async", lambda self, t: t.numel() * self.world_size)
    reduce_scatter = _recorded("reduce_scatter")
    reduce_scatter_async = _recorded("reduce_scatter_async")
    all_reduce = _recorded("all_reduce")
    all_reduce_async = _recorded("all_reduce_async")
    broadcast = _recorded("broadcast")
    send_async = _recorded("send_async")

    def barrier(self):
        return self.inner.barrier()

    all_to_all = waited_all_to_all

    def all_to_all_async(self, tensor, *, input_split_sizes=None, output_split_sizes=None, label: str = ""):
        # Sizes resolved here, so that learning the output sizes is itself a recorded all-to-all.
        ins, outs = resolve_splits(self, tensor, input_split_sizes, output_split_sizes)
        return self._timed_async("all_to_all", tensor, sent_numel(tensor, ins, self.rank), self.inner.all_to_all_async,
                                 tensor, input_split_sizes=ins, output_split_sizes=outs, label=label)

    def recv(self, out, src: int, label: str = "", tag: int = 0):
        return self.inner.recv(out, src, label=label, tag=tag)  # the bytes are counted once, by the sender

    def reset(self) -> list[CollectiveRecord]:
        with self._lock:
            out, self.records = self.records, []
        return out

    def summary(self, records=None) -> list:
        """The comms logger's table: per collective kind and message size, count, bytes, time and
        bandwidths (`CommsRow`s; `specs/collectives.md` §Comms logger timings)."""
        return comms_summary(self.records if records is None else records, self.world_size)

    def log_summary(self, records=None, file=None) -> str:
        """`summary()` in DeepSpeed's `log_summary` layout, printed to `file` (stdout) and returned."""
        text = format_comms_summary(self.summary(records))
        print(text, file=file, flush=True)
        return text

    def ring_bytes_sent(self, records=None) -> float:
        """Ring-equivalent bytes this rank sends for `records` (default: all recorded so far)."""
        records = self.records if records is None else records
        return sum((r.bytes * bus_factor(r.op, self.world_size) for r in records), 0.0)


def _checked(method: str):
    """`CheckedCollectives`' `method`: `inner`'s, called once every rank has shown the same call."""

    def call(self, *args, **kwargs):
        self._check(method.removesuffix("_async"), args[0] if args else None)
        return getattr(self.inner, method)(*args, **kwargs)

    call.__name__ = call.__qualname__ = method
    return call


class CheckedCollectives:
    """Debug wrapper: before each collective, every rank shares a fingerprint of the call it is
    about to make (op, dtype, element count, call index); a mismatch raises on every rank, naming
    the first divergent call and what each rank issued, instead of a hang or silent garbage.
    Costs one small all-gather per collective: for debugging, not for production runs."""

    _OPS = {"all_gather": 1, "reduce_scatter": 2, "all_reduce": 3, "broadcast": 4, "barrier": 5, "all_to_all": 6}
    # Point-to-point messages are checked pairwise: each carries a fingerprint (the pair's message
    # index, element count, dtype) that the receiver compares with what it expects.

    def __init__(self, inner: Collectives):
        self.inner = inner
        self.rank = inner.rank
        self.world_size = inner.world_size
        self.calls = 0
        self.p2p_calls: dict[tuple, int] = {}

    def _check(self, op: str, t: torch.Tensor | None, numel: int | None = None) -> None:
        dtype_code = _dtype_code(t.dtype) if t is not None else 0
        numel = (t.numel() if t is not None else 0) if numel is None else numel
        mine = torch.tensor([self.calls, self._OPS[op], dtype_code, numel], dtype=torch.int64)
        if t is not None and t.device.type != "cpu":
            mine = mine.to(t.device)
        everyone = self.inner.all_gather(mine).cpu().view(self.world_size, 4)
        self.calls += 1
        if not bool((everyone == everyone[0]).all()):
            names = {v: k for k, v in self._OPS.items()}
            desc = [f"rank {r}: {names.get(int(row[1]), '?')} of {int(row[3])} elements"
                    + ("" if int(row[2]) == int(everyone[0][2]) else " of another dtype than rank 0's")
                    for r, row in enumerate(everyone)]
            raise DistributedError(
                f"ranks diverged at collective #{self.calls - 1} (this is rank {self.rank}): " + "; ".join(desc)
            )

    all_gather = _checked("all_gather")
    all_gather_async = _checked("all_gather_async")
    reduce_scatter = _checked("reduce_scatter")
    reduce_scatter_async = _checked("reduce_scatter_async")
    all_reduce = _checked("all_reduce")
    all_reduce_async = _checked("all_reduce_async")
    broadcast = _checked("broadcast")
    barrier = _checked("barrier")

    all_to_all = waited_all_to_all

    def all_to_all_async(self, tensor, *, input_split_sizes=None, output_split_sizes=None, label: str = ""):
        # The fingerprint's element count is a row's (chunks differ in rows, never in row shape);
        # then every rank's split sizes are compared: a rank sending rows its peer does not expect
        # would hang the exchange or fill it with garbage.
        ins, outs = resolve_splits(self, tensor, input_split_sizes, output_split_sizes)
        self._check("all_to_all", tensor, numel=tensor.shape[1:].numel())
        n = self.world_size
        sizes = self.inner.all_gather(torch.tensor(ins + outs, dtype=torch.int64, device=tensor.device))
        check_agreement([(None, None, s[:n], s[n:]) for s in sizes.cpu().view(n, 2 * n).tolist()])
        return self.inner.all_to_all_async(tensor, input_split_sizes=ins, output_split_sizes=outs, label=label)

    def _fingerprint(self, peer: tuple, t: torch.Tensor) -> torch.Tensor:
        seq = self.p2p_calls.get(peer, 0)
        self.p2p_calls[peer] = seq + 1
        return torch.tensor([seq, t.numel(), _dtype_code(t.dtype)], dtype=torch.int64, device=t.device)

    def send_async(self, t, dst: int, label: str = "", tag: int = 0):
        self.inner.send_async(self._fingerprint(("to", dst, tag), t), dst, tag=tag).wait()
        return self.inner.send_async(t, dst, label=label, tag=tag)

    def recv(self, out, src: int, label: str = "", tag: int = 0):
        mine = self._fingerprint(("from", src, tag), out)
        theirs = self.inner.recv(torch.empty_like(mine), src, tag=tag)
        if not bool((theirs == mine).all()):
            raise DistributedError(
                f"rank {self.rank} expected message #{int(mine[0])} from rank {src} of {int(mine[1])} elements "
                f"({out.dtype}); rank {src} sent message #{int(theirs[0])} of {int(theirs[1])} elements"
                + ("" if int(theirs[2]) == int(mine[2]) else " of another dtype"))
        return self.inner.recv(out, src, label=label, tag=tag)


_CHECKSUM_CHUNK = 1 << 22


def _dtype_code(dtype: torch.dtype) -> int:
    """The same number for a dtype in every process: Python's `hash` of a string is salted per
    process (PYTHONHASHSEED), so ranks started apart would see every dtype differ."""
    return zlib.crc32(str(dtype).encode())


def checksum(flat: torch.Tensor) -> torch.Tensor:
    """Two int64 numbers that differ, in practice, when two buffers differ by any bit: the sum of
    the buffer's 32-bit words, and the sum of each word times its position (so a permutation
    counts too), both wrapping. Integer sums do not depend on the reduction order, so equal
    buffers give equal checksums on any thread count or device."""
    raw = flat.detach().reshape(-1).view(torch.uint8)
    pad = (-raw.numel()) % 4
    if pad:
        raw = torch.cat([raw, raw.new_zeros(pad)])
    words = raw.view(torch.int32)
    total = torch.zeros(2, dtype=torch.int64, device=flat.device)
    for lo in range(0, words.numel(), _CHECKSUM_CHUNK):
        w = words[lo : lo + _CHECKSUM_CHUNK].to(torch.int64)
        pos = torch.arange(lo + 1, lo + 1 + w.numel(), dtype=torch.int64, device=flat.device)
        total += torch.stack([w.sum(), (w * pos).sum()])
    return total
