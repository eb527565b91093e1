"""ZeRO-Infinity optimizer state in files: one rank's fp32 master shards and optimizer moments on an
NVMe drive, streamed through a few bounded buffers `sub_group_size` elements at a time (`specs/offload.md`
§NVMe store). The files are scratch; their format, the lock and `stale_stores`: `_nvme_files.py`."""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import socket
import uuid
from typing import Any, Callable

import torch

from .. import _ext
from ._nvme_files import (
    _ELEM, _HDR, _PAGE_ELEMS, FORMAT, HEADER, PREFIX, VERSION, NvmeStoreError, _round_up, check_header,
    Updates, check_unit_tensors, checked_create_args, chunk_span, check_file, flat_cpu, pack_header, read_manifest,
    stale_stores, take_lock,
)

__all__ = ["NvmeOptimizerStore", "NvmeStoreError", "OPTIMIZERS", "stale_stores"]

# optimizer -> (kernel, its state buffers besides the master, in the kernel's argument order).
# Names follow fnzero.optim's AdamState / AdagradState / LionState. `create(kernel=, kinds=)`
# streams any other elementwise update (`_nvme_optimizer.py`: an `Optimizer`'s, a sub-group at a time).
OPTIMIZERS: dict[str, tuple[Callable[..., None], tuple[str, ...]]] = {
    "adam": (_ext.adam_step_, ("exp_avg", "exp_avg_sq")),
    "adagrad": (_ext.adagrad_step_, ("sum",)),
    "lion": (_ext.lion_step_, ("exp_avg",)),
}
_TAKES_STEP = {"adam", "adagrad"}  # lion's update does not depend on the step count
# Elements per streamed chunk at most (16 MiB of fp32 per kind; a multiple of 1024, so transfers
# stay O_DIRECT): DeepSpeed's default sub_group_size of 1e9 would stage whole units otherwise.
MAX_CHUNK = 1 << 22

class NvmeOptimizerStore(Updates, contextlib.AbstractContextManager):
    """Per-rank, file-backed optimizer state over flat fp32 shards (one per unit): `create` makes new
    scratch files, `open` inspects files left behind (read-only). Not thread-safe; one per directory."""

    # -- construction -------------------------------------------------------------------------
    def __init__(self, path: str, manifest: dict, *, writable: bool, buffer_count: int = 4, aio: Any = None,
                 use_cext: bool | None = None, kernel: Callable[..., None] | None = None):  # fmt: skip
        self.path = path
        self._manifest = manifest
        self.optimizer: str = manifest["optimizer"]
        named = OPTIMIZERS.get(self.optimizer, (None, ()))
        self._kernel = kernel if kernel is not None else named[0]  # None: a caller's kernel, opened to read
        self.kinds: tuple[str, ...] = ("master", *manifest.get("kinds", named[1]))
        self._units: dict[str, tuple[int, int]] = {name: (numel, off) for name, numel, off in manifest["units"]}
        self.sub_group_size: int = manifest["sub_group_size"]
        self.buffer_count = buffer_count
        self._writable, self._use_cext = writable, use_cext
        self._bufs: list[dict[str, torch.Tensor]] | None = None
        self._gbuf: torch.Tensor | None = None
        self._lock_fd = -1
        self._handles: dict[str, _ext.AioHandle] = {}
        self._ino: dict[str, tuple[int, int]] = {}
        self._engine = _ext.AioEngine.from_config(aio or {}, use_cext=use_cext)

    @classmethod
    def create(cls, directory: str | os.PathLike, master: dict[str, torch.Tensor], *, optimizer: str = "adam",
               sub_group_size: int = 10**9, buffer_count: int = 4, aio: Any = None, rank: int = 0,
               use_cext: bool | None = None, kernel: Callable[..., None] | None = None,
               kinds: tuple[str, ...] = ()) -> NvmeOptimizerStore:  # fmt: skip
        """New scratch files under `directory`/fnzero-rank{rank}-{uuid}/ holding a copy of `master`
        (fp32, flattened) and zero optimizer state; fsynced on return, so the caller may drop
        `master`. `aio`: DeepSpeed's aio block (mapping or object). `use_cext`: None = C kernels and
        I/O when built, False = the fallbacks. `kernel` and `kinds`: a caller's elementwise update and
        its state kinds, `optimizer` then a label (`specs/offload.md` §NVMe store)."""
        aio, flat = checked_create_args(master, optimizer, sorted(OPTIMIZERS), sub_group_size, buffer_count, rank, aio,
                                        kernel, kinds)
        kinds = tuple(kinds) if kernel is not None else OPTIMIZERS[optimizer][1]
        units, off = [], HEADER
        for name, t in flat.items():  # each unit starts on an aligned block, so whole-chunk I/O can be O_DIRECT
            units.append([name, t.numel(), off])
            off += _round_up(t.numel() * _ELEM, _ext.ALIGN)
        os.makedirs(directory, exist_ok=True)
        store_id = uuid.uuid4()
        path = os.path.join(os.fspath(directory), f"{PREFIX}{rank}-{store_id.hex}")
        os.mkdir(path, 0o700)  # new every time: nothing of an earlier run is ever opened
        manifest = {"format": FORMAT, "version": VERSION, "uuid": store_id.hex, "rank": rank, "optimizer": optimizer,
                    "kinds": list(kinds), "sub_group_size": sub_group_size, "units": units, "file_bytes": off,
                    "state": "creating", "step": None, "pid": os.getpid(), "host": socket.gethostname()}  # fmt: skip
        self = cls(path, manifest, writable=True, buffer_count=buffer_count, aio=aio, use_cext=use_cext, kernel=kernel)
        try:
            self._lock_fd = take_lock(self.path)
            self._save_manifest(fsync=False)
            header = _ext.aligned_empty(HEADER, torch.uint8)
            for kind in self.kinds:
                h = self._open_file(kind, "w")
                h.preallocate(off)  # before any data: extending O_DIRECT writes are ~8x slower on ext4
                # fallocate'd (or sparse) blocks read as zeros: the moments start at zero unwritten.
                header.zero_()[: _HDR.size].copy_(torch.frombuffer(bytearray(self._header(kind)), dtype=torch.uint8))
                h.pwrite(header, 0)
            reqs = [self._handles["master"].submit_write(t, self._units[name][1]) for name, t in flat.items() if t.numel()]
            for r in reqs:
                r.wait()
            for h in self._handles.values():
                h.sync()
            self._save_manifest("clean", fsync=True)
            _ext.fsync_dir(path)
        except BaseException:
            self.close(delete=True)
            raise
        return self

    @classmethod
    def open(cls, path: str | os.PathLike, *, allow_interrupted: bool = False, aio: Any = None,
             use_cext: bool | None = None) -> NvmeOptimizerStore:  # fmt: skip
        """A store's directory, read-only, for inspection (`read` works, `step` and `write` do not).
        Refuses (NvmeStoreError naming the path) files missing, truncated, of another store, or left
        part-way through `create`, a step or a write; `allow_interrupted` opens the last two anyway."""
        path = os.fspath(path)
        manifest = read_manifest(path)
        state = manifest["state"]
        if state == "creating":
            raise NvmeStoreError(errno.EIO, "the store's create was interrupted: its files are incomplete", path)
        if state != "clean" and not allow_interrupted:
            raise NvmeStoreError(errno.EIO, f"the store was interrupted during {state} (step {manifest['step']}): its "
                                            "files mix old and new values", path)  # fmt: skip
        self = cls(path, manifest, writable=False, aio=aio, use_cext=use_cext)
        try:
            for kind in self.kinds:
                check_header(self._open_file(kind, "r"), self._file(kind), manifest["file_bytes"], self._header(kind))
        except BaseException:
            self.close(delete=False)
            raise
        return self

    # -- what is stored -----------------------------------------------------------------------
    @property
    def units(self) -> dict[str, int]:
        """unit name -> number of elements."""
        return {name: numel for name, (numel, _) in self._units.items()}

    @property
    def bytes_on_disk(self) -> int:
        """Bytes of the state files (headers and alignment padding included)."""
        return len(self.kinds) * self._manifest["file_bytes"]

    @property
    def last_step(self) -> int | None:
        """The `step` of the last completed `step` call (None before the first)."""
        return self._manifest["step"]

    def __repr__(self) -> str:
        return (f"NvmeOptimizerStore({self.path!r}, optimizer={self.optimizer!r}, units={len(self._units)}, "
                f"sub_group_size={self.sub_group_size}, buffer_count={self.buffer_count})")  # fmt: skip

    # -- the update ---------------------------------------------------------------------------
    def step(self, grads: dict[str, torch.Tensor], *, step: int, out: dict[str, torch.Tensor] | None = None,
             grad_scale: float = 1.0, num_threads: int | None = None, **hyper: Any) -> None:  # fmt: skip
        """One optimizer step over every unit, streamed through the files in chunks; bit for bit the
        in-memory kernel on whole shards. `grads[unit]`: the unit's gradient (CPU, contiguous, any
        float dtype), times `grad_scale`. `step`: counted from 1. `hyper`: the kernel's keywords
        (`specs/offload.md` §NVMe store). `out[unit]` (any subset) receives the new parameters."""
        self._check_usable("step", write=True)
        grads = self._check_tensors("grads", grads, (torch.float32, torch.bfloat16, torch.float16, torch.float64))
        outs = self._check_tensors("out", out, (torch.float32, torch.bfloat16, torch.float16), subset=True) if out is not None else {}
        kw = dict(hyper, grad_scale=grad_scale, num_threads=num_threads, use_cext=self._use_cext)
        if self.optimizer in _TAKES_STEP:
            kw["step"] = step
        elif isinstance(step, bool) or not isinstance(step, int) or step < 1:
            raise ValueError(f"NvmeOptimizerStore.step: step must be an integer >= 1, got {step!r}")
        empty = torch.empty(0)
        self._kernel(*[empty] * (len(self.kinds) + 1), **kw)  # bad keywords fail here, before any file changes
        self._check_files()
        with self.updating("step", step):
            self._pipeline(grads, outs, kw)
            self._manifest["step"] = int(step)

    @property
    def chunk_elems(self) -> int:
        """Elements per chunk a step streams: `sub_group_size`, at most `MAX_CHUNK` (the staging is
        then bounded by the chunk, not by the largest unit; results do not depend on the chunking)."""
        return min(self.sub_group_size, MAX_CHUNK)

    def _pipeline(self, grads: dict[str, torch.Tensor], outs: dict[str, torch.Tensor], kw: dict) -> None:
        """Chunk i lives in slot i % B from its read until its write completes, so at most B chunks
        are held: while chunk i computes, the reads of up to B-2 (B-1 once i-1's write lands) later
        chunks and the write of chunk i-1 are in flight."""
        sg, nb = self.chunk_elems, self.buffer_count
        chunks = [(name, s, min(sg, numel - s)) for name, (numel, _) in self._units.items() for s in range(0, numel, sg)]
        if not chunks:
            return
        bufs = self._buffers()
        reading: list[list[_ext.AioRequest]] = [[] for _ in range(nb)]
        writing: list[list[_ext.AioRequest]] = [[] for _ in range(nb)]
        next_read = 0

        def top_up(limit: int, block: bool) -> None:
            nonlocal next_read
            while next_read < min(limit, len(chunks)):
                slot = next_read % nb
                if not block and not all(r.done() for r in writing[slot]):
                    return  # the slot's previous chunk is still being written; do not stall the compute
                for r in writing[slot]:
                    r.wait()
                off, n = self._span(*chunks[next_read])
                reading[slot] = [self._handles[k].submit_read(bufs[slot][k][:n], off) for k in self.kinds]
                next_read, block = next_read + 1, False

        try:
            for i, (name, start, n) in enumerate(chunks):
                slot = i % nb
                top_up(i + 1, block=True)
                for r in reading[slot]:
                    r.wait()
                top_up(i + nb, block=False)
                state = [bufs[slot][k][:n] for k in self.kinds]
                g = grads[name][start : start + n]
                if g.dtype != torch.float32:
                    g = self._gbuf[:n].copy_(g)  # type: ignore[index]
                o = outs[name][start : start + n] if name in outs else None
                self._kernel(state[0], g, *state[1:], out16=o if o is not None and o.dtype != torch.float32 else None, **kw)
                if o is not None and o.dtype == torch.float32:
                    o.copy_(state[0])
                off, nio = self._span(name, start, n)
                writing[slot] = [self._handles[k].submit_write(bufs[slot][k][:nio], off) for k in self.kinds]
                top_up(i + nb, block=False)
        finally:  # never return while the I/O threads still use the buffers (also on errors)
            self._drain()

    def _span(self, name: str, start: int, n: int) -> tuple[int, int]:
        return chunk_span(*self._units[name], start, n)

    def _buffers(self) -> list[dict[str, torch.Tensor]]:
        # Kept between steps (like DeepSpeed's pinned swap buffers): B x cap x 4 bytes per state kind.
        if self._bufs is None:
            biggest = max((numel for numel, _ in self._units.values()), default=0)
            cap = _round_up(max(1, min(self.chunk_elems, biggest)), _PAGE_ELEMS)
            self._bufs = [{k: _ext.aligned_empty(cap) for k in self.kinds} for _ in range(self.buffer_count)]
            self._gbuf = torch.empty(cap, dtype=torch.float32)
        return self._bufs

    def release_buffers(self) -> None:
        """Free the staging buffers (the next `step` allocates them again)."""
        self._bufs = self._gbuf = None

    # -- whole-unit access (checkpoints, gathers) ---------------------------------------------
    def read(self, unit: str, which: str = "master", out: torch.Tensor | None = None) -> torch.Tensor:
        """The unit's `which` ("master" or a state name in `kinds`) as a new flat fp32 tensor, or into `out`."""
        self._check_usable("read", write=False)
        numel, off = self._where(unit, which)
        if out is None:
            out = torch.empty(numel, dtype=torch.float32)
        elif not isinstance(out, torch.Tensor) or out.dtype != torch.float32 or out.numel() != numel:
            raise ValueError(f"NvmeOptimizerStore.read: out must be a float32 tensor of {numel} elements")
        self._check_files()
        if numel:
            self._handles[which].pread(flat_cpu(unit, "out", out), off)
        return out

    def write(self, unit: str, which: str, value: torch.Tensor, start: int | None = None) -> None:
        """Replace the unit's `which` with `value` (any float dtype and shape, `numel` elements), or,
        with `start`, its `value.numel()` elements from element `start` on."""
        self._check_usable("write", write=True)
        numel, off = self._where(unit, which)
        ok = isinstance(value, torch.Tensor) and value.is_floating_point()
        if not ok or (value.numel() != numel if start is None else start < 0 or start + value.numel() > numel):
            want = f"{numel} elements" if start is None else f"at most {numel} - start elements"
            raise ValueError(f"NvmeOptimizerStore.write: value must be a float tensor of {want}")
        off += (start or 0) * _ELEM
        value = value.detach().to("cpu", torch.float32).contiguous().reshape(-1)
        self._check_files()
        with self.updating("write", self._manifest["step"]):
            try:
                if value.numel():
                    self._handles[which].pwrite(value, off)
            finally:
                self._drain()

    def set_step(self, step: int) -> None:
        """Record that the files now hold the state after `step` steps (after `write`s that
        restored a checkpoint), so the next `step` call is `step + 1`."""
        self._check_usable("set_step", write=True)
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"NvmeOptimizerStore.set_step: step must be an integer >= 0, got {step!r}")
        self._manifest["step"] = step if step > 0 else None
        self._save_manifest("clean", fsync=True)

    # -- consistency (`updating`, `refuse_if_broken`: `Updates`) -----------------------------------
    def _check_usable(self, what: str, write: bool) -> None:
        if not self._handles:
            raise ValueError(f"NvmeOptimizerStore.{what}: the store at {self.path} is closed")
        if write and not self._writable:
            raise ValueError(f"NvmeOptimizerStore.{what}: {self.path} was opened read-only (open() is for inspection)")
        self.refuse_if_broken()

    def _check_files(self) -> None:
        """Each file still there, the one opened, and long enough (`check_file`)."""
        for kind in self.kinds:
            check_file(self._file(kind), self._ino[kind], self._manifest["file_bytes"])

    def _header(self, kind: str) -> bytes:
        return pack_header(self._manifest, sum(numel for numel, _ in self._units.values()), kind)

    def _where(self, unit: str, which: str) -> tuple[int, int]:
        if which not in self.kinds:
            raise ValueError(f"NvmeOptimizerStore: {self.optimizer} keeps {list(self.kinds)}, not {which!r}")
        if unit not in self._units:
            raise KeyError(f"NvmeOptimizerStore: no unit {unit!r} (units: {list(self._units)[:8]}...)")
        return self._units[unit]

    def _check_tensors(self, what: str, tensors: Any, dtypes: tuple, subset: bool = False) -> dict[str, torch.Tensor]:
        return check_unit_tensors({k: numel for k, (numel, _) in self._units.items()}, what, tensors, dtypes, subset)

    # -- files and lifetime -------------------------------------------------------------------
    def _file(self, kind: str) -> str:
        return os.path.join(self.path, f"{kind}.bin")

    def _open_file(self, kind: str, mode: str) -> _ext.AioHandle:
        p = self._file(kind)
        try:
            h = _ext.AioHandle(p, mode, engine=self._engine)
        except FileNotFoundError:
            raise NvmeStoreError(errno.ENOENT, "store file is missing", p) from None
        self._handles[kind] = h
        st = os.stat(p)
        self._ino[kind] = (st.st_dev, st.st_ino)
        return h

    def _drain(self) -> None:
        _ext.wait_every([h.wait_all for h in self._handles.values()])

    def close(self, delete: bool = True) -> None:
        """Wait for outstanding I/O, close the files; `delete` removes the store's directory
        (only a writable store's: `open` never deletes). Idempotent."""
        try:
            for h in self._handles.values():
                h.close()
        finally:
            self._handles = {}
            self._engine.close()
            self.release_buffers()
            if self._lock_fd >= 0:
                os.close(self._lock_fd)
                self._lock_fd = -1
            if delete and self._writable:
                shutil.rmtree(self.path, ignore_errors=True)

    def __exit__(self, *exc: object) -> None:
        self.close()
