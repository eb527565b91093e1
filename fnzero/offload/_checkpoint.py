"""Checkpoints of ZeRO-Infinity runs: the optimizer state in the NVMe store, seen as the state the
same run would hold with `offload_optimizer.device: cpu`, so a checkpoint is an ordinary one
(`specs/offload.md` §Checkpoints)."""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch

from ..sharding import optimizer_view, is_placeholder
from .._state import TrainState
from ._layout import NvmeOptState

__all__ = ["is_nvme", "materialize", "like_in_memory", "restore_into_store"]


def is_nvme(state: TrainState) -> bool:
    return isinstance(state.opt_state, NvmeOptState)


def _master_in_params(state: TrainState) -> bool:
    # fp32 parameters are their own master (as in a CPU-offload run, where master is None).
    return next(iter(state.params.values()), torch.empty(0)).dtype == torch.float32


def _in_memory(state: TrainState, tensor: Callable[[str, str], torch.Tensor]) -> TrainState:
    """`state` in the CPU-offload layout, each unit's master/moment being `tensor(unit, kind)`;
    parameters held in the store (`offload_param: nvme`) are its master in the compute dtype. The
    optimizer's state is its own structure (`StoreLayout`), the resident leaves copied."""
    st = state.opt_state
    store = st.store
    resident = tuple(r.clone() if isinstance(r, torch.Tensor) else r for r in st.resident)
    new_opt = st.layout.assemble(tensor, resident)
    master = None if _master_in_params(state) else {u: tensor(u, "master") for u in store.units}
    params = {
        u: (master[u] if master is not None else tensor(u, "master")).to(p.dtype) if is_placeholder(p) else p
        for u, p in state.params.items()
    }
    return state.replace(params=params, opt_state=new_opt, master=master)


def materialize(state: TrainState) -> TrainState:
    """`state` with the store's moments (and, for 16-bit parameters, its fp32 master) in memory."""
    return _in_memory(state, state.opt_state.store.read)


def like_in_memory(like: TrainState) -> TrainState:
    """The layout `materialize` gives, with uninitialized tensors: what `load` fills."""
    numel = like.opt_state.store.units
    return _in_memory(like, lambda unit, kind: torch.empty(numel[unit], dtype=torch.float32))


def restore_into_store(loaded: TrainState, like: TrainState) -> TrainState:
    """Write a loaded in-memory state's master and moments into `like`'s store; the NVMe state."""
    store = like.opt_state.store
    plan, rank = like.sharding.plan, like.sharding.rank
    master = loaded.master if loaded.master is not None else optimizer_view(plan, rank, loaded.params, True)
    files, resident = like.opt_state.layout.split(loaded.opt_state)
    count = int(loaded.step)  # the optimizer steps applied, as the store counts them
    with store.updating("checkpoint load", count):  # every unit, or a store that refuses all later use
        for u in store.units:
            store.write(u, "master", master[u])
            for kind in store.kinds[1:]:
                store.write(u, kind, files[(kind, u)])
    store.set_step(count)
    # Parameters held in the store go back to placeholders: their values are the master just written.
    params = {u: like.params[u] if is_placeholder(like.params[u]) else p for u, p in loaded.params.items()}
    return loaded.replace(params=params, master=None,
                          opt_state=dataclasses.replace(like.opt_state, count=torch.tensor(count, dtype=torch.int64),
                                                        resident=resident))
