"""Ulysses: one all-to-all trades each rank's run of the sequence for a share of the heads over the
whole sequence (or over its group's runs), attention runs there, and a second trades back
(`specs/mesh.md` §Sequence)."""

from __future__ import annotations

from typing import Callable

import torch

from ..comm import all_to_all_grad

__all__ = ["ulysses_attention", "ulysses_size"]


def ulysses_size(sp: int, heads: int, kv_heads: int) -> int:
    """How many of `sp` ranks trade heads (Ulysses), the rest forming rings: the largest divisor of sp
    that divides the heads and divides or is divided by the kv heads (DeepSpeed's rule for kv heads
    fewer than the ranks: they are repeated)."""
    return max(u for u in range(1, sp + 1)
               if sp % u == 0 and heads % u == 0 and (kv_heads % u == 0 or u % kv_heads == 0))


# Not traced: its collectives are a thread world's or a process group's (as `all_to_all_grad`), and
# one graph break around the whole exchange keeps the ranks' collectives in one order.
@torch.compiler.disable
def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, comm,
                      attend: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
                      group: tuple[int, int] | None = None) -> torch.Tensor:
    """`attend` over the group's runs of the sequence, q (b, h, s/sp, d) and k, v (b, kv, s/sp, d)
    being this rank's run; returns (b, h, s/sp, d). `group`: (first rank, size) of this rank's
    Ulysses group among `comm`'s ranks (adjacent; default all of them). q, k and v travel in one
    all-to-all (packed per destination), the output in a second; both are differentiable. kv heads
    fewer than the group are first repeated, so each rank gets the one its query heads use."""
    first, n = group if group is not None else (0, comm.world_size)
    b, h, s_local = q.shape[:3]
    if k.shape[1] < n:  # rank r's query heads all use kv head r // (n / kv): repeated, it is the r-th
        k, v = (x.repeat_interleave(n // x.shape[1], dim=1) for x in (k, v))
    splits = None if n == comm.world_size else [int(first <= r < first + n) for r in range(comm.world_size)]
    # Per destination, its heads of q, k and v flattened side by side (v's head size may differ).
    parts = [(x, x.shape[1] // n, x.shape[-1]) for x in (q, k, v)]
    packed = torch.cat([x.reshape(b, n, per, s_local * e).transpose(0, 1).reshape(n, b, -1) for x, per, e in parts], 2)
    got = all_to_all_grad(packed.contiguous(), comm, splits, splits, label="sequence-parallel q|k|v")
    # got[j]: the group's j-th rank's run of tokens for this rank's heads, in sequence order.
    pieces = got.split([per * s_local * e for _, per, e in parts], dim=2)
    whole = [p.reshape(n, b, per, s_local, e).permute(1, 2, 0, 3, 4).reshape(b, per, n * s_local, e)
             for p, (_, per, e) in zip(pieces, parts)]
    out = attend(*whole)
    e = out.shape[-1]
    back = out.reshape(b, h // n, n, s_local, e).permute(2, 0, 1, 3, 4).contiguous()
    mine = all_to_all_grad(back, comm, splits, splits, label="sequence-parallel output")
    # mine[j]: the group's j-th rank's heads for this rank's tokens.
    return mine.transpose(0, 1).reshape(b, h, s_local, e)
