"""The on-disk index: its schema, (de)serialisation and validation (`specs/checkpoint-format.md`
§index.msgpack). Everything read from disk passes `validate_index` before it is used (§Reading a
directory nobody vouches for); data file names come from rank numbers, never from the index.
"""

from __future__ import annotations

import math
import re
import zlib
from typing import Any

import msgpack
import torch

from .._errors import CheckpointError

__all__ = [
    "FORMAT", "VERSION", "ALIGN", "INDEX_NAME", "LATEST_NAME", "DTYPES", "dtype_name", "dtype_of",
    "data_name", "part_name", "pack", "unpack", "seal", "check_seal", "check_tag", "check_client_state",
    "validate_index", "MAX_LATEST_BYTES",
]

FORMAT = "fnzero-checkpoint"
VERSION = 2  # 2: the index carries `index_crc32`, a checksum of its own metadata
ALIGN = 4096  # every segment starts at a multiple of this, so O_DIRECT readers can use the files
INDEX_NAME = "index.msgpack"
LATEST_NAME = "latest"
MAX_INDEX_BYTES = 256 << 20  # refuse to even read an index larger than this (a 1024-rank 70B index: ~40 MB)
MAX_LATEST_BYTES = 1024  # `latest` holds one tag (at most 200 characters)
_INT64 = (-(1 << 63), (1 << 63) - 1)

# dtype name on disk -> torch dtype. A closed list: an unknown name is an error, not a getattr.
DTYPES: dict[str, torch.dtype] = {
    "float64": torch.float64, "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
    "int64": torch.int64, "int32": torch.int32, "int16": torch.int16, "int8": torch.int8,
    "uint8": torch.uint8, "bool": torch.bool,
}
_NAMES = {v: k for k, v in DTYPES.items()}


def dtype_name(dt: torch.dtype) -> str:
    try:
        return _NAMES[dt]
    except KeyError:
        raise CheckpointError(f"tensors of dtype {dt} cannot be checkpointed (supported: {sorted(DTYPES)})") from None


def dtype_of(name: str, where: str) -> torch.dtype:
    if name not in DTYPES:
        raise CheckpointError(f"{where}: unknown dtype {_quote(name)}")
    return DTYPES[name]


def data_name(rank: int) -> str:
    return f"rank{rank:05d}.bin"


def part_name(rank: int) -> str:
    return f"rank{rank:05d}.msgpack"


def pack(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


_SEAL = "index_crc32"


def seal(index: dict) -> bytes:
    """The index as written: its msgpack bytes with `index_crc32`, the crc32 of the packed index
    without that field (`specs/checkpoint-format.md` §index.msgpack, The index's own checksum)."""
    if not isinstance(index, dict):  # (only a test forging a broken index writes one)
        return pack(index)
    body = {k: v for k, v in index.items() if k != _SEAL}
    return pack({**body, _SEAL: zlib.crc32(pack(body))})


def check_seal(ix: dict, where: str) -> None:
    """Verify `seal`'s checksum (version 2 and later; version 1 indexes have none)."""
    if not isinstance(ix, dict) or not isinstance(ix.get("version"), int) or ix["version"] < 2:
        return
    crc = ix.get(_SEAL)
    if not isinstance(crc, int) or isinstance(crc, bool):
        raise CheckpointError(f"{where}: the index has no metadata checksum ({_SEAL}); damaged or hand-edited")
    body = {k: v for k, v in ix.items() if k != _SEAL}
    if zlib.crc32(pack(body)) != crc:
        raise CheckpointError(
            f"{where}: the index's metadata checksum does not match its fields (a dtype, shape, offset or other "
            "field was changed after it was written): damaged or forged"
        )


def _quote(v: Any) -> str:
    """A value read from a file, for a message: its repr, cut short (messages name, never dump)."""
    text = repr(v)
    return text if len(text) <= 60 else text[:57] + "..."


def _no_ext(code, data):
    raise CheckpointError(f"msgpack extension type {code} is not allowed in a checkpoint index")


def unpack(raw: bytes, what: str) -> Any:
    """Decode msgpack from disk; any failure (garbage, truncation, ext types) is a CheckpointError."""
    try:
        return msgpack.unpackb(raw, raw=False, strict_map_key=True, ext_hook=_no_ext, use_list=True)
    except CheckpointError:
        raise
    except Exception as e:  # msgpack raises a zoo of types (ExtraData, FormatError, ValueError, ...)
        raise CheckpointError(f"{what} is not a valid msgpack document ({type(e).__name__})") from None


_TAG = re.compile(r"^[A-Za-z0-9_+=-][A-Za-z0-9_.+=-]{0,199}$")


def check_tag(tag: Any, where: str = "tag") -> str:
    """Tags become directory names: a conservative character set, no separators, no leading dot
    (our temporary directories start with one), so `..` and absolute paths are impossible."""
    if not isinstance(tag, str) or not _TAG.match(tag):
        raise CheckpointError(
            f"{where} {tag!r} is not a valid checkpoint tag: use 1-200 characters from [A-Za-z0-9_.+=-], "
            "not starting with '.'"
        )
    return tag


def check_client_state(obj: Any, path: str = "client_state", depth: int = 0) -> None:
    """client_state is stored as msgpack: plain data only. Name the first offending path."""
    if depth > 64:
        raise CheckpointError(f"{path}: nested deeper than 64 levels (a cycle?)")
    if obj is None or isinstance(obj, (bool, str, bytes, float)):
        return
    if isinstance(obj, int):
        if not _INT64[0] <= obj <= (1 << 64) - 1:
            raise CheckpointError(f"{path}: integer {obj} does not fit in 64 bits")
        return
    if isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            check_client_state(v, f"{path}[{i}]", depth + 1)
        return
    if isinstance(obj, dict):
        for k, v in obj.items():
            if not isinstance(k, str):
                raise CheckpointError(f"{path}: key {k!r} is a {type(k).__name__}; client_state keys must be str")
            check_client_state(v, f"{path}[{k!r}]", depth + 1)
        return
    raise CheckpointError(
        f"{path}: a {type(obj).__module__}.{type(obj).__qualname__} cannot be stored in client_state "
        "(allowed: None, bool, int, float, str, bytes, list, tuple, dict with str keys); "
        "convert it, e.g. a tensor with .tolist()"
    )


# -- validation of what was read ------------------------------------------------------------------
def _req(d: dict, key: str, types, where: str):
    if key not in d:
        raise CheckpointError(f"{where}: missing field {key!r}")
    v = d[key]
    if isinstance(v, bool) and bool not in (types if isinstance(types, tuple) else (types,)):
        raise CheckpointError(f"{where}.{key}: expected {types}, got bool")
    if not isinstance(v, types):
        raise CheckpointError(f"{where}.{key}: expected {getattr(types, '__name__', types)}, got {type(v).__name__}")
    return v


def _int(d, key, where, lo=0, hi=_INT64[1]):
    v = _req(d, key, int, where)
    if not lo <= v <= hi:
        raise CheckpointError(f"{where}.{key}: {v} is out of range [{lo}, {hi}]")
    return v


def _name(v, where) -> str:
    if not isinstance(v, str) or not v or len(v) > 1000 or "\x00" in v:
        raise CheckpointError(f"{where}: not a valid name: {_quote(v)}")
    return v


def validate_index(ix: Any, file_sizes: dict[int, int] | None = None) -> dict:
    """Check an index's structure, types and bounds; returns it. `file_sizes` (rank -> bytes on disk)
    also checks that every segment lies inside its file."""
    # Long: one check per index field, in the order of specs/checkpoint-format.md, so each problem is named
    # where it is found.
    if not isinstance(ix, dict):
        raise CheckpointError(f"the checkpoint index is a {type(ix).__name__}, expected a map")
    if ix.get("format") != FORMAT:
        raise CheckpointError(f"not an fnzero checkpoint index (format field {_quote(ix.get('format'))})")
    version = _req(ix, "version", int, "index")
    if version > VERSION:
        raise CheckpointError(
            f"checkpoint format version {version} is newer than this fnzero understands ({VERSION}); upgrade fnzero"
        )
    if version < 1:
        raise CheckpointError(f"invalid checkpoint format version {version}")
    check_seal(ix, "index")
    world = _int(ix, "world_size", "index", 1, 1 << 20)
    _int(ix, "stage", "index", 0, 3)
    _int(ix, "step", "index", 0)
    _req(ix, "tag", str, "index")
    for k in ("config",):
        if ix.get(k) is not None and not isinstance(ix[k], str):
            raise CheckpointError(f"index.{k}: expected str or nil")
    ls = ix.get("loss_scale")
    if ls is not None:
        if not isinstance(ls, dict):
            raise CheckpointError("index.loss_scale: expected a map or nil")
        _req(ls, "scale", (float, int), "index.loss_scale")
        _int(ls, "good_steps", "index.loss_scale", *_INT64)
        _int(ls, "hysteresis", "index.loss_scale", *_INT64)
    rng = _req(ix, "rng", list, "index")
    for i, r in enumerate(rng):
        if not isinstance(r, dict) or not isinstance(r.get("cpu"), bytes):
            raise CheckpointError(f"index.rng[{i}]: expected a map with a bytes 'cpu' field")
        cuda = r.get("cuda")
        if cuda is not None and not (isinstance(cuda, list) and all(isinstance(c, bytes) for c in cuda)):
            raise CheckpointError(f"index.rng[{i}].cuda: expected a list of bytes or nil")
    unit_numel: dict[str, int] = {}
    _validate_units(_req(ix, "units", list, "index"), "units", "", unit_numel)
    frozen_units = ix.get("frozen_units", [])  # stage 3: the frozen parameters' units (`frozen/NAME` on disk)
    if not isinstance(frozen_units, list):
        raise CheckpointError("index.frozen_units: expected a list")
    _validate_units(frozen_units, "frozen_units", "frozen/", unit_numel)
    if not isinstance(ix.get("frozen_excluded", False), bool):
        raise CheckpointError("index.frozen_excluded: expected a bool")
    _validate_saved_names(ix)
    files = _req(ix, "files", list, "index")
    if len(files) != world or not all(isinstance(f, int) and 0 <= f <= _INT64[1] for f in files):
        raise CheckpointError(f"index.files: expected {world} non-negative byte sizes, one per saving rank")
    tensors = _req(ix, "tensors", dict, "index")
    for key, t in tensors.items():
        _validate_tensor(key, t, unit_numel, files, world)
    node_local = ix.get("node_local")
    if node_local is not None:
        groups = node_local.get("groups") if isinstance(node_local, dict) else None
        if not (isinstance(groups, list) and all(isinstance(g, list) and all(isinstance(r, int) for r in g) for g in groups)
                and sorted(r for g in groups for r in g) == list(range(world))):
            raise CheckpointError(f"index.node_local.groups: expected lists of ranks covering 0..{world - 1} once")
    if file_sizes is not None:
        for r, size in enumerate(files):
            have = file_sizes.get(r)
            if have is None and node_local is not None:
                continue  # another node's file: a read that needs it says so (`Reader`)
            if have is None:
                raise CheckpointError(f"data file {data_name(r)} of rank {r} is missing")
            if have != size:
                raise CheckpointError(
                    f"data file {data_name(r)} is {have} bytes, the index says {size}: truncated or replaced"
                )
    return ix


def _validate_saved_names(ix: dict) -> None:
    """The optional fields saying what the model's own save writes (absent before they were
    recorded: an export then writes every buffer and tied name, as it did)."""
    transient = ix.get("non_persistent", [])
    if not (isinstance(transient, list) and all(isinstance(n, str) for n in transient)):
        raise CheckpointError("index.non_persistent: expected a list of buffer names")
    pretrained = ix.get("pretrained_names")
    if pretrained is not None and not (isinstance(pretrained, list) and all(
            isinstance(p, list) and len(p) == 2 and isinstance(p[0], str) and isinstance(p[1], (str, type(None)))
            for p in pretrained)):
        raise CheckpointError("index.pretrained_names: expected nil or a list of [name, saved name or nil]")


def _validate_units(units: list, field: str, prefix: str, unit_numel: dict[str, int]) -> None:
    """Each unit's slots packed in order and covering its numel; its numel into `unit_numel` under
    `prefix` + its name."""
    for i, u in enumerate(units):
        w = f"index.{field}[{i}]"
        if not isinstance(u, dict):
            raise CheckpointError(f"{w}: expected a map")
        name = _name(u.get("name"), f"{w}.name")
        numel = _int(u, "numel", w)
        end = 0
        for j, s in enumerate(_req(u, "slots", list, w)):
            sw = f"{w}.slots[{j}]"
            if not isinstance(s, dict):
                raise CheckpointError(f"{sw}: expected a map")
            _name(s.get("name"), f"{sw}.name")
            shape = _shape(_req(s, "shape", list, sw), sw)
            off = _int(s, "offset", sw)
            if off != end:
                raise CheckpointError(f"{sw}: offset {off}, expected {end} (slots must be packed in order)")
            end = off + math.prod(shape)
            for a in _req(s, "aliases", list, sw):
                _name(a, f"{sw}.aliases")
        if end != numel:
            raise CheckpointError(f"{w}: slots cover {end} elements but numel is {numel}")
        unit_numel[prefix + name] = numel


def _shape(shape, where) -> list[int]:
    if len(shape) > 32 or not all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d < (1 << 48) for d in shape):
        raise CheckpointError(f"{where}.shape: invalid shape {_quote(shape)}")
    if math.prod(shape) >= (1 << 48):
        raise CheckpointError(f"{where}.shape: {_quote(shape)} is implausibly large")
    return shape


def with_cover(meta: dict, slot: tuple[int, int] | None) -> dict:
    """A unit tensor's meta with `slot` (a parameter's element range) added to its `cover`: the
    ranges of the unit a per-parameter tensor holds (a partition's state covers some of a unit's
    parameters only). Sorted, adjacent ranges merged; `slot` None leaves the meta as it is."""
    if slot is None:
        return meta
    merged: list[list[int]] = []
    for a, b in sorted([*map(tuple, meta.get("cover", ())), tuple(slot)]):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return {**meta, "cover": merged}


def _expected_ranges(t: dict, numel: int, w: str) -> list[tuple[int, int]]:
    cover = t.get("cover")
    if cover is None:
        return [(0, numel)]
    if not isinstance(cover, list) or not all(isinstance(c, list) and len(c) == 2 and all(
            isinstance(x, int) and not isinstance(x, bool) for x in c) for c in cover):
        raise CheckpointError(f"{w}.cover: expected a list of [lo, hi] integer pairs")
    prev = 0
    for a, b in cover:
        if not prev <= a < b <= numel:
            raise CheckpointError(f"{w}.cover: range [{a}, {b}) is empty, out of order or outside [0, {numel})")
        prev = b
    return [tuple(c) for c in cover]


def _validate_tensor(key, t, unit_numel, files, world) -> None:
    w = f"index.tensors[{_quote(key)}]"
    _name(key, w)
    if not isinstance(t, dict):
        raise CheckpointError(f"{w}: expected a map")
    dt = dtype_of(_req(t, "dtype", str, w), w)
    esize = torch.empty((), dtype=dt).element_size()
    unit = t.get("unit")
    if unit is not None:
        if unit not in unit_numel:
            raise CheckpointError(f"{w}: unknown unit {_quote(unit)}")
        numel = unit_numel[unit]
    else:
        numel = math.prod(_shape(_req(t, "shape", list, w), w))
    segs = _req(t, "segments", list, w)
    ranges = _expected_ranges(t, numel, w) if unit is not None else [(0, numel)]
    pos, at = ranges[0][0], 0
    for i, s in enumerate(segs):
        sw = f"{w}.segments[{i}]"
        if not (isinstance(s, list) and len(s) == 5 and all(isinstance(x, int) and not isinstance(x, bool) for x in s)):
            raise CheckpointError(f"{sw}: expected [rank, offset, lo, hi, crc32] integers")
        rank, off, lo, hi, crc = s
        if not 0 <= rank < world:
            raise CheckpointError(f"{sw}: rank {rank} outside the saved world of {world}")
        if pos == ranges[at][1] and at + 1 < len(ranges):  # the next covered range (a per-parameter tensor)
            at += 1
            pos = ranges[at][0]
        if lo != pos or hi < lo or hi > ranges[at][1]:
            raise CheckpointError(f"{sw}: element range [{lo}, {hi}) does not continue [{ranges[at][0]}, {pos}) "
                                  f"within {ranges[at][1]}")
        if off < 0 or off % ALIGN or off + (hi - lo) * esize > files[rank]:
            raise CheckpointError(
                f"{sw}: bytes [{off}, {off + (hi - lo) * esize}) lie outside {data_name(rank)} ({files[rank]} bytes) "
                "or are misaligned"
            )
        if not 0 <= crc < (1 << 32):
            raise CheckpointError(f"{sw}: invalid crc32 {crc}")
        pos = hi
    if (at, pos) != (len(ranges) - 1, ranges[-1][1]):
        raise CheckpointError(f"{w}: segments cover up to element {pos} of the ranges {ranges} it holds: "
                              "incomplete checkpoint")
