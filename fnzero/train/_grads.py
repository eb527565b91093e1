"""The gradients of a step: each micro-batch's forward and backward, the `GradientCollector` that
reduces each unit's gradient by its placement, their global norm with the loss (one all-reduce of
two numbers) and the one factor that unscales and clips them (`specs/sharding.md` §Step). Eagerly
autograd hooks hand each unit's gradient to the collector during backward; in the whole-step graph
`torch.func.grad_and_value` hands it the same gradients (hooks cannot be traced)."""

from __future__ import annotations

import math
from typing import Any, Callable

import torch

from .._errors import ShardingError
from .._ext import trim_between_passes
from ..sharding import Placement, quantizing, ShardPlan, UnitPlan, comm_for, within
from ..state import StepPolicy
from ._setup import HALF_DTYPES, StepSetup

__all__ = [
    "GradientCollector", "forward_backward", "sum_over_replicas", "traced_forward_backward", "unscale_factor",
    "norm_and_loss", "clip_norm", "clip_coefficient", "clip_factor",
]


def prepare_for_comm(g: torch.Tensor, policy: StepPolicy, prediv: float = 1.0) -> torch.Tensor:
    """The gradient as it goes on the wire: communication dtype, divided by the predivisor."""
    cd = policy.comm_dtype
    if cd is not None and g.dtype != cd:
        g = g.to(cd)
    if prediv != 1.0:
        g = g / prediv
    return g


def reduce_whole(comm, g: torch.Tensor, placement: Placement) -> torch.Tensor:
    """A whole-unit gradient summed across ranks: all of it where the optimizer state is
    replicated, this rank's shard where it is sharded."""
    return comm.reduce_scatter(g) if placement.optimizer else comm.all_reduce(g)


class GradientCollector:
    """This step's gradient per unit, reduced by the unit's placement as backward produces it.

    * Sharded gradients of a gathered unit (stage 2, persistent stage-3 units) are reduce-scattered
      from the hook, so at most two units' full gradients wait in flight (`overlap_comm`).
    * Sharded parameters' gradients arrive reduced (`GatherUnit.backward`) and are summed.
    * Replicated gradients (stages 0-1) accumulate whole; on the last micro-batch, with
      `overlap_comm`, each unit's final collective starts from its hook.

    Reentrant checkpointing runs an inner backward per region, so a unit used inside and outside
    one can receive gradient after its final collective started: that gradient is reduced at the
    end (`late`). Every rank runs the same graph, hence the same units and the same order.
    """

    def __init__(self, plan: ShardPlan, comm, policy: StepPolicy, prediv: float, accum_dtype: torch.dtype,
                 expert_comm=None, quantization=None, reduce: bool = True):
        self.plan, self.comm, self.policy = plan, comm, policy
        # False: whole-unit gradients stay this rank's own (an optimizer that exchanges what it
        # needs itself, `Optimizer.local_gradients`; stage 0 only, where every gradient is whole).
        self.reduce = reduce
        self.expert_comm = expert_comm  # expert units reduce over the expert-data-parallel ranks (`comm_for`)
        # ZeRO++ qgZ (`CommQuantization.gradients`): sharded gradients' reduce-scatters quantized.
        self.gradient_codec = quantization.gradients if quantization is not None else None
        self.prediv, self.accum_dtype = prediv, accum_dtype
        self.overlap = policy.overlap_comm and comm.world_size > 1 and reduce
        self.last_micro_batch = False
        self.acc: dict[str, torch.Tensor] = {}  # gradient so far (whole unless grads are sharded)
        self.reduced: dict[str, torch.Tensor] = {}  # whole-unit gradients after their final collective
        self.inflight: list[tuple[str, Any, str]] = []
        self.launched: set[str] = set()
        self.late: dict[str, torch.Tensor] = {}

    def attach(self, leaves: dict[str, torch.Tensor]) -> list:
        """A post-accumulate-grad hook on each unit's alias; returns the handles to remove."""
        return [leaves[u.name].register_post_accumulate_grad_hook(self._hook_for(u)) for u in self.plan.units]

    def _hook_for(self, u: UnitPlan) -> Callable[[torch.Tensor], None]:
        def hook(leaf: torch.Tensor) -> None:
            g = leaf.grad
            leaf.grad = None
            self.receive(u, g)

        return hook

    def receive(self, u: UnitPlan, g: torch.Tensor) -> None:
        """Unit `u`'s gradient of one micro-batch (or of one reentrant region's backward)."""
        name, pl = u.name, u.placement
        if pl.grads and not pl.params:  # sharded gradients of a gathered unit: reduce now
            pending = self._comm(u).reduce_scatter_async(prepare_for_comm(g, self.policy, self.prediv), label=name)
            self.inflight.append((name, pending, "shard"))
            self._drain(2 if self.overlap else 0)
            return
        g = g.to(self.accum_dtype)
        if name in self.launched:
            self.late[name] = g if name not in self.late else self.late[name].add_(g)
            return
        self._add(name, g)
        if self.overlap and self.last_micro_batch and not pl.grads:
            self._launch_final(u)

    def _comm(self, u: UnitPlan):
        comm = comm_for(u, self.comm, self.expert_comm)
        return quantizing(comm, reduce=self.gradient_codec) if u.placement.grads else comm

    def _add(self, name: str, g: torch.Tensor) -> None:
        prev = self.acc.get(name)
        self.acc[name] = g if prev is None else prev.add_(g)

    def _drain(self, limit: int) -> None:
        while len(self.inflight) > limit:
            name, pending, kind = self.inflight.pop(0)
            g = pending.wait().to(self.accum_dtype)
            if kind == "shard":
                self._add(name, g)
            else:
                self.reduced[name] = g

    def _launch_final(self, u: UnitPlan) -> None:
        self.launched.add(u.name)
        g = prepare_for_comm(self.acc[u.name], self.policy, self.prediv)
        if u.placement.optimizer:
            pending = self._comm(u).reduce_scatter_async(g, label=u.name)
        else:
            pending = self._comm(u).all_reduce_async(g, donate=True, label=u.name)  # the accumulator is this step's own
        self.inflight.append((u.name, pending, "final"))

    def finish_backward(self) -> None:
        """After the last backward: wait for what is in flight, reduce late gradient."""
        self._drain(0)
        for name, g in self.late.items():  # in hook order, the same on every rank
            g = prepare_for_comm(g, self.policy, self.prediv)
            u = self.plan.unit(name)
            self.reduced[name].add_(reduce_whole(self._comm(u), g, u.placement).to(self.accum_dtype))

    def gradients(self, device: torch.device) -> dict[str, torch.Tensor]:
        """Every unit's reduced gradient (a shard where the optimizer state is sharded, else the
        whole unit), reducing what is still local; zeros for a unit the loss did not use."""
        grads = {}
        for u in self.plan.units:
            g = self.reduced.get(u.name)
            if g is None:
                g = self.acc.get(u.name)
                if g is None:
                    sharded = u.placement.params or u.placement.optimizer
                    g = torch.zeros(u.shard_numel if sharded else u.padded_numel, dtype=self.accum_dtype, device=device)
                elif not u.placement.grads and self.reduce:
                    g = reduce_whole(self._comm(u), prepare_for_comm(g, self.policy, self.prediv), u.placement)
                    g = g.to(self.accum_dtype)
            grads[u.name] = g
        return grads


def sum_over_replicas(grads: dict[str, torch.Tensor], replicas) -> dict[str, torch.Tensor]:
    """MiCS (`specs/mesh.md §MiCS`): each unit's gradient shard, reduced within this shard group,
    summed with the same shard of every other group; all started before the first is waited on."""
    if replicas.world_size == 1:
        return grads
    pending = {name: replicas.all_reduce_async(g, donate=True, label=name) for name, g in grads.items()}
    return {name: p.wait() for name, p in pending.items()}


def forward_backward(loss_fn: Callable[..., Any], leaves: dict[str, torch.Tensor], micro: list[Any], scale: float,
                     has_aux: bool, collector: GradientCollector, trim_heap: bool,
                     timer) -> tuple[torch.Tensor, list[Any]]:
    """Run the loss and its backward per micro-batch; returns (Σ loss as float64, auxes). The
    loss function's `apply` runs are released once backward is done, even on error. `timer`: the
    step's `Timer` (`_tensor_phases.py`), told where forward and backward begin and end."""
    handles = collector.attach(leaves)
    loss_sum = torch.zeros((), dtype=torch.float64)
    auxes = []
    runs: list = []
    try:
        for i, mb in enumerate(micro):
            collector.last_micro_batch = i == len(micro) - 1
            timer.start()
            with within(step_runs=runs):
                out = loss_fn(leaves, mb)
            timer.stop("forward")
            loss, aux = _loss_and_aux(out, has_aux)
            timer.start()
            if trim_heap:
                trim_between_passes()
            if leaves:
                scaled = loss * scale if scale != 1.0 else loss
                if scaled.requires_grad:
                    # No `inputs=`: reentrant checkpointing inside a model (its inner backward
                    # accumulates into the leaves it reaches) refuses it. The aliases are the only
                    # leaves that require grad in a loss built from `params`.
                    scaled.backward()
            loss_sum += loss.detach().to(torch.float64).cpu()
            timer.stop("backward")
            auxes.append(aux)
        timer.start()
        collector.finish_backward()
    finally:
        for h in handles:
            h.remove()
        for run in runs:
            run.release()
    return loss_sum, auxes


def traced_forward_backward(loss_fn: Callable[..., Any], params: dict[str, torch.Tensor], micro: list[Any], scale,
                            has_aux: bool, collector: GradientCollector,
                            device: torch.device) -> tuple[torch.Tensor, list[Any]]:
    """`forward_backward` as the whole-step graph runs it: `torch.func.grad_and_value` per
    micro-batch (the loss times `scale`, a 0-dim tensor), each unit's gradient handed to the
    collector as the eager hooks hand it; returns (Σ loss as float64, auxes)."""

    def scaled_loss(p, mb):
        loss, aux = _loss_and_aux(loss_fn(p, mb), has_aux)
        # (grad_and_value's aux must be tensors: a user's aux is passed only when there is one.)
        return (loss * scale).reshape(()), ((loss.detach(), aux) if has_aux else loss.detach())

    grad_fn = torch.func.grad_and_value(scaled_loss, has_aux=True)
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    auxes = []
    for i, mb in enumerate(micro):
        collector.last_micro_batch = i == len(micro) - 1
        grads, (_, out) = grad_fn(params, mb)
        loss, aux = out if has_aux else (out, None)
        for u in collector.plan.units:
            collector.receive(u, grads[u.name])
        loss_sum = loss_sum + loss.to(torch.float64)
        auxes.append(aux)
    collector.finish_backward()
    return loss_sum, auxes


def _loss_and_aux(out: Any, has_aux: bool) -> tuple[torch.Tensor, Any]:
    loss, aux = out if has_aux else (out, None)
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise ShardingError(
            f"loss_fn must return a scalar tensor{' (first of the pair, has_aux=True)' if has_aux else ''}, "
            f"got {type(loss).__name__}{tuple(loss.shape) if isinstance(loss, torch.Tensor) else ''}"
        )
    return loss, aux


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


