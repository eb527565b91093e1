"""The optimizer state of a ZeRO-Infinity run (`NvmeOptState`), and where each of its leaves lives:
each leaf that mirrors a unit's master is a *kind* of the store, one file holding every unit; the
others (step counts) stay in memory, `NvmeOptState.resident`. The split is read from the optimizer's
own `init`, so any elementwise `Optimizer` streams (`specs/offload.md` §Step (NVMe))."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import optree
import torch

from .._errors import ShardingError
from ._nvme import NvmeOptimizerStore

__all__ = ["NvmeOptState", "StoreLayout", "layout_of", "CHUNK"]

CHUNK = "chunk"  # the one unit key of the state a sub-group is updated with


@dataclasses.dataclass(frozen=True)
class StoreLayout:
    """The optimizer state's structure over every unit (`treedef`, what checkpoints see) and over
    one sub-group (`chunk_treedef`, what a streamed step runs); per leaf, ("file", kind, unit) or
    ("memory", index into the resident leaves)."""

    kinds: tuple[str, ...]
    treedef: Any
    slots: tuple[tuple, ...]
    chunk_treedef: Any
    chunk_slots: tuple[tuple, ...]
    num_resident: int

    def assemble(self, per_unit: Callable[[str, str], torch.Tensor], resident: tuple) -> Any:
        """The whole state: file leaves from `per_unit(unit, kind)`, the others from `resident`."""
        return optree.tree_unflatten(self.treedef, [per_unit(s[2], s[1]) if s[0] == "file" else resident[s[1]]
                                                    for s in self.slots])

    def split(self, state: Any) -> tuple[dict[tuple[str, str], torch.Tensor], tuple]:
        """({(kind, unit): tensor}, resident leaves) of a whole state of this layout."""
        leaves = optree.tree_leaves(state, none_is_leaf=True)
        if len(leaves) != len(self.slots):
            raise ShardingError(f"the optimizer state has {len(leaves)} leaves where the NVMe store's layout has "
                                f"{len(self.slots)}: a state of another optimizer?")
        return _parts(self.slots, leaves, self.num_resident, lambda s: (s[1], s[2]))

    def chunk_state(self, chunks: dict[str, torch.Tensor], resident: tuple) -> Any:
        """The state of one sub-group: its kinds' chunks, and copies of the resident leaves (an
        in-place update advances them once per sub-group; the step takes them from one probe)."""
        return optree.tree_unflatten(self.chunk_treedef, [chunks[s[1]] if s[0] == "file" else _copy(resident[s[1]])
                                                          for s in self.chunk_slots])

    def chunk_parts(self, state: Any) -> tuple[dict[str, torch.Tensor], tuple]:
        """({kind: chunk}, resident leaves) of a sub-group's state."""
        leaves = optree.tree_leaves(state, none_is_leaf=True)
        return _parts(self.chunk_slots, leaves, self.num_resident, lambda s: s[1])


@optree.dataclasses.dataclass(frozen=True, eq=False, namespace="")
class NvmeOptState:
    """`count`: steps applied through the store (0-dim int64). `store`: the per-rank files holding
    the fp32 master weights and every per-unit leaf of the optimizer's state (static). `resident`:
    the state's other leaves (its step counts), in memory. `layout`: its `StoreLayout` (static).
    `holds_params`: `offload_param: nvme`, stage-3 parameter shards are read from the store's master
    file and `TrainState.params` holds placeholders for them (static). The files are updated in
    place, so only the newest state can take a step (`specs/offload.md` §Step (NVMe), "Purity")."""

    count: torch.Tensor
    store: NvmeOptimizerStore = optree.dataclasses.field(pytree_node=False)
    resident: tuple = ()
    layout: Any = optree.dataclasses.field(pytree_node=False, default=None)
    holds_params: bool = optree.dataclasses.field(pytree_node=False, default=False)


def _parts(slots, leaves: list, num_resident: int, key) -> tuple[dict, tuple]:
    """({key(slot): leaf} of the file slots, the resident leaves in their order)."""
    files, resident = {}, [None] * num_resident
    for s, t in zip(slots, leaves):
        if s[0] == "file":
            files[key(s)] = t
        else:
            resident[s[1]] = t
    return files, tuple(resident)


def _copy(x):
    return x.clone() if isinstance(x, torch.Tensor) else x


def _kind(accessor, unit: str) -> str | None:
    """The leaf's path without its unit key ("exp_avg", "0.mu"), or None when no entry is `unit`."""
    names, found = [], False
    for e in accessor:
        if isinstance(e, optree.MappingEntry) and e.entry == unit:
            found = True
            continue
        names.append(str(getattr(e, "field", None) or e.entry))
    return ".".join(names) if found else None


def _slots(opt, units: list[str]) -> tuple[Any, list[tuple], list]:
    """(treedef, slots, resident leaves) of `opt`'s state over `units`, probed with empty and
    one-element masters: a leaf that follows the master's size and sits under a unit key is a
    file; every other leaf stays in memory, its value the probe's."""
    empty = opt.init({u: torch.zeros(0) for u in units})
    one = opt.init({u: torch.zeros(1) for u in units})
    leaves, treedef = optree.tree_flatten(empty, none_is_leaf=True)
    ones = optree.tree_leaves(one, none_is_leaf=True)
    accessors = optree.tree_accessors(empty, none_is_leaf=True)
    slots, resident = [], []
    for leaf, leaf1, acc in zip(leaves, ones, accessors):
        kinds = [k for k in (_kind(acc, u) for u in units) if k is not None]
        per_unit = isinstance(leaf, torch.Tensor) and leaf.numel() == 0 and leaf1.numel() == 1 and kinds
        if per_unit:
            unit = next(u for u in units if _kind(acc, u) is not None)
            slots.append(("file", kinds[0], unit))
        else:
            slots.append(("memory", len(resident)))
            resident.append(leaf)
    return treedef, slots, resident


def layout_of(opt, units: list[str]) -> tuple[StoreLayout, tuple]:
    """The store layout of elementwise optimizer `opt` over `units`, and its initial resident
    leaves (the step counts at zero)."""
    treedef, slots, resident = _slots(opt, units)
    chunk_treedef, chunk_slots, _ = _slots(opt, [CHUNK])
    kinds = tuple(dict.fromkeys(s[1] for s in chunk_slots if s[0] == "file"))
    for kind in kinds:
        if not kind.replace(".", "").replace("_", "").isalnum():
            raise ShardingError(f"the optimizer state's leaf {kind!r} cannot name an NVMe store file")
    if {s[1] for s in slots if s[0] == "file"} - set(kinds) or len(resident) != sum(s[0] == "memory" for s in chunk_slots):
        raise ShardingError("the optimizer's state is not the same for every unit; an NVMe store keeps one file per "
                            "kind of state over every unit")
    return StoreLayout(kinds, treedef, tuple(slots), chunk_treedef, tuple(chunk_slots), len(resident)), tuple(resident)
