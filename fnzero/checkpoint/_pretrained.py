"""Pretrained weights straight into a sharded state (`specs/checkpoint-format.md` §Pretrained):
every header is checked before any tensor data is read, then each rank reads only the bytes of
the elements it keeps, cast to the dtype the model trains in.

Written by hand rather than through `safetensors.safe_open`: the format is a length-prefixed JSON
header and raw little-endian bytes, and positioned reads make the bytes each rank reads exact
(an mmap reads whole pages through the page cache).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
from typing import Any

import torch

from .._errors import CheckpointError
from ..sharding import Cuts
from ._peft_names import peft_names

__all__ = ["PretrainedReport", "PretrainedLoad", "TensorEntry", "index_pretrained", "load_pretrained"]

_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
_MAX_HEADER = 100 << 20  # safetensors' own limit


@dataclasses.dataclass(frozen=True)
class TensorEntry:
    """One tensor of a safetensors file: where its bytes are."""

    file: str
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int  # absolute byte offset of the first element
    nbytes: int


@dataclasses.dataclass
class PretrainedReport:
    """What `init_state(pretrained=...)` did: `loaded` and `missing` (kept at the model's own
    initialisation) by state_dict name, `unexpected` names in the files (ignored when allowed),
    and `bytes_read` by this rank. `adapters`: a PEFT model's adapter tensors, which no base
    model's file has (they keep PEFT's initialisation; not in `missing`)."""

    loaded: list[str]
    missing: list[str]
    unexpected: list[str]
    bytes_read: int
    files: list[str]
    adapters: list[str] = dataclasses.field(default_factory=list)


def _read_header(path: str) -> dict[str, TensorEntry]:
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{path}: not a safetensors file (only {len(head)} bytes)")
            n = int.from_bytes(head, "little")
            if n > _MAX_HEADER or 8 + n > size:
                raise CheckpointError(f"{path}: not a safetensors file, or truncated (header of {n} bytes, file of {size})")
            raw = f.read(n)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read ({e.strerror or e})") from e
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: the safetensors header is not valid JSON ({e})") from e
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: the safetensors header is not a JSON object")
    out = {}
    base = 8 + n
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = _DTYPES[info["dtype"]]
            shape = tuple(int(d) for d in info["shape"])
            lo, hi = (int(x) for x in info["data_offsets"])
        except (KeyError, TypeError, ValueError) as e:
            raise CheckpointError(f"{path}: tensor {name!r} has a malformed header entry ({e!r})") from e
        nbytes = math.prod(shape) * dtype.itemsize
        if hi - lo != nbytes or lo < 0:
            raise CheckpointError(f"{path}: tensor {name!r} spans {hi - lo} bytes, its shape {list(shape)} needs {nbytes}")
        if base + hi > size:
            raise CheckpointError(
                f"{path}: truncated: tensor {name!r} ends at byte {base + hi}, the file has {size} bytes"
            )
        out[name] = TensorEntry(path, name, dtype, shape, base + lo, nbytes)
    return out


def index_pretrained(path: str | os.PathLike) -> dict[str, TensorEntry]:
    """Every tensor of a safetensors file or a `save_pretrained` directory, by name, headers checked."""
    path = os.fspath(path)
    if os.path.isfile(path):
        return _read_header(path)
    if not os.path.isdir(path):
        raise CheckpointError(f"pretrained weights {path!r}: no such file or directory")
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        try:
            with open(index, encoding="utf-8") as f:
                weight_map = json.load(f)["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index}: not a safetensors index with a weight_map ({e!r})") from e
        entries: dict[str, TensorEntry] = {}
        for file in sorted(set(weight_map.values())):
            full = os.path.join(path, file)
            if not os.path.isfile(full):
                raise CheckpointError(f"{index} lists {file!r}, which is missing from {path}")
            entries.update(_read_header(full))
        listed_elsewhere = [n for n, f in weight_map.items()
                            if n not in entries or os.path.normpath(entries[n].file) != os.path.normpath(os.path.join(path, f))]
        if listed_elsewhere:
            raise CheckpointError(f"{index}: tensors not in the file it names: {listed_elsewhere[:8]}")
        return entries
    single = os.path.join(path, "model.safetensors")
    if os.path.isfile(single):
        return _read_header(single)
    pickles = [f for f in ("pytorch_model.bin", "pytorch_model.bin.index.json") if os.path.isfile(os.path.join(path, f))]
    hint = (f" (it has {pickles[0]}: torch pickles are not loaded, since loading one can run code; convert it "
            "once with transformers: from_pretrained(path).save_pretrained(out, safe_serialization=True))") if pickles else ""
    raise CheckpointError(f"{path} has neither model.safetensors nor model.safetensors.index.json{hint}")


class _Reader:
    """Positioned reads of byte ranges, counted."""

    def __init__(self):
        self.fds: dict[str, int] = {}
        self.bytes_read = 0

    def read(self, e: TensorEntry, first: int, count: int) -> torch.Tensor:
        """Elements [first, first + count) of `e` (row-major), as a 1-D tensor of its dtype."""
        fd = self.fds.get(e.file)
        if fd is None:
            fd = self.fds[e.file] = os.open(e.file, os.O_RDONLY)
        size = e.dtype.itemsize
        want = count * size
        buf = bytearray(want)
        view, done = memoryview(buf), 0
        while done < want:
            got = os.preadv(fd, [view[done:]], e.start + first * size + done)
            if got <= 0:
                raise CheckpointError(f"{e.file}: tensor {e.name!r} ended early (file shrank while reading?)")
            done += got
        self.bytes_read += want
        t = torch.frombuffer(buf, dtype=torch.uint8) if want else torch.empty(0, dtype=torch.uint8)
        return t.view(e.dtype)

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)
        self.fds.clear()


def load_pretrained(path, plan, rank: int, initial: dict[str, torch.Tensor], frozen: dict[str, torch.Tensor],
                    buffers: dict[str, torch.Tensor], persistent: set[str], *,
                    allow_unexpected: bool = False, base_prefix: str = "", tp=None,
                    rename=None, ep=None) -> "PretrainedLoad":
    """Check `path` against the model (names, shapes, files) without reading tensor data
    (`specs/checkpoint-format.md` §Pretrained); the returned load's `run()` then overwrites
    `initial` (unit -> flat buffer or this rank's shard), `frozen` and `buffers` in place and
    returns the report. `base_prefix`: the model's `base_model_prefix` (transformers). `tp` (a
    TPLayout): the files' whole tensors are read and cut to this rank's slices. `ep` (an EPLayout):
    only this rank's experts are read, a stacked tensor's rows alone (`specs/mesh.md`)."""
    if sys.byteorder != "little":
        raise CheckpointError("safetensors data is little-endian; big-endian hosts are not supported")
    entries = index_pretrained(path)
    # Frozen units (stage 3) are filled like trainable ones, into `frozen` (unit -> this rank's shard).
    units = [(u, initial) for u in plan.units] + [(u, frozen) for u in plan.frozen_units]
    slots = {n for u, _ in units for s in u.slots for n in (s.name, *s.aliases)}
    known = slots | set(plan.frozen) | set(buffers) | (ep.elsewhere if ep is not None else frozenset())
    if rename is not None:  # transformers' own renames of its files' names (`_hf_renames.py`)
        entries = _renamed(entries, rename, known)
    peft = peft_names(known)  # a PEFT model reads its base model's names (`_peft_names.py`)
    entries = _adapt_prefix(entries, peft.base_names() if peft else known, base_prefix)
    entries = peft.to_model(entries) if peft else entries
    unexpected = sorted(n for n in entries if n not in known)
    if unexpected and not allow_unexpected:
        raise CheckpointError(
            f"pretrained weights {os.fspath(path)!r}: {len(unexpected)} tensor(s) the model does not have: "
            f"{', '.join(unexpected[:12])}{' ...' if len(unexpected) > 12 else ''} "
            "(another architecture or config? init_state(..., allow_unexpected=True) ignores them)"
        )
    jobs: list[tuple[str, TensorEntry, Any]] = []  # (model name, entry, where it goes)
    cuts = Cuts(tp, ep)  # tensor-parallel slices and stacked experts' rows: read whole (or rows), then cut
    bad_shape, missing = [], []
    for u, target in units:
        for s in u.slots:
            e = next((entries[n] for n in (s.name, *s.aliases) if n in entries), None)
            if e is None:
                missing.append(s.name)
                continue
            cut = cuts.split_of(s.name, *s.aliases)
            want = tuple(cut[0].full_shape) if cut is not None else tuple(s.shape)
            if e.shape != want:
                bad_shape.append(f"{e.name}: file {list(e.shape)}, model {list(want)}")
            jobs.append((s.name, e, (u, s, cut, target)))
    for table, names in ((frozen, plan.frozen), (buffers, list(buffers))):
        for n in names:
            t = table[n]
            if n not in entries:
                if table is frozen or n in persistent:
                    missing.append(n)
                continue
            cut = cuts.split_of(n) if table is frozen else None
            want = tuple(cut[0].full_shape) if cut is not None else tuple(t.shape)
            if entries[n].shape != want:
                bad_shape.append(f"{n}: file {list(entries[n].shape)}, model {list(want)}")
            jobs.append((n, entries[n], (table, cut)))
    if bad_shape:
        raise CheckpointError(f"pretrained weights {os.fspath(path)!r}: shapes differ from the model's: " + "; ".join(bad_shape))
    adapters = set(peft.adapters()) if peft else set()
    report = PretrainedReport(loaded=[n for n, _, _ in jobs], missing=[n for n in missing if n not in adapters],
                              unexpected=unexpected, bytes_read=0, files=sorted({e.file for e in entries.values()}),
                              adapters=[n for n in missing if n in adapters])
    return PretrainedLoad(jobs, plan, rank, initial, report)


def _renamed(entries: dict[str, TensorEntry], rename, known: set[str]) -> dict[str, TensorEntry]:
    """Each file name the model does not know, by `rename` where that gives a name it does not
    have yet (a PEFT model's names are its base's, under a prefix: the renamed name may be one of
    those, so it is kept unless it collides)."""
    out = {}
    for name, e in entries.items():
        new = name if name in known else rename(name)
        out[new if new not in entries or new == name else name] = e
    return out


def _adapt_prefix(entries: dict[str, TensorEntry], known: set[str], prefix: str) -> dict[str, TensorEntry]:
    """As transformers' from_pretrained: a base model's file (no `prefix.`) into a model with a
    head (names under `prefix.`) gains the prefix; a model-with-head file into the base model
    loses it. Only when that is what makes the names meet."""
    if not prefix or not entries:
        return entries
    p = prefix + "."
    file_has = any(n.startswith(p) for n in entries)
    model_has = any(n.startswith(p) for n in known)
    if model_has and not file_has:
        renamed = {p + n: e for n, e in entries.items()}
    elif file_has and not model_has:
        renamed = {(n[len(p):] if n.startswith(p) else n): e for n, e in entries.items()}
    else:
        return entries
    return renamed if len(set(renamed) & known) > len(set(entries) & known) else entries


class PretrainedLoad:
    """A checked load, ready to read (`load_pretrained`)."""

    def __init__(self, jobs, plan, rank: int, initial: dict[str, torch.Tensor], report: PretrainedReport):
        self.jobs, self.plan, self.rank, self.initial, self.report = jobs, plan, rank, initial, report

    def run(self) -> PretrainedReport:
        reader = _Reader()
        try:
            with torch.no_grad():
                for name, e, where in self.jobs:
                    if len(where) == 4:
                        _load_slot(reader, e, *where, self.plan, self.rank)
                    else:
                        table, cut = where
                        t = table[name]
                        value = reader.read(e, 0, math.prod(e.shape)).reshape(e.shape)
                        if cut is not None:
                            value = cut[0].local(value, cut[1])
                        table[name] = value.to(device=t.device, dtype=t.dtype)
        finally:
            reader.close()
        self.report.bytes_read = reader.bytes_read
        return self.report


def _load_slot(reader: _Reader, e: TensorEntry, unit, slot, cut, held: dict[str, torch.Tensor], plan,
               rank: int) -> None:  # fmt: skip
    """The elements of `slot` that this rank holds, read from `e` into the unit's buffer in `held`
    (a tensor-parallel slice: the whole tensor read, then cut; rows along dim 0, such as stacked
    experts: read alone, one contiguous range of the file)."""
    buf = held[unit.name]
    lo, hi = unit.shard_range(rank) if plan.params_sharded(unit) else (0, unit.padded_numel)
    a, b = max(lo, slot.offset), min(hi, slot.offset + slot.numel)
    if a >= b:
        return
    first = 0  # where the slot's elements start in the file's tensor
    if cut is not None and cut[0].dim == 0 and cut[0].blocks == 1:
        split, index = cut
        first = split.start(index) * math.prod(split.full_shape[1:])
        cut = None
    if cut is not None:
        whole = reader.read(e, 0, math.prod(e.shape)).reshape(e.shape)
        values = cut[0].local(whole, cut[1]).reshape(-1)[a - slot.offset: b - slot.offset]
    else:
        values = reader.read(e, first + a - slot.offset, b - a)
    buf[a - lo : b - lo].copy_(values.to(buf.dtype))
