"""Parameter shards no optimizer file holds, in a file of their own: `offload_param: {device: nvme}`
(`specs/offload.md` §Parameters says which shards, and how they are written and read). Each shard
is stored in its own dtype at an aligned offset, so a read is one O_DIRECT `pread`."""

from __future__ import annotations

import atexit
import os
import shutil
import socket
import uuid
from typing import Any

import torch

from .. import _ext
from ..sharding import ShardSource, placeholder
from ._nvme_files import (_HDR, HEADER, PREFIX, VERSION, Updates, _round_up, check_file,
                          pack_header, take_lock, usable_directory)
from ._host_params import HostParamStore
from ._nvme_optimizer import _aio_kwargs

__all__ = ["NvmeParamStore", "store_shards"]

FORMAT = "fnzero-nvme-param-store"
_FILE = "shards.bin"


class NvmeParamStore(Updates):
    """One rank's parameter shards in a file: `read(unit, kind)` (a new CPU tensor in the shard's
    own dtype), `write(unit, kind, value)`; writes of many units go inside one `updating(what,
    step)`. `kind` is "params" (trainable units) or "frozen". Made by `create`; not thread-safe
    (one per rank)."""

    def __init__(self, path: str, manifest: dict, engine: _ext.AioEngine):
        self.path = path
        self._manifest = manifest
        self._where = {(kind, unit): (getattr(torch, dtype), numel, off)
                       for kind, unit, dtype, numel, off in manifest["shards"]}
        self._engine = engine
        self._handle: _ext.AioHandle | None = None
        self._ino = (0, 0)
        self._lock_fd = -1
        self._step = 0

    @classmethod
    def create(cls, directory: str | os.PathLike, shards: dict[str, dict[str, torch.Tensor]], *, rank: int = 0,
               aio: Any = None, use_cext: bool | None = None) -> NvmeParamStore:  # fmt: skip
        """New files under `directory`/fnzero-rank{rank}-params-{uuid}/ holding `shards` (kind ->
        unit -> floating-point tensor, any device and shape, flattened), fsynced on return, so the
        caller may drop them. `aio`: DeepSpeed's aio block (block_size, queue_depth, thread_count)."""
        entries, off = [], HEADER
        for kind, units in shards.items():
            for unit, t in units.items():
                if not isinstance(t, torch.Tensor) or not t.is_floating_point():
                    raise ValueError(f"NvmeParamStore: shards[{kind!r}][{unit!r}] must be a floating-point tensor")
                entries.append([kind, unit, str(t.dtype).removeprefix("torch."), t.numel(), off])
                off += _round_up(t.numel() * t.element_size(), _ext.ALIGN)  # each shard on an aligned block
        os.makedirs(directory, exist_ok=True)
        store_id = uuid.uuid4()
        path = os.path.join(os.fspath(directory), f"{PREFIX}{rank}-params-{store_id.hex}")
        os.mkdir(path, 0o700)
        manifest = {"format": FORMAT, "version": VERSION, "uuid": store_id.hex, "rank": rank, "shards": entries,
                    "file_bytes": off, "state": "creating", "pid": os.getpid(), "host": socket.gethostname()}
        self = cls(path, manifest, _ext.AioEngine.from_config(aio or {}, use_cext=use_cext))
        try:
            self._lock_fd = take_lock(path)
            self._save_manifest()
            file = os.path.join(path, _FILE)
            self._handle = _ext.AioHandle(file, "w", engine=self._engine, size=off)
            st = os.stat(file)
            self._ino = (st.st_dev, st.st_ino)
            header = _ext.aligned_empty(HEADER, torch.uint8).zero_()
            total = sum(e[3] for e in entries)
            header[: _HDR.size].copy_(torch.frombuffer(bytearray(pack_header(manifest, total, "shards")), dtype=torch.uint8))
            self._handle.pwrite(header, 0)
            for kind, units in shards.items():
                for unit, t in units.items():
                    self._handle.pwrite(*self._block(unit, kind, t))
            self._handle.sync()
            self._save_manifest("clean", fsync=True)
            _ext.fsync_dir(path)
        except BaseException:
            self.close()
            raise
        return self

    # -- what is stored -----------------------------------------------------------------------
    def units(self, kind: str) -> dict[str, int]:
        """unit name -> number of elements, of one kind."""
        return {unit: numel for (k, unit), (_, numel, _) in self._where.items() if k == kind}

    @property
    def nbytes(self) -> int:
        """Bytes of the shards themselves (without the file's header and alignment padding)."""
        return sum(numel * dtype.itemsize for dtype, numel, _ in self._where.values())

    @property
    def bytes_on_disk(self) -> int:
        return self._manifest["file_bytes"]

    @property
    def last_step(self) -> int:
        """The optimizer steps whose trainable shards the store holds (0: the initial ones), as the
        optimizer store's: the training step sets it after writing them, `checkpoint.load` to the
        loaded step (`set_step`), and a step refuses a state at another (`specs/offload.md` §Parameters).
        Raises NvmeStoreError when an update failed part-way: the shards are then of no one step."""
        self.refuse_if_broken()
        return self._step

    def set_step(self, step: int) -> None:
        self.refuse_if_broken()
        self._step = int(step)

    def __repr__(self) -> str:
        return f"NvmeParamStore({self.path!r}, shards={len(self._where)}, bytes={self.nbytes})"

    # -- reading and writing --------------------------------------------------------------------
    def read(self, unit: str, kind: str) -> torch.Tensor:
        """The unit's shard of `kind`, a new flat CPU tensor in its stored dtype."""
        dtype, numel, off = self._entry(unit, kind)
        nbytes = numel * dtype.itemsize
        # The whole aligned block: the transfer stays O_DIRECT (each shard's padding is in the file).
        buf = _ext.aligned_empty(_round_up(nbytes, _ext.ALIGN), torch.uint8)
        self._handle.pread(buf, off)
        return buf[:nbytes].view(dtype)

    def write(self, unit: str, kind: str, value: torch.Tensor) -> None:
        """Replace the unit's shard of `kind` with `value` (any float dtype and shape, its element
        count), converted to the stored dtype (the step's copy-out, `checkpoint.load`)."""
        self._entry(unit, kind)
        block = self._block(unit, kind, value)  # a bad value is refused before any byte changes
        with self.updating("write", self._step):
            self._handle.pwrite(*block)

    def _flush(self) -> None:
        # One fdatasync per update (a step's copy-out of every unit, a checkpoint load): a buffered
        # write's write-back error shows only there, and must break the store before it reads "clean".
        self._handle.sync()

    def _block(self, unit: str, kind: str, value: torch.Tensor) -> tuple[torch.Tensor, int]:
        """(the aligned block holding `value` in the stored dtype, its file offset)."""
        dtype, numel, off = self._where[(kind, unit)]
        if not isinstance(value, torch.Tensor) or not value.is_floating_point() or value.numel() != numel:
            raise ValueError(f"NvmeParamStore.write: {kind} {unit!r} takes a float tensor of {numel} elements")
        nbytes = numel * dtype.itemsize
        buf = _ext.aligned_empty(_round_up(nbytes, _ext.ALIGN), torch.uint8)
        buf[nbytes:].zero_()
        buf[:nbytes].view(dtype).copy_(value.detach().reshape(-1))
        return buf, off

    def _entry(self, unit: str, kind: str) -> tuple[torch.dtype, int, int]:
        if self._handle is None:
            raise ValueError(f"NvmeParamStore: the store at {self.path} is closed")
        self.refuse_if_broken()
        entry = self._where.get((kind, unit))
        if entry is None:
            raise KeyError(f"NvmeParamStore: no {kind} shard of unit {unit!r} (it holds "
                           f"{sorted(u for _, u in self._where)[:8]}...)")
        check_file(os.path.join(self.path, _FILE), self._ino, self._manifest["file_bytes"])
        return entry

    # -- lifetime -------------------------------------------------------------------------------
    def close(self, delete: bool = True) -> None:
        """Wait for outstanding I/O, close the file; `delete` removes the directory. Idempotent."""
        try:
            if self._handle is not None:
                self._handle.close()
        finally:
            self._handle = None
            self._engine.close()
            if self._lock_fd >= 0:
                os.close(self._lock_fd)
                self._lock_fd = -1
            if delete:
                shutil.rmtree(self.path, ignore_errors=True)


def store_shards(sm, params: dict[str, torch.Tensor] | None = None, *,
                 where: str = "nvme") -> dict[str, torch.Tensor] | None:
    """`offload_param`: move this rank's shards that no optimizer file holds into a store, `where`
    "nvme" (a `NvmeParamStore` under `offload_param.nvme_path`, removed at exit) or "cpu" (a
    `HostParamStore`): every stage-3 sharded frozen unit of `sm` (a `ShardedModule`, duck-typed: the
    state layer calls this) and, given `params` (unit -> shard), every sharded trainable unit. The
    frozen constants and returned params hold placeholders, which `sm` reads through the store."""
    plan = sm.plan
    frozen, buffers = sm.constants

    def stored(units, held):  # persistent units stay gathered; one-element shards cannot be placeholders
        return {u.name: held[u.name] for u in units if plan.params_sharded(u) and u.shard_numel > 1}

    shards = {"frozen": stored(plan.frozen_units, frozen), "params": stored(plan.units, params) if params else {}}
    shards = {kind: units for kind, units in shards.items() if units}
    if not shards:
        return params
    device = sm.sharding.device
    if where == "cpu":
        pin = device.type != "cpu" and bool(sm.config.zero_optimization.offload_param.pin_memory)
        store: Any = HostParamStore(shards, pin=pin)
    else:
        cfg = sm.config
        directory = str(cfg.zero_optimization.offload_param.nvme_path)
        usable_directory(directory, "zero_optimization.offload_param.nvme_path")
        store = NvmeParamStore.create(directory, shards, rank=sm.comm.rank, aio=_aio_kwargs(cfg.aio.model_dump()))
        # Scratch files of this run: removed when the process ends (a killed process leaves them;
        # fnzero.offload.stale_stores finds and removes those).
        atexit.register(store.close)

    def placeholders(held, kind):
        return {k: placeholder(t.numel(), t.dtype, device) if k in shards.get(kind, ()) else t for k, t in held.items()}

    sm.replace_constants(placeholders(frozen, "frozen"), buffers)
    sm.read_shards_from(frozen=ShardSource(store, "frozen") if "frozen" in shards else None,
                        params=ShardSource(store, "params") if "params" in shards else None)
    return placeholders(params, "params") if params is not None else None

