"""The reduced gradients' global norm and the loss over every rank, and the one factor that
unscales and clips them (`gradient_clipping`): the rung between the gradients (`_grads.py`) and
the optimizer (`_update.py`). Numbers are floats eagerly and 0-dim tensors inside the whole-step
graph, so each rule is written once for both (`specs/sharding.md` §Step)."""

from __future__ import annotations

import math

import torch

from ..sharding import UnitPlan
from ._setup import HALF_DTYPES, StepSetup

__all__ = ["unscale_factor", "norm_and_loss", "clip_norm", "clip_coefficient", "clip_factor"]


def unscale_factor(prediv: float, n: int, k: int, scale):
    """What the reduced gradients (sums over n ranks and k micro-batches of gradients of the loss
    times `scale`, each divided by `prediv`) are multiplied by to become the mean gradient; `scale`
    is a tensor in a graph, so a new loss scale does not recompile."""
    return prediv / (n * k * scale)




def norm_and_loss(units: tuple[UnitPlan, ...], grads: dict[str, torch.Tensor], inv, loss_sum: torch.Tensor,
                  mesh, device: torch.device, local: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(global squared gradient norm, loss summed over ranks) over the state's `mesh` (a
    `StateMesh`): `_norm_and_loss` on this rank's units over its data axis, then, with a pipeline
    axis, summed over the stages (each holds other layers; only the last has a loss): one more
    all-reduce of two numbers. Expert units are replicated over the expert-data-parallel ranks
    (`mesh.expert_data`). MiCS's replicas hold the same reduced shards as the other shard groups,
    so the norm is whole within the data axis and only the loss is summed over them, one more
    all-reduce of one number.
    `local`: the gradients are each rank's own (not reduced); the norm is then the mean of the
    ranks' norms, DeepSpeed's fp32 `clip_grad_norm_` (which all-reduces each rank's norm / ranks),
    and every rank agrees on it (the overflow verdict with it: non-finite where any rank's is)."""
    norm_sq, loss = _norm_and_loss(units, grads, inv, loss_sum, mesh.data, device, mesh.tp, mesh.expert_data, local)
    replicas = mesh.replicas
    if replicas is not None and replicas.world_size > 1:
        loss = replicas.all_reduce(loss.reshape(1))[0]
    pp = mesh.pp.comm if mesh.pp is not None else None
    if pp is None or pp.world_size == 1:
        return norm_sq, loss
    both = pp.all_reduce(torch.stack([norm_sq, loss]))
    return both[0], both[1]


def _norm_and_loss(units: tuple[UnitPlan, ...], grads: dict[str, torch.Tensor], inv, loss_sum: torch.Tensor,
                   comm, device: torch.device, tp=None, expert_comm=None,
                   local: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(global squared gradient norm, loss summed over ranks) as float64 tensors, from one
    all-reduce of two numbers (three with tensor parallelism). `inv` unscales the reduced gradients. Shards' squares are summed
    across ranks; a replicated gradient's is global already and is added after the sum. With
    tensor parallelism (`tp`, a TPLayout), the squares of split parameters are summed over the
    tensor-parallel ranks too (one more all-reduce of one number); replicated ones, equal there,
    count once. An expert unit differs across the ep ranks, so its squares are summed over the dp
    ranks like a shard's; held whole (optimizer state replicated) it is the same on its
    expert-data-parallel ranks, so each of them adds its share, 1 / their number."""
    dtypes = {g.dtype for g in grads.values()}
    norm_dtype = torch.float64 if torch.float64 in dtypes else torch.float32
    # [sharded over dp, replicated over dp] x [replicated over tp, split over tp]
    sq = [[torch.zeros((), dtype=norm_dtype, device=device) for _ in range(2)] for _ in range(2)]
    for u in units:
        g = grads[u.name]
        if not g.numel():
            continue
        lo = u.shard_range(comm.rank)[0] if u.placement.optimizer else 0
        summed = local or u.placement.optimizer or u.is_expert  # differs across the dp ranks: summed over them
        share = 1.0 if u.placement.optimizer or not u.is_expert else 1.0 / expert_comm.world_size
        for part, split in _tp_parts(u, g, lo, tp):
            sq[0 if summed else 1][int(split)] += torch.linalg.vector_norm(part, dtype=norm_dtype).square() * share
    ii = inv * inv
    loss = loss_sum.to(device=device, dtype=torch.float64)
    if local:  # two numbers: [this rank's norm / ranks, loss], summed to the mean of the ranks' norms
        own = (sq[0][0] + sq[0][1]).to(torch.float64) * ii
        vec = torch.stack([own.sqrt() / comm.world_size, loss])
        vec = comm.all_reduce(vec) if comm.world_size > 1 else vec
        return vec[0].square(), vec[1]
    if tp is None:  # two numbers: [Σ shards' squares, loss]
        vec = torch.stack([sq[0][0].to(torch.float64) * ii, loss])
        vec = comm.all_reduce(vec) if comm.world_size > 1 else vec
        return vec[0] + sq[1][0].to(torch.float64) * ii, vec[1]
    vec = torch.stack([sq[0][0].to(torch.float64) * ii, sq[0][1].to(torch.float64) * ii, loss])
    vec = comm.all_reduce(vec) if comm.world_size > 1 else vec
    split_sq = vec[1] + sq[1][1].to(torch.float64) * ii
    if tp.size > 1:
        split_sq = tp.comm.all_reduce(split_sq.reshape(1))[0]
    return vec[0] + sq[1][0].to(torch.float64) * ii + split_sq, vec[2]


def _tp_parts(u: UnitPlan, g: torch.Tensor, lo: int, tp):
    """(piece of `g`, split over tp?) for the slots of unit `u` that `g` (elements `[lo, lo +
    len(g))` of the unit's buffer) covers; the whole of `g` when there is no tensor parallelism."""
    if tp is None or not tp.splits:
        yield g, False
        return
    hi = lo + g.numel()
    for slot in u.slots:
        a, b = max(lo, slot.offset), min(hi, slot.offset + slot.numel)
        if a < b:
            split = tp.split_of(slot.name, *slot.aliases) is not None
            yield g[a - lo: b - lo], split


def _local_norm(grads: dict[str, torch.Tensor], inv: float) -> float:
    """The norm of this rank's own (un-reduced, whole-unit) gradients times `inv`, with no
    communication."""
    sq = sum(float(torch.linalg.vector_norm(g, dtype=torch.float64).square()) for g in grads.values())
    return math.sqrt(sq) * inv


def clip_norm(setup: StepSetup, clip: float, grads: dict[str, torch.Tensor], inv: float, grad_norm: float) -> float:
    """The norm `gradient_clipping` divides by: the step's `grad_norm`, except where each rank
    holds its own gradients (`Optimizer.local_gradients`) in fp16/bf16, which DeepSpeed's FP16
    optimizers clip by the rank's own norm (its fp32 engine by the mean of the ranks' norms, which
    `grad_norm` is then: `norm_and_loss`), `specs/optim.md` §1-bit optimizers."""
    if clip > 0 and setup.local and setup.param_dtype in HALF_DTYPES:
        return _local_norm(grads, inv)
    return grad_norm


def clip_coefficient(clip: float, grad_norm):
    """What the gradients are multiplied by for `gradient_clipping` (as
    `torch.nn.utils.clip_grad_norm_`): `clip / (norm + 1e-6)` when below 1, else 1; a float for a
    float norm, a tensor for a tensor norm (inside a graph)."""
    if clip <= 0:
        return 1.0
    coef = clip / (grad_norm + 1e-6)
    return torch.clamp(coef, max=1.0) if isinstance(coef, torch.Tensor) else min(coef, 1.0)


def clip_factor(clip: float, grad_norm, unscale):
    """(what the reduced gradients are multiplied by before the optimizer, the norm of the result):
    one factor for unscaling and `gradient_clipping`; floats eagerly, tensors in a graph."""
    coef = clip_coefficient(clip, grad_norm)
    return unscale * coef, grad_norm * coef


