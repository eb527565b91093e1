"""Checked torch-tensor entry points of the CPU optimizer kernels (C, or the torch fallback)."""

from __future__ import annotations

import zlib

import torch

from . import _fallback, _lib

__all__ = ["adam_step_", "adagrad_step_", "lion_step_", "to_16bit", "crc32"]

_OUT_KIND = {torch.bfloat16: 1, torch.float16: 2}  # FNZ_OUT_BF16 / FNZ_OUT_FP16


def _span(t: torch.Tensor) -> tuple[int, int]:
    start = t.data_ptr()
    return start, start + t.numel() * t.element_size()


def _check(fn: str, named: dict[str, torch.Tensor], out16: torch.Tensor | None) -> int:
    """Every buffer: a contiguous fp32 CPU tensor of one length, none overlapping another."""
    n = None
    for name, t in named.items():
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{fn}: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.device.type != "cpu":
            raise ValueError(f"{fn}: {name} must be on the CPU, is on {t.device}")
        if t.dtype != torch.float32:
            raise ValueError(f"{fn}: {name} must be float32, is {t.dtype}")
        if not t.is_contiguous():
            raise ValueError(f"{fn}: {name} must be contiguous")
        if n is None:
            n = t.numel()
        elif t.numel() != n:
            raise ValueError(f"{fn}: {name} has {t.numel()} elements, {next(iter(named))} has {n}")
    all_named = dict(named)
    if out16 is not None:
        if not isinstance(out16, torch.Tensor) or out16.dtype not in _OUT_KIND:
            raise ValueError(f"{fn}: out16 must be a bfloat16 or float16 tensor")
        if out16.device.type != "cpu" or not out16.is_contiguous() or out16.numel() != n:
            raise ValueError(f"{fn}: out16 must be a contiguous CPU tensor of {n} elements")
        all_named["out16"] = out16
    if n:
        spans = [(name, *_span(t)) for name, t in all_named.items()]
        for i, (a, a0, a1) in enumerate(spans):
            for b, b0, b1 in spans[i + 1 :]:
                if a0 < b1 and b0 < a1:
                    raise ValueError(f"{fn}: {a} and {b} overlap in memory; the update needs separate buffers")
    return n or 0


def _use_c(use_cext: bool | None) -> bool:
    if use_cext is None:
        return _lib.available()
    if use_cext and not _lib.available():
        raise ValueError(f"use_cext=True but the C extension is unavailable: {_lib.reason}")
    return bool(use_cext)


def _fused(grad_scale: float, out16: torch.Tensor | None, num_threads: int | None, thread_pool: bool = True):
    f = _lib.ffi.new("fnz_fused *")
    f.grad_scale = float(grad_scale)
    if out16 is not None:
        f.out_kind = _OUT_KIND[out16.dtype]
        f.out16 = _lib.ffi.cast("uint16_t *", out16.data_ptr())
    f.num_threads = torch.get_num_threads() if num_threads is None else int(num_threads)
    f.simd = _lib.LEVELS.index(_lib.active_level())
    f.thread_pool = int(bool(thread_pool))
    return f


def _fp(t: torch.Tensor):
    return _lib.ffi.cast("float *", t.data_ptr())


def _raise(fn: str, rc: int) -> None:
    if rc == -95:
        raise ValueError(f"{fn}: SIMD level {_lib.active_level()!r} is not supported on this CPU")
    if rc != 0:
        raise ValueError(f"{fn}: invalid arguments (C error {rc})")


def _check_step(fn: str, step: int) -> int:
    if isinstance(step, bool) or int(step) != step or step < 1:
        raise ValueError(f"{fn}: step must be an integer >= 1 (this step, counted from 1), got {step!r}")
    return int(step)


def adam_step_(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    *,
    step: int,
    lr: float,
    beta1: float = 0.9,
    beta2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    adamw: bool = True,
    bias_correction: bool = True,
    grad_scale: float = 1.0,
    out16: torch.Tensor | None = None,
    num_threads: int | None = None,
    thread_pool: bool = True,
    use_cext: bool | None = None,
) -> None:
    """One Adam (``adamw=False``: L2 penalty, torch.optim.Adam) or AdamW (decoupled decay,
    torch.optim.AdamW) step over flat fp32 buffers, in place.

    ``grad`` is multiplied by ``grad_scale`` first (1/loss_scale times the clip coefficient) and
    is not modified. ``out16`` (bf16/fp16, same length) receives the updated params in the same
    pass. ``num_threads``: None = torch.get_num_threads(); ``thread_pool``: run them on torch's
    OpenMP pool (False: new pthreads; see specs/cext.md "Threads"). ``use_cext``: None = the C kernel
    when built, False = the torch fallback, True = the C kernel or ValueError.
    """
    fn = "adam_step_"
    n = _check(fn, {"param": param, "grad": grad, "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}, out16)
    step = _check_step(fn, step)
    if not _use_c(use_cext):
        _fallback.adam_step_(param, grad, exp_avg, exp_avg_sq, step=step, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
                             weight_decay=weight_decay, adamw=adamw, bias_correction=bias_correction,
                             grad_scale=grad_scale, out16=out16)  # fmt: skip
        return
    rc = _lib.lib.fnz_adam_step(
        _fp(param), _fp(grad), _fp(exp_avg), _fp(exp_avg_sq), n, step, float(lr), float(beta1), float(beta2),
        float(eps), float(weight_decay), int(bool(adamw)), int(bool(bias_correction)),
        _fused(grad_scale, out16, num_threads, thread_pool),
    )  # fmt: skip
    _raise(fn, rc)


def adagrad_step_(
    param: torch.Tensor,
    grad: torch.Tensor,
    sum_: torch.Tensor,
    *,
    step: int,
    lr: float,
    lr_decay: float = 0.0,
    eps: float = 1e-10,
    weight_decay: float = 0.0,
    grad_scale: float = 1.0,
    out16: torch.Tensor | None = None,
    num_threads: int | None = None,
    use_cext: bool | None = None,
) -> None:
    """One torch.optim.Adagrad step (``sum_`` is the state "sum"), in place; extras as adam_step_."""
    fn = "adagrad_step_"
    n = _check(fn, {"param": param, "grad": grad, "sum": sum_}, out16)
    step = _check_step(fn, step)
    if not _use_c(use_cext):
        _fallback.adagrad_step_(param, grad, sum_, step=step, lr=lr, lr_decay=lr_decay, eps=eps,
                                weight_decay=weight_decay, grad_scale=grad_scale, out16=out16)  # fmt: skip
        return
    rc = _lib.lib.fnz_adagrad_step(
        _fp(param), _fp(grad), _fp(sum_), n, step, float(lr), float(lr_decay), float(eps), float(weight_decay),
        _fused(grad_scale, out16, num_threads),
    )  # fmt: skip
    _raise(fn, rc)


def lion_step_(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    *,
    lr: float,
    beta1: float = 0.9,
    beta2: float = 0.99,
    weight_decay: float = 0.0,
    grad_scale: float = 1.0,
    out16: torch.Tensor | None = None,
    num_threads: int | None = None,
    use_cext: bool | None = None,
) -> None:
    """One Lion step, in place: ``p = p*(1-lr*wd) - lr*sign(b1*m + (1-b1)*g)``, then
    ``m = b2*m + (1-b2)*g``; extras as adam_step_."""
    fn = "lion_step_"
    n = _check(fn, {"param": param, "grad": grad, "exp_avg": exp_avg}, out16)
    if not _use_c(use_cext):
        _fallback.lion_step_(param, grad, exp_avg, lr=lr, beta1=beta1, beta2=beta2, weight_decay=weight_decay,
                             grad_scale=grad_scale, out16=out16)  # fmt: skip
        return
    rc = _lib.lib.fnz_lion_step(
        _fp(param), _fp(grad), _fp(exp_avg), n, float(lr), float(beta1), float(beta2), float(weight_decay),
        _fused(grad_scale, out16, num_threads),
    )  # fmt: skip
    _raise(fn, rc)


def to_16bit(src: torch.Tensor, out16: torch.Tensor, *, use_cext: bool | None = None) -> torch.Tensor:
    """Copy fp32 ``src`` into the bf16/fp16 tensor ``out16`` (round to nearest even); returns out16."""
    n = _check("to_16bit", {"src": src}, out16)
    if not _use_c(use_cext):
        return out16.copy_(src)
    rc = _lib.lib.fnz_to_16bit(_fp(src), _lib.ffi.cast("uint16_t *", out16.data_ptr()), n,
                               _OUT_KIND[out16.dtype], _lib.LEVELS.index(_lib.active_level()))  # fmt: skip
    _raise("to_16bit", rc)
    return out16


def stream_adam_shape_(a, b, c, d, *, out16=None, num_threads: int = 1, thread_pool: bool = True) -> None:
    """The benchmark's bandwidth reference: Adam-shaped traffic (28 bytes/element), trivial math; with
    `out16` (a 16-bit tensor), also the top half of each new `a` into it (30 bytes/element), written
    as the fused Adam pass writes its copy-out."""
    n = _check("stream_adam_shape_", {"a": a, "b": b, "c": c, "d": d}, out16)
    if not _lib.available():
        raise ValueError(f"stream_adam_shape_: the C extension is unavailable: {_lib.reason}")
    threads, pool = num_threads, int(bool(thread_pool))
    if out16 is None:
        rc = _lib.lib.fnz_stream_adam_shape(_fp(a), _fp(b), _fp(c), _fp(d), n, threads, pool)
    else:
        o = _lib.ffi.cast("uint16_t *", out16.data_ptr())
        rc = _lib.lib.fnz_stream_adam_shape16(_fp(a), _fp(b), _fp(c), _fp(d), o, n, threads, pool)
    _raise("stream_adam_shape_", rc)


def crc32(buf, crc: int = 0) -> int:
    """zlib.crc32(buf, crc), with carry-less multiplication where the CPU has it (~2x zlib here;
    cext/crc32.c). `buf`: any contiguous buffer (bytes, memoryview). Releases the GIL."""
    if not _lib.available():
        return zlib.crc32(buf, crc)
    mv = memoryview(buf)
    if not mv.c_contiguous:
        return zlib.crc32(buf, crc)
    simd = _lib.LEVELS.index(_lib.active_level())
    return int(_lib.lib.fnz_crc32(crc & 0xFFFFFFFF, _lib.ffi.from_buffer(mv), mv.nbytes, simd))
