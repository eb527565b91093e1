"""Ring attention: each rank keeps its run of the queries and passes its run of the keys and values
to the next rank of the ring, merging each block's attention by its log-sum-exp, so that no rank
ever holds more than two runs of keys and values (`specs/mesh.md` §Sequence, Ring)."""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch

__all__ = ["Ring", "ring_attention"]

# A block's mask: (b, 1, c, c) bool (true: attend), None (all of it), or False (none: skipped).
BlockMask = Callable[[int, int], "torch.Tensor | None | bool"]


@dataclasses.dataclass(frozen=True)
class Ring:
    """This rank's ring: the ranks of `comm` in ring order (`members`, each holding the next run of the
    sequence) and its place among them."""

    members: tuple[int, ...]
    index: int

    @property
    def size(self) -> int:
        return len(self.members)


def _shift(x: torch.Tensor, comm, ring: Ring, label: str) -> torch.Tensor:
    """`x` (rows along dim 0) sent to the next rank of the ring; the previous rank's returned. An
    all-to-all with one destination, so every backend (threads, process groups) runs it."""
    n = comm.world_size
    send, recv = [0] * n, [0] * n
    send[ring.members[(ring.index + 1) % ring.size]] = x.shape[0]
    recv[ring.members[(ring.index - 1) % ring.size]] = x.shape[0]
    return comm.all_to_all(x.contiguous(), input_split_sizes=send, output_split_sizes=recv, label=label)


def _packed(*xs: torch.Tensor) -> torch.Tensor:
    """(b, heads, c, e) tensors side by side as one (b, heads, c·e...) buffer, to travel in one call
    (keys' and values' head sizes may differ)."""
    return torch.cat([x.flatten(2) for x in xs], dim=2)


def _unpacked(flat: torch.Tensor, like: list[torch.Tensor]) -> list[torch.Tensor]:
    pieces = flat.split([x.shape[2] * x.shape[3] for x in like], dim=2)
    return [p.reshape(x.shape) for p, x in zip(pieces, like)]


def _scores(q, kb, scale, mask):
    s = (q @ kb.transpose(-1, -2)) * scale
    return s if mask is None else s.masked_fill(~mask, float("-inf"))


def _finite(lse: torch.Tensor) -> torch.Tensor:
    """`lse` with -inf (rows that see no key) as 0, so that exp(score - lse) is 0 there, not NaN."""
    return torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)


def _grouped(x: torch.Tensor, heads: int) -> torch.Tensor:
    """kv heads repeated for the query heads that share each (grouped-query attention)."""
    return x if x.shape[1] == heads else x.repeat_interleave(heads // x.shape[1], dim=1)


def _summed(x: torch.Tensor, kv: int) -> torch.Tensor:
    """The gradient of `_grouped`: each kv head's query heads summed."""
    b, h, c, d = x.shape
    return x if h == kv else x.reshape(b, kv, h // kv, c, d).sum(2)


def _working(x: torch.Tensor) -> torch.Tensor:
    """16-bit blocks computed in float32, as SDPA's kernels accumulate (the log-sum-exp merge would
    lose the small blocks' weight in bf16); wider dtypes as they are."""
    return x.float() if x.dtype in (torch.float16, torch.bfloat16) else x


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, comm, ring: Ring, scale: float, block_mask: BlockMask):
        dtype, q = q.dtype, _working(q)
        h = q.shape[1]
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=q.dtype, device=q.device)
        out = torch.zeros(*q.shape[:-1], v.shape[-1], dtype=q.dtype, device=q.device)
        kb, vb = k, v
        for t in range(ring.size):
            j = (ring.index - t) % ring.size  # the source of the keys and values held at step t
            mask = block_mask(ring.index, j)
            if mask is not False:
                s = _scores(q, _grouped(_working(kb), h), scale, mask)
                lse_b = torch.logsumexp(s, -1)
                o_b = torch.exp(s - _finite(lse_b)[..., None]) @ _grouped(_working(vb), h)
                new = torch.logaddexp(lse, lse_b)
                out = out * torch.exp(lse - _finite(new))[..., None] + o_b * torch.exp(lse_b - _finite(new))[..., None]
                lse = new
            if t + 1 < ring.size:
                kb, vb = _unpacked(_shift(_packed(kb, vb), comm, ring, "ring attention k|v"), [k, v])
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.comm, ctx.ring, ctx.scale, ctx.block_mask, ctx.dtype = comm, ring, scale, block_mask, dtype
        return out.to(dtype)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors  # q, out and lse in the working dtype
        comm, ring, scale, h = ctx.comm, ctx.ring, ctx.scale, q.shape[1]
        dout = dout.to(out.dtype)
        delta = (dout * out).sum(-1, keepdim=True)
        dq = torch.zeros_like(q)
        # The keys and values travel with their gradients (in the working dtype), which come home
        # after a last shift.
        kb, vb = k, v
        dk, dv = (torch.zeros(x.shape, dtype=q.dtype, device=x.device) for x in (k, v))
        for t in range(ring.size):
            j = (ring.index - t) % ring.size
            mask = ctx.block_mask(ring.index, j)
            if mask is not False:
                kg, vg = _grouped(_working(kb), h), _grouped(_working(vb), h)
                p = torch.exp(_scores(q, kg, scale, mask) - _finite(lse)[..., None])
                ds = p * (dout @ vg.transpose(-1, -2) - delta)
                dq = dq + (ds @ kg) * scale
                dk = dk + _summed(ds.transpose(-1, -2) @ q * scale, k.shape[1])
                dv = dv + _summed(p.transpose(-1, -2) @ dout, k.shape[1])
            if t + 1 < ring.size and k.dtype == dk.dtype:  # one call where the dtypes allow
                kb, vb, dk, dv = _unpacked(_shift(_packed(kb, vb, dk, dv), comm, ring, "ring attention k|v|dk|dv"),
                                           [k, v, dk, dv])
            elif t + 1 < ring.size:
                kb, vb = _unpacked(_shift(_packed(kb, vb), comm, ring, "ring attention k|v"), [k, v])
                dk, dv = _unpacked(_shift(_packed(dk, dv), comm, ring, "ring attention dk|dv"), [dk, dv])
        dk, dv = _unpacked(_shift(_packed(dk, dv), comm, ring, "ring attention dk|dv"), [dk, dv])  # home
        return dq.to(ctx.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None


@torch.compiler.disable  # collectives of a thread world or process group: not traced
def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, comm, ring: Ring, block_mask: BlockMask,
                   scale: float | None = None) -> torch.Tensor:
    """Attention of this rank's run of queries q (b, h, c, d) over every run of keys and values of
    the ring (k, v (b, kv, c, d) here, this rank's): `block_mask(i, j)` masks run i's queries against
    run j's keys (False: skipped, no compute). Exact: the blocks merge by their log-sum-exp, and
    backward recomputes each block's probabilities from the saved log-sum-exp. Rows that see no key
    come out 0, with 0 gradients, as torch's SDPA."""
    scale = scale if scale is not None else q.shape[-1] ** -0.5
    return _RingAttention.apply(q, k, v, comm, ring, scale, block_mask)
