"""Which ranks share the checkpoint directory, and saving when they do not: several groups of
ranks that see each other's files are refused, or each commits a whole checkpoint of its own
(`specs/checkpoint-format.md` §Directories that are not shared).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os

import torch

from .._errors import CheckpointError
from . import _format as F

__all__ = ["Groups", "discover_groups", "exchange_parts", "merge_for_group"]


@dataclasses.dataclass(frozen=True)
class Groups:
    """Ranks that see each other's files in the checkpoint directory, each group sorted."""

    groups: tuple[tuple[int, ...], ...]

    @property
    def shared(self) -> bool:
        return len(self.groups) == 1

    def of(self, rank: int) -> tuple[int, ...]:
        return next(g for g in self.groups if rank in g)

    def leader(self, rank: int) -> int:
        return self.of(rank)[0]

    def describe(self) -> str:
        return "; ".join(f"ranks {list(g)} see each other's files" for g in self.groups)


def _marker(rank: int) -> str:
    return f".here.{rank:05d}"


def discover_groups(comm, staging: str, rank: int, world: int, device: torch.device) -> Groups:
    """Make `staging` and find the groups of ranks that share it (every rank calls it; two small
    collectives, reached by every rank even when its directory cannot be made)."""
    if world == 1:
        os.makedirs(staging, exist_ok=True)
        return Groups(((0,),))
    try:
        os.makedirs(staging, exist_ok=True)
        with open(os.path.join(staging, _marker(rank)), "wb"):
            pass
        failed = ""
    except OSError as e:  # still take part in both collectives: no rank may wait for this one
        failed = e.strerror or type(e).__name__
    comm.barrier()
    seen = [os.path.exists(os.path.join(staging, _marker(r))) for r in range(world)]
    mask = torch.tensor(seen + [bool(failed)], dtype=torch.int64)
    masks = comm.all_gather(mask.to(device)).cpu().view(world, world + 1)
    broken = [r for r in range(world) if masks[r, world]]
    if broken:
        raise CheckpointError(f"rank(s) {broken} could not write into the checkpoint directory "
                              f"{os.path.dirname(staging)!r}{f' ({failed})' if failed else ''}; nothing was saved")
    masks = masks[:, :world]
    with contextlib.suppress(FileNotFoundError):  # every rank has looked (the all-gather needed all)
        os.remove(os.path.join(staging, _marker(rank)))
    sees = [tuple(int(s) for s in torch.nonzero(masks[r]).flatten()) for r in range(world)]
    groups = tuple(sorted(set(sees)))
    if any(r not in sees[r] for r in range(world)) or any(sees[s] != sees[r] for r in range(world) for s in sees[r]):
        raise CheckpointError(
            f"the ranks see the checkpoint directory {os.path.dirname(staging)!r} inconsistently (rank r sees the "
            f"files of ranks {dict(enumerate(map(list, sees)))}): a filesystem whose view differs between ranks "
            "cannot hold a checkpoint"
        )
    return Groups(groups)


def exchange_parts(comm, part: dict, world: int, device: torch.device) -> list[dict]:
    """Every rank's index part, on every rank: two all-gathers (sizes, then padded msgpack bytes)."""
    raw = F.pack(part)
    sizes = comm.all_gather(torch.tensor([len(raw)], dtype=torch.int64, device=device)).cpu().tolist()
    buf = torch.zeros(max(sizes), dtype=torch.uint8)
    buf[: len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    every = comm.all_gather(buf.to(device)).cpu().view(world, max(sizes))
    return [F.unpack(bytes(every[r, : sizes[r]].numpy().tobytes()), f"rank {r}'s index part") for r in range(world)]


def merge_for_group(parts: list[dict], head: dict, groups: Groups, rank: int, numel: dict[str, int]) -> dict:
    """The index a group commits: for each tensor the group's own segments when they cover it
    (a replicated tensor, written by the group in parts), else every rank's (a sharded tensor,
    one piece per owner)."""
    group = groups.of(rank)
    tensors: dict[str, dict] = {}
    for key in {k for p in parts for k in p["tensors"]}:
        own = [s for r in group for s in parts[r]["tensors"].get(key, {}).get("segments", [])]
        covered = sum(s[3] - s[2] for s in own)
        segs = own if covered >= numel[key] else [s for p in parts for s in p["tensors"].get(key, {}).get("segments", [])]
        meta = next(p["tensors"][key] for p in parts if key in p["tensors"])
        tensors[key] = {k: v for k, v in meta.items() if k != "segments"} | {"segments": sorted(segs, key=lambda s: s[2])}
    return dict(head, files=[p["size"] for p in parts], rng=[p["rng"] for p in parts], tensors=tensors,
                node_local={"groups": [list(g) for g in groups.groups]})
