"""Ulysses: one all-to-all trades each rank's run of the sequence for a share of the heads over the
whole sequence, attention runs there, and a second trades back (`specs/mesh.md` §Sequence)."""

from __future__ import annotations

from typing import Callable

import torch

from ..._errors import ShardingError
from ..comm import all_to_all_grad

__all__ = ["ulysses_attention", "check_heads_for_ulysses"]


def check_heads_for_ulysses(heads: int, kv_heads: int, sp: int, where: str = "") -> None:
    """The head counts Ulysses can spread over `sp` ranks: every rank takes heads/sp query heads, and
    kv heads divide by sp or are replicated up to it (DeepSpeed's rule); a ShardingError otherwise."""
    if heads % sp or (kv_heads % sp and sp % kv_heads):
        kv = f" and {kv_heads} key/value heads" if kv_heads != heads else ""
        raise ShardingError(f"{where}{heads} attention heads{kv} do not spread over {sp} sequence-parallel ranks: "
                            f"Ulysses needs the heads divisible by {sp} and the key/value heads dividing or divided "
                            "by it; ring attention, which has no such rule, is not in fnzero yet: use a "
                            "sequence_parallel_size that fits the heads")


# Not traced: its collectives are a thread world's or a process group's (as `all_to_all_grad`), and
# one graph break around the whole exchange keeps the ranks' collectives in one order.
@torch.compiler.disable
def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, comm,
                      attend: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """`attend` over the whole sequence, q (b, h, s/sp, d) and k, v (b, kv, s/sp, d) being this
    rank's run of the tokens; returns (b, h, s/sp, d). q, k and v travel in one all-to-all (packed
    per destination), the output in a second; both are differentiable. kv heads fewer than the
    ranks are first repeated so that each rank gets the one its query heads use."""
    n = comm.world_size
    b, h, s_local, d = q.shape
    check_heads_for_ulysses(h, k.shape[1], n)
    if k.shape[1] < n:  # rank r's query heads all use kv head r // (n / kv): repeated, it is the r-th
        k, v = (x.repeat_interleave(n // x.shape[1], dim=1) for x in (k, v))
    hq, hkv = h // n, k.shape[1] // n
    packed = torch.cat([x.reshape(b, n, per, s_local, d) for x, per in ((q, hq), (k, hkv), (v, hkv))], dim=2)
    got = all_to_all_grad(packed.transpose(0, 1).contiguous(), comm, label="sequence-parallel q|k|v")
    # got[j]: source rank j's run of tokens for this rank's heads, in sequence order.
    whole = got.permute(1, 2, 0, 3, 4).reshape(b, hq + 2 * hkv, n * s_local, d)
    out = attend(*whole.split([hq, hkv, hkv], dim=1))
    back = out.reshape(b, hq, n, s_local, d).permute(2, 0, 1, 3, 4).contiguous()
    mine = all_to_all_grad(back, comm, label="sequence-parallel output")
    # mine[j]: rank j's heads for this rank's tokens.
    return mine.transpose(0, 1).reshape(b, h, s_local, d)
