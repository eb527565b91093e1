"""A step's forward and backward, and the `GradientCollector` that reduces each unit's gradient by
its placement (`specs/sharding.md` §Step, `specs/collectives.md`).

Eagerly (`forward_backward`) each micro-batch's loss is differentiated with respect to fresh
aliases of `state.params`, and a hook on each alias hands the unit's gradient to the collector
while backward still runs. Inside the whole-step graph (`traced_forward_backward`) autograd hooks
cannot be traced, so `torch.func.grad_and_value` gives each micro-batch's gradients and they are
handed to the same collector, over functional collectives: one reduction rule for both."""

from __future__ import annotations

from typing import Any, Callable

import torch

from .._errors import ShardingError
from .._ext import trim_between_passes
from ..sharding import Placement, quantizing, ShardPlan, UnitPlan, comm_for, within
from ..state import StepPolicy

__all__ = ["GradientCollector", "forward_backward", "sum_over_replicas", "traced_forward_backward"]


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
