"""Asynchronous file I/O for NVMe offload: thin, checked wrappers over cext/aio.h.

Without the extension the same classes run synchronous ``os.preadv``/``os.pwrite`` (a request
is complete when submitted), so callers never need two code paths.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import math
import os
import weakref
from typing import Any

import torch

from . import _lib

__all__ = ["ALIGN", "AioEngine", "AioHandle", "AioRequest", "aligned_empty", "is_aligned", "direct_supported"]

ALIGN = 4096  # FNZ_AIO_ALIGN: O_DIRECT needs buffer, offset and length aligned to this


def aligned_empty(shape: int | tuple[int, ...], dtype: torch.dtype = torch.float32, alignment: int = ALIGN) -> torch.Tensor:
    """An uninitialised tensor whose data_ptr is a multiple of `alignment` (for O_DIRECT): a view
    into a slightly larger byte buffer torch owns, so it is freed normally."""
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    raw = torch.empty(nbytes + alignment, dtype=torch.uint8)
    start = (-raw.data_ptr()) % alignment
    t = raw[start : start + nbytes].view(dtype).view(shape)
    assert t.data_ptr() % alignment == 0
    return t


def wait_every(waits) -> None:
    """Call every one of `waits` (each waits for some I/O), even past a failure; then raise the
    first `OSError`."""
    first: OSError | None = None
    for wait in waits:
        try:
            wait()
        except OSError as e:
            first = first or e
    if first is not None:
        raise first


def is_aligned(t: torch.Tensor, alignment: int = ALIGN) -> bool:
    return t.data_ptr() % alignment == 0


def direct_supported(directory: str | os.PathLike) -> bool | None:
    """Whether O_DIRECT works in `directory`; None when the extension is absent (never used then)."""
    if not _lib.available():
        return None
    rc = _lib.lib.fnz_aio_direct_supported(os.fsencode(directory))
    if rc < 0:
        raise OSError(-rc, os.strerror(-rc), os.fspath(directory))
    return bool(rc)


def _buffer(t: torch.Tensor, what: str) -> tuple[int, int]:
    if not isinstance(t, torch.Tensor) or t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError(f"{what}: the buffer must be a contiguous CPU tensor")
    return t.data_ptr(), t.numel() * t.element_size()


def _sync_io(fd: int, write: bool, ptr: int, nbytes: int, offset: int) -> int:
    """The fallback: all of it, looping over short transfers; a read stops at end of file."""
    if nbytes == 0:
        return 0
    view = memoryview((ctypes.c_char * nbytes).from_address(ptr)).cast("B")
    done = 0
    while done < nbytes:
        r = os.pwrite(fd, view[done:], offset + done) if write else os.preadv(fd, [view[done:]], offset + done)
        if r == 0:
            break
        done += r
    return done


class AioEngine(contextlib.AbstractContextManager):
    """The I/O workers (thread_count * queue_depth threads, block_size chunks), shareable by files;
    parameters are DeepSpeed's ``aio`` block, which ``from_config`` takes (mapping or object)."""

    def __init__(self, block_size: int = 1 << 20, queue_depth: int = 8, thread_count: int = 1, *, use_cext: bool | None = None):
        for name, v in (("block_size", block_size), ("queue_depth", queue_depth), ("thread_count", thread_count)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"AioEngine: {name} must be a positive integer, got {v!r}")
        self.block_size, self.queue_depth, self.thread_count = block_size, queue_depth, thread_count
        if use_cext and not _lib.available():
            raise ValueError(f"AioEngine(use_cext=True): the C extension is unavailable: {_lib.reason}")
        self.native = _lib.available() if use_cext is None else bool(use_cext)
        self._ptr: Any = None
        if self.native:
            err = _lib.ffi.new("int *")
            ptr = _lib.lib.fnz_aio_create(block_size, queue_depth, thread_count, err)
            if ptr == _lib.ffi.NULL:
                raise OSError(-err[0], f"fnz_aio_create: {os.strerror(-err[0])}")
            self._ptr = ptr
            self._finalizer = weakref.finalize(self, _lib.lib.fnz_aio_destroy, ptr)

    @classmethod
    def from_config(cls, aio: Any, **kw: Any) -> AioEngine:
        get = aio.get if isinstance(aio, dict) else lambda k, d: getattr(aio, k, d)
        return cls(int(get("block_size", 1 << 20)), int(get("queue_depth", 8)), int(get("thread_count", 1)), **kw)

    @property
    def workers(self) -> int:
        return _lib.lib.fnz_aio_workers(self._ptr) if self._ptr is not None else 1

    def close(self) -> None:
        """Wait for everything submitted, stop the workers (idempotent)."""
        if self._ptr is not None:
            self._finalizer()
            self._ptr = None

    def __exit__(self, *exc: object) -> None:
        self.close()


class AioRequest:
    """One submitted read or write; ``wait()`` returns the bytes moved or raises OSError."""

    def __init__(self, handle: AioHandle, write: bool, tensor: torch.Tensor, nbytes: int, offset: int, req: Any, result: Any):
        self._handle, self.write, self.tensor, self.nbytes, self.offset = handle, write, tensor, nbytes, offset
        self._req, self._result = req, result  # native request pointer, or the fallback's outcome

    def done(self) -> bool:
        return self._req is None or bool(_lib.lib.fnz_aio_done(self._handle.engine._ptr, self._req))

    def wait(self) -> int:
        if self._req is not None:
            self._result = int(_lib.lib.fnz_aio_wait(self._handle.engine._ptr, self._req))
            self._req = None
            self._handle._pending.discard(self)
        r = self._result
        path = self._handle.path
        if isinstance(r, OSError):
            raise r
        if r < 0:
            raise OSError(-r, f"{'write' if self.write else 'read'} of {self.nbytes} bytes at offset {self.offset}: {os.strerror(-r)}", path)
        if r < self.nbytes:
            raise OSError(errno.EIO, f"short read: wanted {self.nbytes} bytes at offset {self.offset}, the file "
                                     f"ends after {r} of them (truncated?)", path)  # fmt: skip
        return r


_MODES = {"r": 1, "r+": 1 | 2, "w": 1 | 2 | 4 | 8, "a+": 1 | 2 | 4}  # FNZ_AIO_READ/WRITE/CREATE/TRUNC


class AioHandle(contextlib.AbstractContextManager):
    """A file for offload I/O. ``mode``: "r" (read, must exist), "r+" (read/write, must exist),
    "w" (create or truncate, read/write), "a+" (create if missing, keep contents, read/write).

    ``direct``: try O_DIRECT (``.direct`` says whether it is in use); aligned requests
    (`aligned_empty` buffers, offsets and sizes multiples of 4096) then bypass the page cache,
    others go buffered. ``size``: preallocate that many bytes. ``engine``: share one; else the
    handle makes and owns one from block_size/queue_depth/thread_count."""

    def __init__(self, path: str | os.PathLike, mode: str = "r", *, engine: AioEngine | None = None, direct: bool = True,
                 size: int | None = None, block_size: int = 1 << 20, queue_depth: int = 8, thread_count: int = 1,
                 use_cext: bool | None = None):  # fmt: skip
        if mode not in _MODES:
            raise ValueError(f"AioHandle: mode must be one of {sorted(_MODES)}, got {mode!r}")
        self.path = os.fspath(path)
        self.mode = mode
        self._owns_engine = engine is None
        self.engine = engine or AioEngine(block_size, queue_depth, thread_count, use_cext=use_cext)
        self._pending: set[AioRequest] = set()
        self._file: Any = None
        self._fd = -1
        flags = _MODES[mode]
        if self.engine.native:
            err = _lib.ffi.new("int *")
            f = _lib.lib.fnz_aio_open(os.fsencode(self.path), flags | (16 if direct else 0), err)
            if f == _lib.ffi.NULL:
                self._close_engine()
                raise OSError(-err[0], os.strerror(-err[0]), self.path)
            self._file = f
            self.direct = bool(_lib.lib.fnz_aio_is_direct(f))
        else:
            osflags = (os.O_RDWR if flags & 2 else os.O_RDONLY) | (os.O_CREAT if flags & 4 else 0) | (os.O_TRUNC if flags & 8 else 0)
            try:
                self._fd = os.open(self.path, osflags | getattr(os, "O_CLOEXEC", 0), 0o644)
            except OSError:
                self._close_engine()
                raise
            self.direct = False
        if size is not None:
            self.preallocate(size)

    # -- file operations -------------------------------------------------------------------
    @property
    def size(self) -> int:
        if self._file is not None:
            r = _lib.lib.fnz_aio_size(self._file)
            if r < 0:
                raise OSError(-r, os.strerror(-r), self.path)
            return int(r)
        return os.fstat(self._fd).st_size

    def preallocate(self, size: int) -> bool:
        """Grow the file to `size` bytes with blocks allocated; False if only made sparse."""
        if size < 0:
            raise ValueError(f"preallocate: size must be >= 0, got {size}")
        self._check_open()
        if self._file is not None:
            r = _lib.lib.fnz_aio_preallocate(self._file, size)
            if r < 0:
                raise OSError(-r, f"preallocate {size} bytes: {os.strerror(-r)}", self.path)
            return r == 0
        if os.fstat(self._fd).st_size < size:
            try:
                os.posix_fallocate(self._fd, 0, size)
            except OSError:
                os.ftruncate(self._fd, size)
                return False
        return True

    def sync(self) -> None:
        self._check_open()
        if self._file is not None:
            r = _lib.lib.fnz_aio_sync(self._file)
            if r < 0:
                raise OSError(-r, os.strerror(-r), self.path)
        else:
            os.fdatasync(self._fd)

    # -- I/O -------------------------------------------------------------------------------
    def submit_write(self, tensor: torch.Tensor, offset: int = 0) -> AioRequest:
        """Start writing `tensor`'s bytes at `offset`; keep it unchanged until the request's wait()."""
        return self._submit(True, tensor, offset)

    def submit_read(self, tensor: torch.Tensor, offset: int = 0) -> AioRequest:
        """Start filling `tensor` from the file at `offset`; do not read it before wait()."""
        return self._submit(False, tensor, offset)

    def pwrite(self, tensor: torch.Tensor, offset: int = 0) -> int:
        return self.submit_write(tensor, offset).wait()

    def pread(self, tensor: torch.Tensor, offset: int = 0) -> torch.Tensor:
        self.submit_read(tensor, offset).wait()
        return tensor

    def wait_all(self) -> None:
        """Wait for every outstanding request of this file; raises the first error."""
        wait_every([r.wait for r in self._pending])

    def _submit(self, write: bool, tensor: torch.Tensor, offset: int) -> AioRequest:
        what = "submit_write" if write else "submit_read"
        self._check_open()
        if write and self.mode == "r":
            raise ValueError(f"{what}: {self.path} is open read-only")
        if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0:
            raise ValueError(f"{what}: offset must be an integer >= 0, got {offset!r}")
        ptr, nbytes = _buffer(tensor, what)
        if not write and offset + nbytes > self.size:
            raise OSError(errno.EIO, f"read of {nbytes} bytes at offset {offset} goes past the end of the file "
                                     f"({self.size} bytes; truncated?)", self.path)  # fmt: skip
        if self._file is not None:
            err = _lib.ffi.new("int *")
            req = _lib.lib.fnz_aio_submit(self.engine._ptr, self._file, int(write), _lib.ffi.cast("void *", ptr), nbytes, offset, err)
            if req == _lib.ffi.NULL:
                raise OSError(-err[0], f"{what}: {os.strerror(-err[0])}", self.path)
            r = AioRequest(self, write, tensor, nbytes, offset, req, None)
            self._pending.add(r)
            return r
        try:
            result: Any = _sync_io(self._fd, write, ptr, nbytes, offset)
        except OSError as e:
            result = OSError(e.errno, e.strerror, self.path)
        return AioRequest(self, write, tensor, nbytes, offset, None, result)

    # -- lifetime --------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._file is None and self._fd < 0:
            raise ValueError(f"AioHandle: {self.path} is closed")

    def _close_engine(self) -> None:
        if self._owns_engine:
            self.engine.close()

    def close(self) -> None:
        """Wait for outstanding requests, close the file (and the engine if the handle made it)."""
        if self._file is None and self._fd < 0:
            return
        try:
            self.wait_all()
        finally:
            if self._file is not None:
                _lib.lib.fnz_aio_close(self._file)
                self._file = None
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1
            self._close_engine()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:  # a forgotten handle must not leave requests writing into freed tensors
        try:
            self.close()
        except Exception:
            pass


def fsync_dir(path: str) -> None:
    """Make a rename or a new entry in `path` durable (POSIX needs the directory itself fsynced)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
