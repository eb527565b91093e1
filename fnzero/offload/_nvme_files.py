"""The NVMe stores' files (`_nvme.py`, `_nvme_params.py`): their format (manifest, per-file
headers, aligned units), the directory lock, what the manifest and the store say while the files
change (`Updates`), the checks of what callers hand the store, and finding the directories killed
runs left behind (`specs/offload.md §NVMe store`)."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import shutil
import struct
from typing import Any, Iterator

import torch

from .. import _ext
from .._errors import ConfigError, DistributedError

__all__ = ["NvmeStoreError", "Updates", "stale_stores", "usable_directory"]

FORMAT = "fnzero-nvme-optimizer-store"
VERSION = 1
MAGIC = b"FNZNVME\0"
HEADER = _ext.ALIGN  # one aligned block, so the data after it keeps O_DIRECT alignment
_HDR = struct.Struct("<8sII16sQQ16s")  # magic, version, dtype (0 = fp32), store uuid, numel, data bytes, kind
_ELEM = 4  # fp32
_PAGE_ELEMS = _ext.ALIGN // _ELEM
MANIFEST, LOCK, PREFIX = "manifest.json", "lock", "fnzero-rank"
_AIO_KEYS = {"block_size", "queue_depth", "thread_count", "intra_op_parallelism", "single_submit", "overlap_events",
             "use_gds"}  # fmt: skip


class NvmeStoreError(OSError, DistributedError):
    """A store file is missing, truncated, replaced, of another store, or was left part-way through
    a step: the run cannot go on from it. An OSError (errno, filename = the path) and a
    fnzero.DistributedError."""


class Updates:
    """How a store's files change, shared by both stores (`specs/offload.md` §Parameters, "Failing
    part-way"): inside `updating(what, step)` the manifest's `state` is `what` until the last byte
    is written; an update that raises part-way makes the store refuse every later use
    (`refuse_if_broken`). Updates nest. The store provides `path`, `_manifest` and `close(delete)`."""

    path: str
    _manifest: dict
    _broken: str | None = None  # why the files are of no one step
    _depth = 0  # updates open
    _outer: tuple[str, Any] = ("", None)  # the outermost one's (what, step)

    def __del__(self) -> None:  # forgotten: free fds and threads, keep the files (`stale_stores` finds them)
        try:
            self.close(delete=False)
        except Exception:
            pass

    @contextlib.contextmanager
    def updating(self, what: str, step: Any) -> Iterator[None]:
        self.refuse_if_broken()
        outer = self._depth == 0
        if outer:
            self._save_manifest(what)  # a failure here changed no byte: the store stays usable
            self._outer = (what, step)
        self._depth += 1
        try:
            yield
        except BaseException:
            self._break("failed part-way")
            raise
        finally:
            self._depth -= 1
        if outer and self._broken is None:  # (an inner update that raised, caught inside, still broke it)
            try:
                self._flush()
            except BaseException:
                self._break("could not be flushed to its files")
                raise
            self._save_manifest("clean")

    def _flush(self) -> None:
        """What makes an update's writes readable and its write-back errors seen, once per outermost
        update (not per write: a step writes every unit)."""

    def _break(self, how: str) -> None:
        what, step = self._outer
        self._broken = (f"a {what} (step {step}) {how}, so the store's files hold old and new values together and "
                        "cannot be used again; load the last checkpoint into a new state (fnzero.shard the model "
                        "again, init_state, fnzero.checkpoint.load)")

    def refuse_if_broken(self) -> None:
        if self._broken is not None:
            raise NvmeStoreError(errno.EIO, self._broken, self.path)

    def _save_manifest(self, state: str | None = None, fsync: bool = False) -> None:
        if state is not None:
            self._manifest["state"] = state
        write_json_atomic(os.path.join(self.path, MANIFEST), self._manifest, fsync)


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def flat_cpu(name: str, what: str, t: Any) -> torch.Tensor:
    if not isinstance(t, torch.Tensor) or t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError(f"NvmeOptimizerStore: {what}[{name!r}] must be a contiguous CPU tensor")
    return t.reshape(-1)


def write_json_atomic(path: str, obj: dict, fsync: bool) -> None:
    # Write-then-rename: a reader sees the old manifest or the new one, never a torn one. Without
    # fsync this survives kill -9 (the page cache outlives the process), not a power cut; the
    # files are scratch, so only `create` pays for durability.
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f)
        if fsync:
            f.flush()
            os.fsync(f.fileno())
    os.replace(tmp, path)


def checked_create_args(master: Any, optimizer: str, optimizers: list[str], sub_group_size: int, buffer_count: int,
                        rank: int, aio: Any, kernel: Any = None, kinds: Any = ()) -> tuple[Any, dict[str, torch.Tensor]]:  # fmt: skip
    """`NvmeOptimizerStore.create`'s arguments checked: (the aio block in the store's names, the
    master shards flattened)."""
    if kernel is None and optimizer not in optimizers:
        raise ValueError(f"NvmeOptimizerStore: optimizer must be one of {optimizers}, got {optimizer!r}")
    bad = [k for k in kinds if not isinstance(k, str) or k == "master" or not k.replace(".", "").replace("_", "").isalnum()]
    if kernel is not None and (bad or len(set(kinds)) != len(tuple(kinds))):
        raise ValueError(f"NvmeOptimizerStore: kinds must be distinct file names other than 'master', got {kinds!r}")
    for name, v, lo in (("sub_group_size", sub_group_size, 1), ("buffer_count", buffer_count, 2), ("rank", rank, 0)):
        if isinstance(v, bool) or not isinstance(v, int) or v < lo:
            raise ValueError(f"NvmeOptimizerStore: {name} must be an integer >= {lo}, got {v!r}")
    if isinstance(aio, dict):
        if set(aio) - _AIO_KEYS:
            raise ValueError(f"NvmeOptimizerStore: unknown aio keys {sorted(set(aio) - _AIO_KEYS)}")
        if aio.get("use_gds"):
            raise ValueError("NvmeOptimizerStore: aio.use_gds is not implemented")
        if "intra_op_parallelism" in aio:  # DeepSpeed's newer name for thread_count
            aio = {**aio, "thread_count": aio.get("thread_count", aio["intra_op_parallelism"])}
    flat = {}
    for name, t in master.items():
        if not isinstance(name, str):
            raise ValueError(f"NvmeOptimizerStore: unit names must be strings, got {name!r}")
        flat[name] = flat_cpu(name, "master", t)
        if flat[name].dtype != torch.float32:
            raise ValueError(f"NvmeOptimizerStore: master[{name!r}] must be float32, is {flat[name].dtype}")
    return aio, flat


def check_unit_tensors(units: dict[str, int], what: str, tensors: Any, dtypes: tuple,
                       subset: bool) -> dict[str, torch.Tensor]:  # fmt: skip
    """`tensors` ({unit: tensor}, all of `units` or a `subset`) checked and flattened: contiguous
    CPU tensors of the unit's element count and one of `dtypes`."""
    names = set(tensors) if isinstance(tensors, dict) else None
    if names is None or not (names <= set(units) if subset else names == set(units)):
        got = sorted(names) if names is not None else type(tensors).__name__
        which = "only units of the store" if subset else "exactly the store's units"
        raise ValueError(f"NvmeOptimizerStore.step: {what} must have {which} {sorted(units)}, got {got}")
    flat = {}
    for name, t in tensors.items():
        flat[name] = flat_cpu(name, what, t)
        if t.dtype not in dtypes or t.numel() != units[name]:
            raise ValueError(f"NvmeOptimizerStore.step: {what}[{name!r}] must be one of {list(dtypes)} with "
                             f"{units[name]} elements; is {t.dtype} with {t.numel()}")  # fmt: skip
    return flat


def read_manifest(path: str) -> dict:
    """The manifest of the store directory `path`, checked to be this format and version."""
    mpath = os.path.join(path, MANIFEST)
    try:
        with open(mpath) as f:
            manifest = json.load(f)
    except FileNotFoundError:
        raise NvmeStoreError(errno.ENOENT, "no store manifest here (not a store, or its create was killed "
                                           "before writing one)", mpath) from None  # fmt: skip
    except (ValueError, OSError) as e:
        raise NvmeStoreError(errno.EIO, f"unreadable store manifest: {e}", mpath) from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT or manifest.get("version") != VERSION:
        raise NvmeStoreError(errno.EINVAL, f"not a {FORMAT} version {VERSION} manifest", mpath)
    return manifest


def pack_header(manifest: dict, total_numel: int, kind: str) -> bytes:
    """The header of a store's `kind` file: ties it to its manifest (uuid, sizes) and kind."""
    data = manifest["file_bytes"] - HEADER
    return _HDR.pack(MAGIC, VERSION, 0, bytes.fromhex(manifest["uuid"]), total_numel, data, kind.encode())


def check_header(h: _ext.AioHandle, path: str, file_bytes: int, expected: bytes) -> None:
    """Refuse (naming `path`) a file shorter than `file_bytes` or whose header is not `expected`."""
    if h.size < file_bytes:
        raise NvmeStoreError(errno.EIO, f"store file is truncated: {h.size} bytes, {file_bytes} expected", path)
    buf = _ext.aligned_empty(HEADER, torch.uint8)
    h.pread(buf, 0)
    if bytes(buf[: _HDR.size].numpy()) != expected:
        raise NvmeStoreError(errno.EINVAL, "store file header does not match the manifest (another store's "
                                           "file, another version, or corrupt)", path)  # fmt: skip


def check_file(path: str, ino: tuple[int, int], want: int) -> None:
    """A store's file still there, the one opened (`ino`: its (st_dev, st_ino) then) and at least
    `want` bytes long: otherwise raise naming it (an open fd would keep reading a deleted file, and
    a truncated one short)."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise NvmeStoreError(errno.ENOENT, "store file is missing (deleted while in use?)", path) from None
    if (st.st_dev, st.st_ino) != ino:
        raise NvmeStoreError(errno.ESTALE, "store file was replaced while in use", path)
    if st.st_size < want:
        raise NvmeStoreError(errno.EIO, f"store file is truncated: {st.st_size} bytes, {want} expected", path)


def usable_directory(directory: str | os.PathLike, key: str) -> None:
    """Make `directory` where it is missing (as DeepSpeed does), or raise one ConfigError naming the
    config `key` it came from when it cannot be made or written: before any store writes there."""
    path = os.fspath(directory)
    try:
        os.makedirs(path, exist_ok=True)
        why = None if os.access(path, os.W_OK | os.X_OK) else "it is not writable"
    except OSError as e:
        why = e.strerror or type(e).__name__
    if why is not None:
        raise ConfigError(f"`{key}` {path!r} cannot hold fnzero's NVMe files ({why}); give a writable directory "
                          "(it is made when missing)")


def take_lock(path: str) -> int:
    """Lock the store directory `path` for this process; the descriptor to keep open. Held for the
    store's life; the kernel drops it when the process dies, which is how `stale_stores` tells
    leftovers of killed runs from live stores."""
    fd = os.open(os.path.join(path, LOCK), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BaseException:
        os.close(fd)
        raise
    return fd


def stale_stores(directory: str | os.PathLike, *, remove: bool = False) -> list[str]:
    """Store directories under `directory` whose process is gone (their lock is free): what killed
    runs left behind. A live store's lock is held, so it is never listed. `remove` deletes them.
    Only meaningful on a local file system (flock)."""
    found = []
    try:
        names = sorted(os.listdir(directory))
    except FileNotFoundError:
        return []
    for name in names:
        p = os.path.join(os.fspath(directory), name)
        if not name.startswith(PREFIX) or not os.path.isdir(p):
            continue
        try:
            fd = os.open(os.path.join(p, LOCK), os.O_RDWR | os.O_CLOEXEC)
        except FileNotFoundError:  # killed before it took the lock
            found.append(p)
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            found.append(p)
        except BlockingIOError:
            pass
        finally:
            os.close(fd)
    if remove:
        for p in found:
            shutil.rmtree(p, ignore_errors=True)
    return found


def chunk_span(numel: int, base: int, start: int, n: int) -> tuple[int, int]:
    """(file offset, elements to transfer) of a chunk of the unit of `numel` elements at file
    offset `base`. A unit's last chunk is rounded up into the unit's padding when it starts
    aligned, so a sub_group_size that is a multiple of 1024 keeps every transfer O_DIRECT (the
    padding is read and written back unchanged)."""
    off = base + start * _ELEM
    if start + n == numel and off % _ext.ALIGN == 0:
        n = _round_up(n, _PAGE_ELEMS)
    return off, n
