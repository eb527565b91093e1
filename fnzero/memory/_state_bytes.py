"""Per-rank model-state memory, counted exactly from a TrainState (`specs/sharding.md` §Memory,
§Frozen parameters; NVMe-stored shards: `specs/offload.md` §Parameters), and the ZeRO paper's
figures to compare it with (`zero_formula`; `ep_zero_formula`, `specs/mesh.md` §Expert parallelism
memory).
"""

from __future__ import annotations

import dataclasses
import resource
import sys

import optree
import torch

from .._state import TrainState
from ..sharding import is_placeholder, stored_bytes

__all__ = ["ModelStateBytes", "ep_zero_formula", "model_state_bytes", "peak_rss_bytes", "zero_formula"]


@dataclasses.dataclass(frozen=True)
class ModelStateBytes:
    params: int
    master: int
    optimizer: int
    grads: int
    frozen: int = 0  # requires_grad=False parameters, as held (shards at stage 3)
    stored: int = 0  # parameter shards (trainable and frozen) kept in NVMe files instead: not in `total`

    @property
    def total(self) -> int:
        return self.params + self.master + self.optimizer + self.grads + self.frozen


def _unique_bytes(tree, seen: set) -> int:
    total = 0
    for t in optree.tree_leaves(tree):
        if not isinstance(t, torch.Tensor) or t.dim() == 0 or is_placeholder(t):
            continue  # scalars (step counts) are not model state; a placeholder's values are in a store
        st = t.untyped_storage()
        key = (st.data_ptr(), t.device)
        if key in seen:
            continue
        seen.add(key)
        total += st.nbytes()
    return total


def model_state_bytes(state: TrainState, grad_dtype: torch.dtype | None = None) -> ModelStateBytes:
    """Bytes of model state this rank holds. Views share storage and are counted once, so an fp32
    run whose optimizer updates slices of the parameters shows no separate master copy."""
    plan = state.sharding.plan
    seen: set = set()
    params = _unique_bytes(state.params, seen)
    master = _unique_bytes(state.master, seen) if state.master is not None else 0
    optimizer = _unique_bytes(state.opt_state, seen)
    if grad_dtype is None:
        any_param = next(iter(state.params.values()), None)
        grad_dtype = any_param.dtype if any_param is not None else plan.param_dtype
    esize = torch.empty((), dtype=grad_dtype).element_size()
    grads = 0
    for u in plan.units:
        grads += (u.shard_numel if u.placement.grads else u.padded_numel) * esize
    frozen = _unique_bytes(state.frozen, seen)
    stored = stored_bytes(state.params) + stored_bytes(state.frozen)
    return ModelStateBytes(params=params, master=master, optimizer=optimizer, grads=grads, frozen=frozen, stored=stored)


def zero_formula(num_params: int, stage: int, world_size: int, mixed_precision: bool) -> float:
    """ZeRO model-state bytes per rank for Adam: fp32 16Ψ, 8Ψ+8Ψ/N, 4Ψ+12Ψ/N, 16Ψ/N; 16-bit
    with fp32 master 16Ψ, 4Ψ+12Ψ/N, 2Ψ+14Ψ/N, 16Ψ/N."""
    p, n = float(num_params), float(world_size)
    if mixed_precision:
        table = {0: 16 * p, 1: 4 * p + 12 * p / n, 2: 2 * p + 14 * p / n, 3: 16 * p / n}
    else:
        table = {0: 16 * p, 1: 8 * p + 8 * p / n, 2: 4 * p + 12 * p / n, 3: 16 * p / n}
    return table[stage]


def ep_zero_formula(dense_params: int, expert_params: int, stage: int, world_size: int, ep: int,
                    mixed_precision: bool) -> float:
    """Per-rank bytes of a model with experts split over `ep` expert-parallel ranks
    (`specs/mesh.md §Expert parallelism memory`): the dense parameters Ψ_d sharded by ZeRO over
    the `world_size` data-parallel ranks D, plus this rank's experts, Ψ_e / ep of the model's
    `expert_params` Ψ_e, sharded over the D / ep expert-data-parallel ranks holding the same ones:
    `zero_formula(Ψ_d, stage, D) + zero_formula(Ψ_e / ep, stage, D / ep)`.

    >>> ep_zero_formula(1000, 4000, 1, 4, 2, False) == zero_formula(1000, 1, 4, False) + zero_formula(2000, 1, 2, False)
    True
    """
    if ep < 1 or world_size % ep:
        raise ValueError(f"expert-parallel size {ep} must divide the data-parallel world size {world_size}")
    return (zero_formula(dense_params, stage, world_size, mixed_precision)
            + zero_formula(expert_params / ep, stage, world_size // ep, mixed_precision))


def peak_rss_bytes() -> int:
    """This process's peak resident set size so far."""
    r = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return r if sys.platform == "darwin" else r * 1024
