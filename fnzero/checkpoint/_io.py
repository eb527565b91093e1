"""File mechanics: aligned appends with checksums, fsync, atomic renames, range reads into tensors.

Tensor bytes move between files and tensor memory through memoryviews of the tensor's storage (no
intermediate `bytes` copy, no numpy-dtype limits: bfloat16 is as easy as float32).
"""

from __future__ import annotations

import ctypes
import os
import time
import zlib

import torch

from .._errors import CheckpointError
from ._format import ALIGN

__all__ = [
    "tensor_bytes", "AlignedWriter", "fsync_dir", "write_atomic", "read_into", "wait_for",
    "Checksum",
]

_ZEROS = bytes(ALIGN)
_CHUNK = 64 << 20  # bytes per write/read call; larger calls gain nothing and pin more page cache


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor's memory (any dtype)."""
    assert t.device.type == "cpu" and t.is_contiguous(), "tensor_bytes needs a contiguous CPU tensor"
    n = t.numel() * t.element_size()
    if n == 0:
        return memoryview(b"")
    return memoryview((ctypes.c_char * n).from_address(t.data_ptr())).cast("B")


class Checksum:
    """crc32 (zlib): ~2 GB/s per core here against ~0.5 GB/s for blake2b. It guards against
    accidental damage (truncation, bit rot, torn writes); a cryptographic hash would add nothing
    against a forger, who could rewrite the unkeyed digest in the index as easily."""

    @staticmethod
    def of(buf, crc: int = 0) -> int:
        return zlib.crc32(buf, crc)


class AlignedWriter:
    """Appends segments to one data file, each starting at a multiple of ALIGN; fsync on close."""

    def __init__(self, path: str):
        self.path = path
        self.f = open(path, "wb", buffering=0)
        self.pos = 0

    def write(self, t: torch.Tensor) -> tuple[int, int]:
        """Write `t`'s bytes at the next aligned offset; return (offset, crc32)."""
        pad = (-self.pos) % ALIGN
        if pad:
            self.f.write(_ZEROS[:pad])
            self.pos += pad
        off = self.pos
        buf = tensor_bytes(t)
        crc = 0
        for i in range(0, len(buf), _CHUNK):
            piece = buf[i : i + _CHUNK]
            crc = zlib.crc32(piece, crc)
            while piece:
                n = self.f.write(piece)
                piece = piece[n:]
        self.pos += len(buf)
        return off, crc

    def close(self) -> int:
        """Flush to stable storage; the file's size."""
        os.fsync(self.f.fileno())
        self.f.close()
        return self.pos

    def abort(self) -> None:
        try:
            self.f.close()
        except OSError:
            pass


def fsync_dir(path: str) -> None:
    """Make a rename or a new entry in `path` durable (POSIX needs the directory itself fsynced)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: str, data: bytes) -> None:
    """Write a small file so that readers see the old content or the new, never a torn one."""
    d = os.path.dirname(path) or "."
    tmp = os.path.join(d, f".{os.path.basename(path)}.tmp.{os.getpid()}.{time.monotonic_ns()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(d)


def read_into(fd: int, offset: int, out: torch.Tensor, what: str) -> None:
    """Fill contiguous CPU tensor `out` with bytes at `offset` of an open file."""
    buf = tensor_bytes(out)
    done = 0
    while done < len(buf):
        n = os.preadv(fd, [buf[done : done + _CHUNK]], offset + done)
        if n <= 0:
            raise CheckpointError(f"{what}: unexpected end of file at byte {offset + done} (truncated checkpoint)")
        done += n


def wait_for(predicate, timeout: float, what: str, poll: float = 0.005):
    """Poll `predicate()` until it returns something truthy. Ranks of an async save coordinate
    through files, because the background thread must not issue collectives."""
    deadline = time.monotonic() + timeout
    delay = poll
    while True:
        v = predicate()
        if v:
            return v
        if time.monotonic() > deadline:
            raise CheckpointError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(delay)
        delay = min(delay * 1.5, 0.1)
