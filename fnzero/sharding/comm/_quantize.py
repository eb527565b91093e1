"""Codecs for what collectives carry (ZeRO++'s qwZ and qgZ): block-wise symmetric quantisation in
plain tensor ops, and the identity (`specs/collectives.md` §Quantized collectives.Codec)."""

from __future__ import annotations

import dataclasses

import torch

from ..._errors import ShardingError

__all__ = [
    "DEFAULT_BLOCK", "BlockQuantizer", "IdentityCodec", "CommQuantization", "quantize", "dequantize",
    "PayloadCodec", "NO_QUANTIZATION", "pack_int4", "unpack_int4",
]

# DeepSpeed's weight quantizer (`CUDAQuantizer`) picks its group count per tensor so that a group
# holds under 16000 elements, aiming below 8000, and names 4096 (4k) as its kernel's optimum; a
# fixed block of 4096 is that optimum, and keeps the layout independent of the tensor's size.
DEFAULT_BLOCK = 4096
_SCALE_BYTES = 4  # one float32 scale per block


def _checked(block: int, bits: int) -> tuple[int, int]:
    if bits not in (4, 8):
        raise ShardingError(f"quantisation bits must be 4 or 8, got {bits!r}")
    if not isinstance(block, int) or block < 1:
        raise ShardingError(f"quantisation block must be a positive number of elements, got {block!r}")
    return block, 2 ** (bits - 1) - 1


def quantize(t: torch.Tensor, block: int = DEFAULT_BLOCK, bits: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 values, float32 scales) of `t` flattened, in blocks of `block` elements, one int8 per
    element (`pack_int4` packs 4-bit ones) (`specs/collectives.md` §Quantized collectives.Codec)."""
    block, qmax = _checked(block, bits)
    x = t.reshape(-1)
    work = torch.promote_types(x.dtype, torch.float32)
    n = x.numel()
    nb = -(-n // block)
    rows = torch.nn.functional.pad(x.to(work), (0, nb * block - n)).view(nb, block)
    scales = (rows.abs().amax(dim=1) / qmax).to(torch.float32)
    s = scales.to(work).unsqueeze(1)
    q = torch.where(s > 0, rows / s, torch.zeros((), dtype=work, device=x.device)).round()
    q = torch.where(torch.isfinite(q), q, torch.zeros((), dtype=work, device=x.device)).clamp_(-qmax, qmax)
    return q.reshape(-1)[:n].to(torch.int8), scales


def dequantize(q: torch.Tensor, scales: torch.Tensor, block: int = DEFAULT_BLOCK,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """`q * s` per block, in `dtype` (computed in float32, or in `dtype` where it is wider)."""
    n = q.numel()
    work = torch.promote_types(dtype, torch.float32)
    nb = scales.numel()
    if nb != -(-n // block):
        raise ShardingError(f"dequantize: {n} values in blocks of {block} need {-(-n // block)} scales, got {nb}")
    padded = torch.nn.functional.pad(q.to(work), (0, nb * block - n)).view(nb, block)
    return (padded * scales.to(work).unsqueeze(1)).reshape(-1)[:n].to(dtype)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """4-bit values in [-7, 7] two to a byte (the first in the low nibble), offset by 8."""
    u = (q.to(torch.int16) + 8).to(torch.uint8)
    u = torch.nn.functional.pad(u, (0, u.numel() % 2))
    return u[0::2] | (u[1::2] << 4)


def unpack_int4(packed: torch.Tensor, n: int) -> torch.Tensor:
    lo, hi = packed & 15, packed >> 4
    return torch.stack([lo, hi], dim=1).reshape(-1)[:n].to(torch.int16).sub(8).to(torch.int8)


class PayloadCodec:
    """What a quantized collective needs of a codec: `nbytes(n, dtype)` for n elements of
    `dtype`, `encode(flat) -> uint8` of exactly that length, and `decode(data, n, dtype,
    out_dtype)` back to n elements (`dtype` is the encoded tensor's, `out_dtype` the result's)."""

    def nbytes(self, n: int, dtype: torch.dtype) -> int:
        raise NotImplementedError

    def encode(self, flat: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def decode(self, data: torch.Tensor, n: int, dtype: torch.dtype, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        raise NotImplementedError


@dataclasses.dataclass(frozen=True)
class BlockQuantizer(PayloadCodec):
    """Block-wise symmetric quantisation (`quantize`): the payload (n bytes at 8 bits, ⌈n/2⌉ at 4)
    followed by ⌈n/block⌉ float32 scales, `nbytes(n) = payload + 4·⌈n/block⌉`."""

    bits: int = 8
    block: int = DEFAULT_BLOCK

    def __post_init__(self):
        _checked(self.block, self.bits)

    def _payload(self, n: int) -> int:
        return n if self.bits == 8 else (n + 1) // 2

    def nbytes(self, n: int, dtype: torch.dtype) -> int:
        return self._payload(n) + _SCALE_BYTES * (-(-n // self.block))

    def encode(self, flat: torch.Tensor) -> torch.Tensor:
        q, scales = quantize(flat, self.block, self.bits)
        payload = q.view(torch.uint8) if self.bits == 8 else pack_int4(q)
        return torch.cat([payload, scales.view(torch.uint8)])

    def decode(self, data: torch.Tensor, n: int, dtype: torch.dtype, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        p = self._payload(n)
        payload = data[:p]
        q = payload.view(torch.int8) if self.bits == 8 else unpack_int4(payload, n)
        scales = data[p:].clone().view(torch.float32)  # a copy: the slice need not be 4-byte aligned
        return dequantize(q, scales, self.block, out_dtype or dtype)


@dataclasses.dataclass(frozen=True)
class IdentityCodec(PayloadCodec):
    """The tensor's own bytes: a quantized collective with it computes what the plain one does."""

    def nbytes(self, n: int, dtype: torch.dtype) -> int:
        return n * dtype.itemsize

    def encode(self, flat: torch.Tensor) -> torch.Tensor:
        return flat.contiguous().reshape(-1).view(torch.uint8)

    def decode(self, data: torch.Tensor, n: int, dtype: torch.dtype, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        t = data.clone().view(dtype) if data.storage_offset() % dtype.itemsize else data.view(dtype)
        return t if out_dtype in (None, dtype) else t.to(out_dtype)


@dataclasses.dataclass(frozen=True)
class CommQuantization:
    """What travels quantized (ZeRO++), as data: a codec per kind of payload, None for full precision:
    `weights` (qwZ) and `frozen_weights`, stage 3's all-gathers of trainable and frozen units;
    `gradients` (qgZ), the gradient reduce-scatters at stages 2 and 3."""

    @property
    def not_traceable(self) -> str | None:
        """Why a step with these codecs cannot run as one graph (`fnzero.jit(scope="step")`), or None
        (qwZ is stage 3, which the plan already declares)."""
        if self.gradients is not None:
            return "zero_quantized_gradients' quantized reduce-scatter is eager code, not traced"
        return None

    weights: PayloadCodec | None = None
    frozen_weights: PayloadCodec | None = None
    gradients: PayloadCodec | None = None

    @property
    def active(self) -> bool:
        return any(c is not None for c in (self.weights, self.frozen_weights, self.gradients))


NO_QUANTIZATION = CommQuantization()
