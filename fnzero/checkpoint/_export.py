"""Consolidated weights in `model.state_dict()` naming, safetensors (streamed) or torch files, from a
saved checkpoint (`export`; `_export_live.py` reads a running job's state instead); every rank
calls it and one writes (`_one_writer.py`). Names, files and streaming: `specs/checkpoint-format.md`
§Export.
"""

from __future__ import annotations

import json
import math
import os
import re
import sys
import time
from typing import Callable

import torch

from .._errors import CheckpointError
from ..sharding import default_collectives
from ._ds_export import ds_weights
from ._ds_layout import is_deepspeed
from ._hf_config import hf_source, write_hf_files
from ._io import fsync_dir, tensor_bytes
from ._load import Reader, resolve
from ._one_writer import Rounds, world_device

__all__ = ["export", "parse_size", "parse_dtype", "Naming"]

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
        self.numel = math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * torch.empty((), dtype=self.dtype).element_size()


class _Progress:
    """tqdm when installed, else a single rewritten stderr line; silent when disabled. `tick` runs
    after every chunk (the writer's rounds with the other ranks, `_one_writer.py`)."""

    def __init__(self, total: int, enabled: bool, desc: str, tick: Callable[[], None] = lambda: None):
        self.total, self.done, self.enabled, self.desc, self.tick = total, 0, enabled, desc, tick
        self.bar, self.t0, self.last = None, time.monotonic(), 0.0
        if enabled:
            try:
                from tqdm import tqdm

                self.bar = tqdm(total=total, unit="B", unit_scale=True, desc=desc, file=sys.stderr)
            except ImportError:
                pass

    def update(self, n: int) -> None:
        self.done += n
        self.tick()
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


def _write_all(entries, out, fmt, max_shard_size, progress, meta, tick=lambda: None) -> list[str]:
    shards = _shards(entries, parse_size(max_shard_size))
    out, paths = _out_paths(os.fspath(out), fmt, len(shards))
    total = sum(e.nbytes for e in entries)
    prog = _Progress(total, sys.stderr.isatty() if progress is None else progress, f"export {os.path.basename(out)}",
                     tick)
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


def _check_arguments(dtype, fmt: str, tied: str, max_shard_size) -> torch.dtype | None:
    """Every argument checked on every rank before any rank writes (the same error everywhere,
    no collective); the dtype to cast to."""
    if fmt not in ("safetensors", "torch"):
        raise CheckpointError(f"export format must be 'safetensors' or 'torch', got {fmt!r}")
    if tied not in TIED:
        raise CheckpointError(f"tied must be 'auto', 'copy' or 'first', got {tied!r}")
    parse_size(max_shard_size)
    return parse_dtype(dtype)


TIED = ("auto", "copy", "first")


class Naming:
    """The names an export writes each tensor under (`specs/checkpoint-format.md` §Export), from what the
    model's save writes: `non_persistent` buffer names, and `pretrained`, a transformers model's
    {state_dict name: save_pretrained's name, or None} where they differ (None: another model)."""

    def __init__(self, tied: str, non_persistent, pretrained: dict[str, str | None] | None):
        self.tied, self.non_persistent, self.pretrained = tied, frozenset(non_persistent), pretrained

    @classmethod
    def of_plan(cls, plan, tied: str) -> "Naming":
        saved = plan.saved
        return cls(tied, saved.non_persistent, None if saved.pretrained is None else dict(saved.pretrained))

    @classmethod
    def of_index(cls, index: dict, tied: str) -> "Naming":
        # A checkpoint saved before these fields were recorded: every buffer, every name, as then.
        pretrained = index.get("pretrained_names")
        return cls(tied, index.get("non_persistent", ()), None if pretrained is None else dict(map(tuple, pretrained)))

    def names(self, names: list[str]) -> list[str]:
        """The names to write one tensor under; `names` are its state_dict names, first first."""
        if names[0] in self.non_persistent:
            return []
        if self.tied == "first":
            return names[:1]
        if self.tied == "auto" and self.pretrained is not None:
            saved = (self.pretrained.get(n, n) for n in names)
            return list(dict.fromkeys(n for n in saved if n is not None))
        return names

    def entries(self, names: list[str], shape, dtype: torch.dtype, fill) -> list[_Entry]:
        """One tensor's entries, one per name it is written under."""
        return [_Entry(name, shape, dtype, fill) for name in self.names(names)]


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
    tied: str = "auto",
    progress: bool | None = None,
    hf_config=None,
) -> list[str]:
    """Export from files: write the consolidated weights of the saved checkpoint `path/tag`
    (default latest) to `out` (a file, or a directory that gets `model.safetensors` /
    `pytorch_model.bin`); returns the paths written. Needs no running job and no model (the
    `fnzero export` command); `export_live` reads a running job's state instead. What is written,
    under which names: `specs/checkpoint-format.md` §Export.

    Call it on every rank, as `save`, or with no process group: rank 0 writes, and every rank
    returns its paths or raises its failure (§Export, "Every rank calls it").
    `max_shard_size` ('5GB'): Hugging Face's sharded files and `model.safetensors.index.json`.
    `tied`: "auto" (the names the model's own save writes), "copy" (every `state_dict()` name) or
    "first" (each tensor once). `hf_config`: a Hugging Face config, a model or a `save_pretrained`
    directory, whose `config.json` (and `generation_config.json`) go beside the weights.

    >>> fnzero.checkpoint.export("ckpt", "hf_out", dtype="bf16", hf_config=model.config)  # doctest: +SKIP
    """
    want = _check_arguments(dtype, format, tied, max_shard_size)
    hf = hf_source(hf_config)
    world = default_collectives()
    rounds = Rounds([world], writes=world.rank == 0, device=world_device(world))
    if not rounds.writes:
        return rounds.result()

    def write() -> list[str]:
        if is_deepspeed(path):
            return _write_deepspeed(path, out, want, tag, exclude_frozen, Naming(tied, (), None), format,
                                    max_shard_size, progress, hf, rounds.beat)
        with Reader(resolve(path, tag)) as rd:
            entries = _stored_entries(rd, want, Naming.of_index(rd.index, tied), exclude_frozen)
            ix = rd.index
            meta = {"format": "pt", "fnzero_tag": str(ix["tag"]), "fnzero_step": str(ix["step"])}
            paths = _write_all(entries, out, format, max_shard_size, progress, meta, tick=rounds.beat)
        return paths + write_hf_files(hf, os.path.dirname(paths[0]), want)

    return rounds.write(write)


def _write_deepspeed(path, out, want, tag, exclude_frozen, naming: Naming, fmt, max_shard_size, progress, hf,
                     tick) -> list[str]:
    """`export` of a DeepSpeed checkpoint directory (`specs/checkpoint-format.md` §DeepSpeed): its
    full weights (`_ds_weights.py`) through the same writer, every state_dict name (no model says
    which of a tie `save_pretrained` keeps)."""
    ck, w = ds_weights(path, tag, exclude_frozen)
    entries = []
    for name, t in w.tensors.items():
        dt = _cast_dtype(t.dtype, want)
        flat = t.reshape(-1)
        entries += naming.entries([name, *w.aliases.get(name, [])], t.shape, dt,
                                  lambda a, b, flat=flat, dt=dt: flat[a:b].to(dt))
    meta = {"format": "pt", "deepspeed_tag": ck.tag, "deepspeed_global_steps": str(ck.meta.get("global_steps"))}
    paths = _write_all(entries, out, fmt, max_shard_size, progress, meta, tick=tick)
    return paths + write_hf_files(hf, os.path.dirname(paths[0]), want)


def _stored_entries(rd: Reader, want, naming: Naming, exclude_frozen: bool) -> list[_Entry]:
    """What `export` writes from checkpoint `rd`, named by `naming`."""
    units = []
    for u in rd.index["units"]:
        key = f"master/{u['name']}" if f"master/{u['name']}" in rd.tensors else f"params/{u['name']}"
        if key not in rd.tensors:
            raise CheckpointError(f"the checkpoint has no stored weights for unit {u['name']!r}")
        units.append((u, key))
    for u in [] if exclude_frozen else rd.index.get("frozen_units", []):  # stage 3 (`_frozen.py`)
        if f"frozen/{u['name']}" in rd.tensors:  # (absent: saved with exclude_frozen_parameters)
            units.append((u, f"frozen/{u['name']}"))
    entries = []
    for u, key in units:
        dt = _cast_dtype(rd.dtype(key), want)
        for s in u["slots"]:
            fill = _reader_fill(rd, key, s["offset"], dt)
            entries += naming.entries([s["name"], *s["aliases"]], s["shape"], dt, fill)
    for kind in ("frozen", "buffers"):
        if kind == "frozen" and exclude_frozen:
            continue
        for key, t in rd.tensors.items():
            if key.startswith(kind + "/") and "unit" not in t:
                dt = _cast_dtype(rd.dtype(key), want)
                entries += naming.entries([key[len(kind) + 1:]], t["shape"], dt, _reader_fill(rd, key, 0, dt))
    return entries


def _reader_fill(rd: Reader, key: str, base: int, dt: torch.dtype):
    return lambda a, b: rd.read(key, base + a, base + b, torch.empty(b - a, dtype=dt))
