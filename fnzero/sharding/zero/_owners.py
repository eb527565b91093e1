"""What of the parameters this rank's optimizer updates: by each unit's placement (`optimizer_view`),
and for an optimizer that reads whole tensors, the whole-tensor partition (`specs/optim.md` §Muon):
each such parameter's owning dp rank, and the two all-to-alls to the owners and back."""

from __future__ import annotations

import dataclasses
import functools

import torch

from ..._errors import ShardingError
from ._gather import unit_views
from ._plan import ParamSlot, ShardPlan, UnitPlan

__all__ = ["optimizer_view", "WholeTensorPartition", "whole_tensor_partition", "param_pieces", "to_owners", "from_owners"]


def optimizer_view(plan: ShardPlan, rank: int, params: dict[str, torch.Tensor], elementwise: bool = True):
    """What the optimizer updates when params are the master copy, by each unit's placement: the
    whole unit where the optimizer state is replicated (per-parameter views unless `elementwise`:
    Lamb reads whole tensors), the shard where parameters are sharded, else this rank's slice."""
    out = {}
    for u in plan.units:
        t = params[u.name]
        if not u.placement.optimizer:
            if elementwise:
                out[u.name] = t
            else:
                out.update(unit_views(u, t))
        elif u.placement.params:
            out[u.name] = t
        else:
            lo, hi = u.shard_range(rank)
            out[u.name] = t[lo:hi]
    return out


@dataclasses.dataclass(frozen=True)
class WholeTensorPartition:
    """`owners`: (parameter name, owning dp rank) for each whole-tensor parameter, in plan order."""

    plan: ShardPlan
    owners: tuple[tuple[str, int], ...]

    @functools.cached_property
    def _slots(self) -> dict[str, tuple[UnitPlan, ParamSlot]]:
        return {s.name: (u, s) for u in self.plan.units for s in u.slots}

    @functools.cached_property
    def owner_of(self) -> dict[str, int]:
        return dict(self.owners)

    def owned(self, rank: int) -> list[str]:
        """The parameters `rank` owns, in plan order."""
        return [n for n, r in self.owners if r == rank]

    def load(self, rank: int) -> int:
        """Elements of the parameters `rank` owns."""
        return sum(self._slots[n][1].numel for n in self.owned(rank))

    def piece(self, name: str, rank: int) -> tuple[int, int]:
        """Offsets `[lo, hi)` into parameter `name` of rank's shard's piece ((0, 0) when none)."""
        u, s = self._slots[name]
        lo, hi = u.real_range(rank)
        a, b = max(lo, s.offset), min(hi, s.offset + s.numel)
        return (a - s.offset, b - s.offset) if a < b else (0, 0)

    def exchange_numel(self, rank: int) -> int:
        """Elements `rank` sends in one step's two all-to-alls (`state/_owner_update.py`): gradient and
        value of its pieces of others' matrices, then its own matrices' other pieces back."""
        return sum(2 * _size(self.piece(n, rank)) if owner != rank
                   else self._slots[n][1].numel - _size(self.piece(n, rank)) for n, owner in self.owners)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._slots[name][1].shape


@functools.lru_cache(maxsize=16)
def whole_tensor_partition(plan: ShardPlan, names: frozenset[str]) -> WholeTensorPartition:
    """Owners for `names` (trainable parameters of `plan`) over the plan's data-parallel ranks: largest
    first onto the least-loaded rank (deterministic, within Graham's 4/3 of the best balance)."""
    order = [(u, s) for u in plan.units for s in u.slots if s.name in names]
    experts = [s.name for u, s in order if u.is_expert]
    if experts:
        raise ShardingError(
            f"the whole-tensor optimizer partition covers dense units only; {experts[0]!r} is an expert's "
            "(expert parallelism): give experts' matrices to an elementwise optimizer, or train at ZeRO stage 0"
        )
    loads = [0] * plan.world_size
    owner: dict[str, int] = {}
    for i in sorted(range(len(order)), key=lambda i: (-order[i][1].numel, i)):
        rank = min(range(plan.world_size), key=lambda r: (loads[r], r))
        owner[order[i][1].name] = rank
        loads[rank] += order[i][1].numel
    return WholeTensorPartition(plan, tuple((s.name, owner[s.name]) for _, s in order))


def param_pieces(plan: ShardPlan, rank: int, by_unit: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Each parameter's piece of this rank's flat shards (`by_unit`: unit name -> shard), as 1-D views
    (empty where the shard holds none of it), in plan order."""
    out = {}
    for u in plan.units:
        lo, hi = u.real_range(rank)
        shard = by_unit[u.name]
        for s in u.slots:
            a, b = max(lo, s.offset), min(hi, s.offset + s.numel)
            out[s.name] = shard[a - lo: b - lo] if a < b else shard[:0]
    return out


def to_owners(comm, part: WholeTensorPartition, channels: list[dict[str, torch.Tensor]],
              like: torch.Tensor) -> list[dict[str, torch.Tensor]]:
    """Each rank's pieces (`channels`: trees of 1-D pieces in `like`'s dtype and device) to their owners
    in one all-to-all: for each channel, owned name -> the whole tensor on this rank."""
    rank, world = comm.rank, comm.world_size
    send, ins = [], []
    for dest in range(world):
        parts = [ch[n] for n in part.owned(dest) for ch in channels]
        send.extend(parts)
        ins.append(sum(p.numel() for p in parts))
    mine = part.owned(rank)
    outs = [len(channels) * sum(_size(part.piece(n, src)) for n in mine) for src in range(world)]
    got = _exchange(comm, send, ins, outs, like)
    wholes: list[dict[str, list[torch.Tensor]]] = [{n: [] for n in mine} for _ in channels]
    at = 0
    for src in range(world):
        for n in mine:
            k = _size(part.piece(n, src))
            for whole in wholes:
                whole[n].append(got[at: at + k])
                at += k
    return [{n: torch.cat(ps).view(part.shape(n)) for n, ps in whole.items()} for whole in wholes]


def from_owners(comm, part: WholeTensorPartition, whole: dict[str, torch.Tensor], like: torch.Tensor) -> dict[str, torch.Tensor]:
    """The inverse of `to_owners` for one channel (`whole`: owned name -> tensor): name -> this rank's
    1-D piece of every whole-tensor parameter. `like`: of the dtype and device the pieces travel in."""
    rank, world = comm.rank, comm.world_size
    mine = part.owned(rank)
    send, ins = [], []
    for dest in range(world):
        parts = [whole[n].reshape(-1)[slice(*part.piece(n, dest))] for n in mine]
        send.extend(parts)
        ins.append(sum(p.numel() for p in parts))
    outs = [sum(_size(part.piece(n, rank)) for n in part.owned(src)) for src in range(world)]
    got = _exchange(comm, send, ins, outs, like)
    out, at = {}, 0
    for src in range(world):
        for n in part.owned(src):
            k = _size(part.piece(n, rank))
            out[n] = got[at: at + k]
            at += k
    return out


def _size(rng: tuple[int, int]) -> int:
    return rng[1] - rng[0]


def _exchange(comm, send: list[torch.Tensor], ins: list[int], outs: list[int], like) -> torch.Tensor:
    buf = torch.cat(send) if send else like.new_zeros(0)
    return comm.all_to_all(buf, input_split_sizes=ins, output_split_sizes=outs, label="whole-tensor partition")
