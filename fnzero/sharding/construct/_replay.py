"""Initialising a meta model's tensors slice by slice: the init code's writes to stand-ins recorded,
then replayed in `CHUNK`-element chunks for what a rank keeps (`specs/sharding.md` §Meta
construction, step 2); what cannot be recorded is `Unreplayable` (materialised: `_materialize.py`)."""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any, Callable

import torch

__all__ = ["CHUNK", "Unreplayable", "Recording", "TensorRecord", "record", "seed_of", "sentinel_fill"]

# Elements per chunk: small enough that a rank computes little beyond its range, large enough that
# seeding a generator per chunk costs nothing beside the draws (~2.5 % of a normal_ at 2^18).
CHUNK = 1 << 18

_aten = torch.ops.aten
_RANDOM = {_aten.normal_, _aten.uniform_, _aten.bernoulli_, _aten.exponential_, _aten.cauchy_, _aten.log_normal_,
           _aten.geometric_, _aten.random_}  # fills that never read the tensor they write
_FILL = {_aten.fill_, _aten.zero_}


class Unreplayable(Exception):
    """A region whose init code does something `record` cannot replay slice by slice."""


class _Self:
    """Where the written tensor goes in a recorded op's arguments."""


class _Flat:
    """A real tensor argument as large as the written tensor: sliced with it, flattened (a copy:
    the init code may change its own tensor afterwards)."""

    def __init__(self, t: torch.Tensor):
        self.t = t.detach().reshape(-1).clone()


@dataclasses.dataclass
class _Op:
    kind: str  # "random" | "fill" | "copy" | "pointwise"
    func: Any  # the aten OpOverload
    args: tuple
    kwargs: dict
    positions: torch.Tensor | None = None  # a fill of part of the tensor: the flat positions it writes

    @property
    def whole(self) -> bool:
        """Whether the op overwrites every element without reading any."""
        return self.kind in ("random", "fill", "copy") and self.positions is None


def seed_of(*parts: Any) -> int:
    """A generator seed from names and numbers (sha256 of them joined by ':'), the same everywhere."""
    digest = hashlib.sha256(":".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


@dataclasses.dataclass
class TensorRecord:
    """The writes of a tensor's init code, replayable over any range of its flat elements."""

    name: str
    shape: torch.Size
    dtype: torch.dtype
    seed: int
    ops: list[_Op] = dataclasses.field(default_factory=list)

    @property
    def numel(self) -> int:
        return self.shape.numel()

    @property
    def start(self) -> int | None:
        """The index of the last op that overwrote the whole tensor (None: none did)."""
        return next((k for k in range(len(self.ops) - 1, -1, -1) if self.ops[k].whole), None)

    def untouched(self) -> bool:
        return self.start is None

    def whole(self) -> torch.Tensor:
        out = torch.empty(self.shape, dtype=self.dtype)
        self.fill(0, self.numel, out.view(-1))
        return out

    def fill(self, lo: int, hi: int, out: torch.Tensor) -> None:
        """Elements [lo, hi) of the flat initial value into `out` (1-D, any dtype or device), from the
        whole chunks they lie in."""
        for c in range(lo // CHUNK, (hi - 1) // CHUNK + 1) if hi > lo else ():
            c0, c1 = c * CHUNK, min((c + 1) * CHUNK, self.numel)
            a, b = max(lo, c0), min(hi, c1)
            direct = (a, b) == (c0, c1) and out.dtype == self.dtype and out.device.type == "cpu"
            buf = out[c0 - lo : c1 - lo] if direct else torch.empty(c1 - c0, dtype=self.dtype)
            self._chunk(c, c0, c1, buf)
            if not direct:
                out[a - lo : b - lo].copy_(buf[a - c0 : b - c0])

    def _chunk(self, c: int, c0: int, c1: int, buf: torch.Tensor) -> None:
        start = self.start
        if start is None:
            sentinel_fill(buf)
            start = 0
        for k in range(start, len(self.ops)):
            op = self.ops[k]
            if op.positions is not None:  # a fill of some positions (zero_'s value is 0)
                idx = op.positions[(op.positions >= c0) & (op.positions < c1)] - c0
                value = op.args[0] if op.args else 0
                buf.index_fill_(0, idx, value.item() if isinstance(value, torch.Tensor) else value)
                continue
            args = tuple(_arg(a, buf, c0, c1) for a in op.args)
            kwargs = {key: _arg(a, buf, c0, c1) for key, a in op.kwargs.items()}
            if op.kind == "random":
                kwargs["generator"] = torch.Generator().manual_seed(seed_of(self.seed, self.name, k, c))
            op.func(*args, **kwargs)


def _arg(a: Any, buf: torch.Tensor, c0: int, c1: int) -> Any:
    if a is _Self:
        return buf
    if isinstance(a, _Flat):
        return a.t[c0:c1]
    return a


def sentinel_fill(t: torch.Tensor) -> None:
    """What an uninitialised tensor holds, so that init code that leaves it is caught: NaN, the
    integer minimum; a bool has no sentinel value (False)."""
    if t.is_floating_point() or t.is_complex():
        t.fill_(float("nan"))
    elif t.dtype == torch.bool:
        t.fill_(False)
    else:
        t.fill_(torch.iinfo(t.dtype).min)


class Recording:
    """Stand-ins for a region's meta tensors while the init code runs, and the records of its writes.
    `result()` raises Unreplayable if any op could not be recorded (even one the init code caught)."""

    def __init__(self, tensors: dict[str, torch.Tensor], seed: int):
        storages: set[int] = set()
        self.records: dict[str, TensorRecord] = {}
        self.standins: dict[str, _Standin] = {}
        self.reason: str | None = None
        for name, t in tensors.items():
            key = t.untyped_storage()._cdata
            if not t.is_meta or not t.is_contiguous() or key in storages:
                raise Unreplayable(f"{name} is not a contiguous meta tensor with a storage of its own")
            storages.add(key)
            self.records[name] = rec = TensorRecord(name, t.shape, t.dtype, seed)
            self.standins[name] = _Standin(t.detach(), t.detach(), rec, self, t.requires_grad)

    def result(self) -> dict[str, TensorRecord]:
        if self.reason is not None:
            raise Unreplayable(self.reason)
        return self.records


class _Standin(torch.Tensor):
    """A region tensor while its init code runs: its shape, strides and dtype on the host, no
    storage (not meta: torch.nn.init's `trunc_normal_` and others skip meta tensors). A write is
    recorded (`_classify`), a view stands in for the same tensor, anything else is unreplayable."""

    elem: torch.Tensor  # a meta tensor with the view's geometry, in the base's storage
    base: torch.Tensor  # the region tensor's meta twin (contiguous)
    rec: TensorRecord
    recording: Recording

    @staticmethod
    def __new__(cls, elem, base, rec, recording, requires_grad=False):
        t = torch.Tensor._make_wrapper_subclass(cls, elem.shape, strides=elem.stride(), dtype=elem.dtype,
                                                storage_offset=elem.storage_offset(), device="cpu",
                                                requires_grad=requires_grad)
        t.elem, t.base, t.rec, t.recording = elem, base, rec, recording
        return t

    __torch_function__ = torch._C._disabled_torch_function_impl

    def __repr__(self) -> str:
        return f"<stand-in for {self.rec.name}: {tuple(self.shape)} {self.dtype}>"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        flat = [a for v in [*args, *kwargs.values()] for a in (v if isinstance(v, (list, tuple)) else [v])]
        ins = [a for a in flat if isinstance(a, _Standin)]
        try:
            return _dispatch(func, args, kwargs, ins)
        except Unreplayable as e:
            recording = ins[0].recording
            recording.reason = recording.reason or f"{ins[0].rec.name}: {e}"
            raise


def _dispatch(func, args: tuple, kwargs: dict, ins: list[_Standin]) -> Any:
    schema = func._schema
    written = [i for i, a in enumerate(schema.arguments) if a.alias_info is not None and a.alias_info.is_write]
    if written:
        if written != [0] or not isinstance(args[0], _Standin) or len(ins) != 1:
            raise Unreplayable(f"{func} writes through an out= argument, or reads a tensor being initialised")
        view = args[0]
        view.rec.ops.append(_classify(func, view.elem, view.base, args[1:], kwargs))
        return view
    returns = schema.returns
    if len(returns) == 1 and returns[0].alias_info is not None and len(ins) == 1:  # a view (detach, select, view)
        out = func(*_elems(args), **kwargs)
        wrap = lambda e: _Standin(e, ins[0].base, ins[0].rec, ins[0].recording)  # noqa: E731
        return [wrap(e) for e in out] if isinstance(out, (list, tuple)) else wrap(out)
    raise Unreplayable(f"{func} reads its values")


def _elems(args: tuple) -> list:
    return [a.elem if isinstance(a, _Standin) else a for a in args]


def _classify(func, view: torch.Tensor, base: torch.Tensor, args: tuple, kwargs: dict) -> _Op:
    """One write to a region tensor as an `_Op`, or Unreplayable."""
    whole = (view.dtype == base.dtype and view.is_contiguous() and view.numel() == base.numel()
             and view.storage_offset() == base.storage_offset())
    packet = func.overloadpacket
    if packet in _FILL and not whole:
        if view.dtype != base.dtype or any(isinstance(a, torch.Tensor) and a.is_meta for a in args):
            raise Unreplayable(f"{func} of a part, reinterpreted or from a meta tensor")
        pos = _positions(view, base)
        if pos.numel() != base.numel() or torch.unique(pos).numel() != base.numel():
            return _Op("fill", func, tuple(args), {}, pos)
        whole = True  # every element once, through a permuted view (`zeros_(w.T)`): one value everywhere
    if not whole:
        raise Unreplayable(f"{func} writes a part of the tensor")
    if packet in _RANDOM:
        if kwargs.get("generator") is not None:
            raise Unreplayable(f"{func} draws from the init code's own generator")
        kwargs = {k: v for k, v in kwargs.items() if k != "generator"}
        kind = "random"
    elif packet in _FILL:
        kind = "fill"
    elif packet is _aten.copy_:
        src = args[0]
        if src.is_meta:
            raise Unreplayable("copied from a tensor computed on the meta device")
        try:
            src = src.expand(view.shape)
        except RuntimeError as e:
            raise Unreplayable(f"copied from a tensor of shape {tuple(src.shape)}") from e
        return _Op("copy", func, (_Self, _Flat(src)), {})
    elif torch.Tag.pointwise in func.tags:
        kind = "pointwise"
    else:
        raise Unreplayable(f"{func} is not an elementwise write")
    return _Op(kind, func, (_Self, *(_replayable(a, view) for a in args)),
               {k: _replayable(v, view) for k, v in kwargs.items()})


def _replayable(a: Any, view: torch.Tensor) -> Any:
    """A recorded op's other argument: scalars as they are, a real tensor of one element or of
    the written tensor's shape (sliced with it); anything else cannot be replayed by slices."""
    if not isinstance(a, torch.Tensor):
        if isinstance(a, (list, tuple)) and any(isinstance(x, torch.Tensor) for x in a):
            raise Unreplayable("an argument is a list of tensors")
        return a
    if a.is_meta:
        raise Unreplayable("it reads a tensor on the meta device")
    if a.numel() == 1 and a.dim() == 0:
        return a.detach().clone()
    if tuple(a.shape) == tuple(view.shape):
        return _Flat(a)
    raise Unreplayable(f"an argument of shape {tuple(a.shape)} is neither a scalar nor the tensor's shape")


def _positions(view: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
    """The flat positions in `base` of every element of `view` (a view of its storage)."""
    pos = torch.tensor(view.storage_offset() - base.storage_offset(), dtype=torch.int64)
    for size, stride in zip(view.shape, view.stride()):
        pos = pos.unsqueeze(-1) + torch.arange(size, dtype=torch.int64) * stride
    pos = pos.reshape(-1)
    if pos.numel() and (int(pos.min()) < 0 or int(pos.max()) >= base.numel()):
        raise Unreplayable("a write outside the tensor's elements")
    return pos


def record(run: Callable[[dict[str, torch.Tensor]], None], tensors: dict[str, torch.Tensor],
           seed: int) -> dict[str, TensorRecord]:
    """name -> TensorRecord of what `run(standins)` wrote to stand-ins for `tensors` (name -> meta
    tensor, contiguous, a storage of its own), draws seeded from `seed`. Raises Unreplayable."""
    recording = Recording(tensors, seed)
    run(dict(recording.standins))
    return recording.result()
