"""Consolidated weights in `model.state_dict()` naming: safetensors (streamed) or torch files.

Streaming: the safetensors header is computed from the index alone (names, shapes, dtypes), then
each tensor is read in chunks of at most `CHUNK_BYTES` from the rank files, cast and appended, so
peak memory is a few chunks whatever the model size. Tied parameters are written under every name
(as copies) by default so that a plain `model.load_state_dict(safetensors.torch.load_file(f))`
works; `tied="first"` keeps only the first name, safetensors' own `save_model` convention.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
from typing import Callable

import torch

from .._errors import CheckpointError
from ._io import fsync_dir, tensor_bytes
from ._load import Reader, resolve

__all__ = ["export", "export_live", "parse_size", "parse_dtype"]

CHUNK_BYTES = 64 << 20
_ST_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
              torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
              torch.bool: "BOOL"}
_DTYPE_ALIASES = {"fp32": torch.float32, "float32": torch.float32, "float": torch.float32,
                  "bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16,
                  "half": torch.float16, "fp64": torch.float64, "float64": torch.float64}


def parse_dtype(d) -> torch.dtype | None:
    """'fp32' | 'bf16' | 'fp16' | 'fp64' (and torch spellings) | torch.dtype | None (keep stored)."""
    if d is None or isinstance(d, torch.dtype):
        return d
    key = str(d).lower().removeprefix("torch.")
    if key not in _DTYPE_ALIASES:
        raise CheckpointError(f"unknown export dtype {d!r}; use fp32, bf16, fp16 or fp64")
    return _DTYPE_ALIASES[key]


def parse_size(s) -> int | None:
    """'5GB', '500MB', '2GiB', 1000000 -> bytes (decimal units as in HuggingFace, binary with 'i')."""
    if s is None or isinstance(s, int):
        return s
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([KMGT]?)(I?)B?\s*", str(s).upper())
    if not m:
        raise CheckpointError(f"cannot parse size {s!r}; write e.g. 5GB, 500MB or 2GiB")
    base = 1024 if m.group(3) else 1000
    n = int(float(m.group(1)) * base ** " KMGT".index(m.group(2) or " "))
    if n <= 0:
        raise CheckpointError(f"size {s!r} must be positive")
    return n


class _Entry:
    __slots__ = ("name", "shape", "dtype", "numel", "fill")

    def __init__(self, name, shape, dtype, fill: Callable[[int, int], torch.Tensor]):
        self.name, self.shape, self.dtype, self.fill = name, tuple(shape), dtype, fill
        self.numel = 1
        for d in self.shape:
            self.numel *= d

    @property
    def nbytes(self) -> int:
        return self.numel * torch.empty((), dtype=self.dtype).element_size()


class _Progress:
    """tqdm when installed, else a single rewritten stderr line; silent when disabled."""

    def __init__(self, total: int, enabled: bool, desc: str):
        self.total, self.done, self.enabled, self.desc = total, 0, enabled, desc
        self.bar, self.t0, self.last = None, time.monotonic(), 0.0
        if enabled:
            try:
                from tqdm import tqdm

                self.bar = tqdm(total=total, unit="B", unit_scale=True, desc=desc, file=sys.stderr)
            except ImportError:
                pass

    def update(self, n: int) -> None:
        self.done += n
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.update(n)
            return
        now = time.monotonic()
        if now - self.last > 0.5 or self.done >= self.total:
            self.last = now
            rate = self.done / max(now - self.t0, 1e-9) / 1e9
            print(f"\r{self.desc}: {self.done / 1e9:.2f}/{self.total / 1e9:.2f} GB ({rate:.2f} GB/s)",
                  end="", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        elif self.enabled:
            print(file=sys.stderr)


def _out_paths(out: str, fmt: str, n: int) -> tuple[str, list[str]]:
    default = "model.safetensors" if fmt == "safetensors" else "pytorch_model.bin"
    if out.endswith(os.sep) or os.path.isdir(out) or not os.path.splitext(out)[1]:
        out = os.path.join(out, default)
    d, base = os.path.split(os.path.abspath(out))
    os.makedirs(d, exist_ok=True)
    if n == 1:
        return out, [os.path.abspath(out)]
    stem, ext = os.path.splitext(base)
    return out, [os.path.join(d, f"{stem}-{i + 1:05d}-of-{n:05d}{ext}") for i in range(n)]


def _shards(entries: list[_Entry], max_bytes: int | None) -> list[list[_Entry]]:
    if not max_bytes:
        return [entries]
    out, cur, size = [], [], 0
    for e in entries:
        if cur and size + e.nbytes > max_bytes:
            out.append(cur)
            cur, size = [], 0
        cur.append(e)
        size += e.nbytes
    return out + [cur] if cur else out or [[]]


def _chunks(e: _Entry):
    step = max(1, CHUNK_BYTES // max(1, e.nbytes // max(e.numel, 1)))
    for a in range(0, e.numel, step):
        yield e.fill(a, min(e.numel, a + step))


def _write_safetensors(path: str, entries: list[_Entry], meta: dict, prog: _Progress) -> None:
    header, off = {}, 0
    for e in entries:
        header[e.name] = {"dtype": _ST_DTYPES[e.dtype], "shape": list(e.shape), "data_offsets": [off, off + e.nbytes]}
        off += e.nbytes
    header["__metadata__"] = meta
    hb = json.dumps(header, separators=(",", ":")).encode()
    hb += b" " * ((-len(hb)) % 8)  # the data section starts 8-byte aligned, as the format recommends
    tmp = path + ".tmp"
    with open(tmp, "wb", buffering=0) as f:
        f.write(len(hb).to_bytes(8, "little") + hb)
        for e in entries:
            for c in _chunks(e):
                buf = tensor_bytes(c.contiguous())
                while buf:
                    buf = buf[f.write(buf):]
                prog.update(c.numel() * c.element_size())
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _write_torch(path: str, entries: list[_Entry], prog: _Progress) -> None:
    # torch's zip format is written by torch.save from whole tensors: one shard is in memory at a
    # time (bound it with max_shard_size); only safetensors export streams tensor by tensor.
    sd = {}
    for e in entries:
        sd[e.name] = torch.cat([c.reshape(-1) for c in _chunks(e)] or [torch.empty(0, dtype=e.dtype)]).reshape(e.shape)
        prog.update(e.nbytes)
    tmp = path + ".tmp"
    torch.save(sd, tmp)
    os.replace(tmp, path)


def _write_all(entries, out, fmt, max_shard_size, progress, meta) -> list[str]:
    if fmt not in ("safetensors", "torch"):
        raise CheckpointError(f"export format must be 'safetensors' or 'torch', got {fmt!r}")
    shards = _shards(entries, parse_size(max_shard_size))
    out, paths = _out_paths(os.fspath(out), fmt, len(shards))
    total = sum(e.nbytes for e in entries)
    prog = _Progress(total, sys.stderr.isatty() if progress is None else progress, f"export {os.path.basename(out)}")
    try:
        for shard, p in zip(shards, paths):
            if fmt == "safetensors":
                _write_safetensors(p, shard, meta, prog)
            else:
                _write_torch(p, shard, prog)
    finally:
        prog.close()
    written = list(paths)
    if len(paths) > 1:
        idx = {"metadata": {"total_size": total},
               "weight_map": {e.name: os.path.basename(p) for shard, p in zip(shards, paths) for e in shard}}
        ip = os.path.abspath(out) + ".index.json"
        with open(ip + ".tmp", "w") as f:
            json.dump(idx, f, indent=2)
            f.flush()
            os.fsync(f.fileno())
        os.replace(ip + ".tmp", ip)
        written.append(ip)
    fsync_dir(os.path.dirname(paths[0]))
    return written


def _names(slot: dict, tied: str) -> list[str]:
    if tied not in ("copy", "first"):
        raise CheckpointError(f"tied must be 'copy' or 'first', got {tied!r}")
    return [slot["name"], *slot["aliases"]] if tied == "copy" else [slot["name"]]


def _cast_dtype(stored: torch.dtype, want: torch.dtype | None) -> torch.dtype:
    return want if (want is not None and stored.is_floating_point) else stored


def export(
    path: str | os.PathLike,
    out: str | os.PathLike,
    *,
    dtype="fp32",
    tag: str | None = None,
    max_shard_size: int | str | None = None,
    exclude_frozen: bool = False,
    format: str = "safetensors",
    tied: str = "copy",
    progress: bool | None = None,
) -> list[str]:
    """Write the consolidated model weights of checkpoint `path/tag` (default latest) to `out` (a
    file, or a directory that gets `model.safetensors` / `pytorch_model.bin`); returns the paths
    written. Trainable weights come from the fp32 master copy when the run had one. With
    `max_shard_size` ('5GB'), files are `model-0000i-of-0000n.safetensors` plus a HuggingFace
    `model.safetensors.index.json` (`weight_map`). Integer buffers keep their dtype."""
    want = parse_dtype(dtype)
    with Reader(resolve(path, tag)) as rd:
        ix = rd.index
        entries = []
        for u in ix["units"]:
            key = f"master/{u['name']}" if f"master/{u['name']}" in rd.tensors else f"params/{u['name']}"
            if key not in rd.tensors:
                raise CheckpointError(f"the checkpoint has no stored weights for unit {u['name']!r}")
            for s in u["slots"]:
                for name in _names(s, tied):
                    entries.append(_Entry(name, s["shape"], _cast_dtype(rd.dtype(key), want),
                                          _reader_fill(rd, key, s["offset"], _cast_dtype(rd.dtype(key), want))))
        for kind in ("frozen", "buffers"):
            if kind == "frozen" and exclude_frozen:
                continue
            for key, t in rd.tensors.items():
                if key.startswith(kind + "/"):
                    dt = _cast_dtype(rd.dtype(key), want)
                    entries.append(_Entry(key[len(kind) + 1:], t["shape"], dt, _reader_fill(rd, key, 0, dt)))
        meta = {"format": "pt", "fnzero_tag": str(ix["tag"]), "fnzero_step": str(ix["step"])}
        return _write_all(entries, out, format, max_shard_size, progress, meta)


def _reader_fill(rd: Reader, key: str, base: int, dt: torch.dtype):
    return lambda a, b: rd.read(key, base + a, base + b, torch.empty(b - a, dtype=dt))


def export_live(
    sm,
    state,
    out: str | os.PathLike,
    *,
    dtype="fp32",
    max_shard_size: int | str | None = None,
    exclude_frozen: bool = False,
    format: str = "safetensors",
    tied: str = "copy",
    progress: bool | None = None,
) -> list[str] | None:
    """Export from a running job (DeepSpeed's `save_16bit_model`): every rank calls it; units are
    gathered one at a time (master weights when present) and rank 0 writes. Returns rank 0's paths,
    None elsewhere."""
    from ..sharding._module import full_unit
    from ._tp import consolidated

    tp = state.sharding.tp if state.sharding.tp is not None and state.sharding.tp.size > 1 else None
    if state.sharding.pp is not None and state.sharding.pp.stages > 1:
        raise CheckpointError("export_live of a pipeline-parallel state is not implemented yet: save a checkpoint "
                              "(fnzero.checkpoint.save) and export it (fnzero.checkpoint.export), which needs no "
                              "running job")
    if tp is not None:  # the whole model's units, as without tensor parallelism (weights only)
        state = consolidated(state.replace(opt_state=None))
    want = parse_dtype(dtype)
    plan, comm = state.sharding.plan, state.sharding.comm
    src = state.master if state.master is not None else state.params
    current: dict = {}

    def unit_full(u):
        if current.get("name") != u.name:
            current.clear()  # drop the previous unit before gathering the next: one unit alive at a time
            current.update(name=u.name, full=full_unit(u, src[u.name].detach(), comm).cpu())
        return current["full"]

    if comm.rank != 0 or (tp is not None and tp.rank != 0):  # one writer: dp rank 0 of tp rank 0
        for u in plan.units:
            unit_full(u)
        comm.barrier()
        return None
    entries = []
    for u in plan.units:
        dt = _cast_dtype(src[u.name].dtype, want)
        for s in u.slots:
            for name in _names({"name": s.name, "aliases": list(s.aliases)}, tied):
                entries.append(_Entry(name, s.shape, dt, lambda a, b, u=u, o=s.offset, dt=dt: unit_full(u)[o + a : o + b].to(dt)))
    for kind, named in (("frozen", state.frozen), ("buffers", state.buffers)):
        if kind == "frozen" and exclude_frozen:
            continue
        for name, t in named.items():
            dt = _cast_dtype(t.dtype, want)
            entries.append(_Entry(name, t.shape, dt, lambda a, b, t=t, dt=dt: t.detach().reshape(-1)[a:b].cpu().to(dt)))
    try:
        return _write_all(entries, out, format, max_shard_size, progress, {"format": "pt", "fnzero_step": str(int(state.step))})
    finally:
        comm.barrier()
