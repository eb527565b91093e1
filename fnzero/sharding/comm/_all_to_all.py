"""All-to-all's split sizes (torch.distributed's `all_to_all_single` semantics): checked on this rank,
resolved to explicit lists, agreed across ranks (`specs/collectives.md` §All-to-all). Every
`Collectives` calls these, so a bad call is the same clear error everywhere, never a hang."""

from __future__ import annotations

from typing import Any, Sequence

import torch

from ..._errors import DistributedError

__all__ = ["resolve_splits", "check_agreement", "sent_numel", "gathered_all_to_all"]


def _sizes(name: str, sizes: Sequence[int] | None, world: int, rank: int) -> list[int] | None:
    if sizes is None:
        return None
    out = [int(s) for s in sizes]
    if len(out) != world:
        raise DistributedError(f"rank {rank}: all_to_all {name} has {len(out)} entries, the world has {world} ranks",
                               ranks=(rank,))
    if any(s < 0 for s in out):
        raise DistributedError(f"rank {rank}: all_to_all {name} {out} has a negative size", ranks=(rank,))
    return out


def _equal(dim0: int, world: int, rank: int, what: str) -> list[int]:
    if dim0 % world:
        raise DistributedError(f"rank {rank}: all_to_all {what} has {dim0} rows along dim 0, not divisible by the "
                               f"world size {world}; give split sizes", ranks=(rank,))
    return [dim0 // world] * world


def resolve_splits(comm: Any, tensor: torch.Tensor, input_split_sizes: Sequence[int] | None,
                   output_split_sizes: Sequence[int] | None) -> tuple[list[int], list[int]]:
    """(input sizes, output sizes) as explicit lists, after checking this rank's call; output sizes
    not given but input sizes given are learnt by one all-to-all through `comm` (§All-to-all)."""
    n, rank = comm.world_size, comm.rank
    if tensor.dim() == 0:
        raise DistributedError(f"rank {rank}: all_to_all needs a tensor with a dim 0, got a scalar", ranks=(rank,))
    if not tensor.is_contiguous():
        raise DistributedError(f"rank {rank}: all_to_all needs a contiguous tensor (shape {tuple(tensor.shape)}, "
                               f"strides {tensor.stride()}); call .contiguous() first", ranks=(rank,))
    ins = _sizes("input_split_sizes", input_split_sizes, n, rank)
    outs = _sizes("output_split_sizes", output_split_sizes, n, rank)
    dim0 = tensor.shape[0]
    if ins is None:
        ins = _equal(dim0, n, rank, "input")
    elif sum(ins) != dim0:
        raise DistributedError(f"rank {rank}: all_to_all input_split_sizes {ins} sum to {sum(ins)}, the tensor has "
                               f"{dim0} rows along dim 0", ranks=(rank,))
    if outs is None:
        if input_split_sizes is None:
            outs = list(ins)
        else:
            mine = torch.tensor(ins, dtype=torch.int64, device=tensor.device)
            outs = comm.all_to_all(mine, input_split_sizes=[1] * n, output_split_sizes=[1] * n).tolist()
    return ins, outs


def check_agreement(calls: Sequence[tuple[torch.dtype | None, tuple[int, ...] | None, list[int], list[int]]]) -> None:
    """Every rank's (dtype, shape past dim 0, input sizes, output sizes) for one all-to-all: raise
    one `DistributedError` naming the ranks that disagree (a dtype or a row shape unlike rank 0's,
    or a rank expecting another number of rows than its peer sends). None skips a field."""
    dtype0, row0 = calls[0][0], calls[0][1]
    for r, (dtype, row, _, _) in enumerate(calls):
        if dtype is not None and dtype != dtype0:
            raise DistributedError(f"all_to_all: rank {r} sends {dtype}, rank 0 sends {dtype0}", ranks=(0, r))
        if row is not None and row != row0:
            raise DistributedError(f"all_to_all: rank {r}'s rows have shape {list(row)}, rank 0's {list(row0)}",
                                   ranks=(0, r))
    for src, (_, _, ins, _) in enumerate(calls):
        for dst, (_, _, _, outs) in enumerate(calls):
            if ins[dst] != outs[src]:
                raise DistributedError(f"all_to_all: rank {src} sends {ins[dst]} rows to rank {dst}, which expects "
                                       f"{outs[src]} from it (input_split_sizes of rank {src}: {ins}; "
                                       f"output_split_sizes of rank {dst}: {outs})", ranks=(src, dst))


def sent_numel(tensor: torch.Tensor, ins: Sequence[int], rank: int) -> int:
    """Elements that leave this rank: every chunk but the one it keeps."""
    return (sum(ins) - ins[rank]) * tensor.shape[1:].numel()


def gathered_all_to_all(comm: Any, tensor: torch.Tensor, ins: list[int], outs: list[int]) -> torch.Tensor:
    """All-to-all out of two all-gathers, for a backend that defines only the five blocking calls
    (`CollectivesBase`): every rank gathers every rank's split sizes and input, padded to the
    largest, and keeps the chunks addressed to it. N times the bytes of a real all-to-all."""
    n, rank = comm.world_size, comm.rank
    sizes = comm.all_gather(torch.tensor(ins + outs, dtype=torch.int64, device=tensor.device)).view(n, 2 * n).tolist()
    check_agreement([(None, None, s[:n], s[n:]) for s in sizes])
    most = max(sum(s[:n]) for s in sizes)
    padded = tensor.new_zeros((most, *tensor.shape[1:]))
    padded[: tensor.shape[0]] = tensor
    everyone = comm.all_gather(padded).view(n, most, *tensor.shape[1:])
    chunks = [everyone[src].split(sizes[src][:n] + [most - sum(sizes[src][:n])])[rank] for src in range(n)]
    return torch.cat(chunks) if chunks else tensor.new_empty((0, *tensor.shape[1:]))
