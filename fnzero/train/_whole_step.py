"""The whole train step as one torch.compile graph: `fnzero.jit(step, scope="step")`.

Without sharded parameters (stages 0-2) nothing in a step needs the host between reading the
batch and returning the new state, so the forward, the backward, the gradient collectives, the
norm, clipping and the optimizer are traced into one graph (`specs/jit.md`):

* gradients come from `torch.func.grad_and_value` over the loss function (dynamo traces the
  functional transform; `ShardedModule.apply` binds the unit views directly while compiling);
* collectives are torch's traceable functional collectives over the step's process group, chosen
  by each unit's placement as in the eager step: all-reduce where the optimizer is replicated,
  reduce-scatter where it is sharded (per micro-batch where gradients are), the norm and loss in
  one all-reduce of two numbers, and the new parameters' all-gather;
* clipping is a tensor factor, and the optimizer is its `graph_update` with the learning rate,
  step number and momentum as 0-dim tensors, so a schedule never recompiles.

The host reads two numbers after the graph (the loss and the squared norm) to decide the fp16
overflow skip and the loss scale, exactly as the eager step does.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import optree
import torch

from .._errors import ShardingError
from .._state import TrainState
from ..sharding._collectives import ProcessGroupCollectives
from ..sharding._functional import FunctionalCollectives
from ..sharding._module import optimizer_view
from ._phases import (
    accum_dtype_for, clip_coefficient, loss_scale_after, next_state, norm_and_loss, predivisor, prepare_for_comm,
    micro_batch_rows, reduce_whole, split_micro_batches,
)
from ._step import TrainStep

__all__ = ["WholeStep", "whole_step_unsupported"]


def whole_step_unsupported(step: TrainStep, state: TrainState) -> str | None:
    """Why this step cannot be one graph for this state, or None when it can."""
    plan, comm = state.sharding.plan, state.sharding.comm
    if plan.any_sharded_params:
        return "stage 3 gathers parameter shards inside the forward"
    if state.sharding.tp is not None:
        return "tensor parallelism's collectives run inside the model's layers"
    if state.sharding.pp is not None:
        return "a pipeline schedule sends activations between its stages' forwards"
    if step.policy.offload_optimizer is not None:
        return "offload_optimizer runs the optimizer on the host, outside any graph"
    if step.opt.graph_update is None:
        kind = str(getattr(getattr(step.config, "optimizer", None), "type", "this optimizer"))
        return f"the {kind} optimizer has no traceable update (graph_update)"
    if step.policy.timings:
        return "wall_clock_breakdown times phases that a single graph does not separate"
    if comm.world_size > 1 and not isinstance(comm, ProcessGroupCollectives):
        return f"its collectives ({type(comm).__name__}) are not a torch.distributed process group"
    return None


@dataclasses.dataclass(frozen=True)
class GraphStatics:
    """What the whole-step graph is specialised on; a different value compiles a new graph."""

    plan: Any
    rank: int
    n: int
    k: int
    param_dtype: torch.dtype
    group: Any  # the process group, or None for a world of one
    device: torch.device
    has_master: bool
    donate: bool

    def key(self) -> tuple:
        return (id(self.plan), self.rank, self.n, self.k, self.param_dtype, id(self.group), self.device,
                self.has_master, self.donate)


class WholeStep:
    """Calls the compiled graph of one whole step and does the host's part: splitting the batch,
    the schedule's scalars, the overflow skip and the loss-scale update."""

    def __init__(self, step: TrainStep, compile_kwargs: dict[str, Any]):
        self.step = step
        # Always one graph: a break would run the rest of the step eagerly, where the forward's
        # stage-3-style hooks and functorch's grad do not mix. A step that cannot be traced whole
        # raises here, and `fnzero.jit` falls back to compiling the loss only.
        self._graph = torch.compile(self._graph_fn, **dict(compile_kwargs, fullgraph=True))
        # One `GraphStatics` object per distinct value, passed to the graph as an argument: the
        # same object for the same statics, so torch.compile's guards on it hold between calls.
        self._statics: dict[tuple, GraphStatics] = {}

    def __call__(self, state: TrainState, batch: Any) -> tuple[TrainState, dict[str, Any]]:
        step, policy = self.step, self.step.policy
        sh = state.sharding
        sh.plan.check_params(state.params, "state.params")
        plan, comm = sh.plan, sh.comm
        n, k = comm.world_size, policy.accumulation_steps
        micro = split_micro_batches(batch, k, micro_batch_rows(policy, n))
        step_no = int(state.step)
        count = int(state.opt_state.count)
        lr = float(step.sched(step_no))
        momentum = step.sched.momentum(step_no) if getattr(step.sched, "momentum", None) is not None else None
        param_dtype = next(iter(state.params.values())).dtype if state.params else plan.param_dtype
        scale = float(state.loss_scale.scale) if state.loss_scale is not None else 1.0
        # Static for the graph (a change recompiles): structure, world, dtypes. Traced: scalars.
        statics = GraphStatics(plan, comm.rank, n, k, param_dtype, _group_of(comm), sh.device,
                               state.master is not None, step.donate)
        statics = self._statics.setdefault(statics.key(), statics)
        if momentum is not None:
            from ..optim._validate import momentum_override

            momentum_override("the optimizer", momentum)
        f64 = dict(dtype=torch.float64, device=sh.device)
        scalars = torch.tensor([lr, count + 1, 0.0 if momentum is None else float(momentum), scale], **f64)
        with torch.enable_grad():
            new_params, new_master, new_opt, stats, auxes = self._graph(
                statics, state.params, state.master, state.opt_state, scalars, micro, momentum is not None
            )
        norm_sq, loss_sum = (float(x) for x in stats.cpu())
        overflow = not math.isfinite(norm_sq)
        metrics: dict[str, Any] = {
            "loss": loss_sum / (k * n),
            "lr": lr,
            "grad_norm": math.sqrt(norm_sq) if not overflow else float("inf"),
            "loss_scale": scale if state.loss_scale is not None else None,
            "skipped": overflow,
        }
        if step.has_aux:
            metrics["aux"] = auxes if k > 1 else auxes[0]
        new_ls = loss_scale_after(state, policy, overflow, step_no, comm.rank)
        if overflow:
            return state.replace(loss_scale=new_ls), metrics  # donated buffers were left as they were
        new_opt = new_opt._replace(count=torch.tensor(count + 1, dtype=torch.int64))
        return next_state(state, new_params, new_master, new_opt, new_ls), metrics

    # -- the graph -------------------------------------------------------------------------------
    def _graph_fn(self, c: "GraphStatics", params, master, opt_state, scalars, micro, has_momentum: bool):
        step, policy = self.step, self.step.policy
        plan, n, k = c.plan, c.n, c.k
        comm = FunctionalCollectives(c.group, c.rank, n)
        accum_dtype = accum_dtype_for(policy, c.param_dtype)
        prediv = predivisor(policy, plan, n, c.param_dtype, accum_dtype)
        lr, t, momentum, scale = scalars[0], scalars[1], scalars[2], scalars[3]
        has_aux = step.has_aux

        def scaled_loss(p, mb):
            out = step.loss_fn(p, mb)
            loss, aux = out if has_aux else (out, None)
            if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                raise ShardingError(f"loss_fn must return a scalar tensor, got {type(loss).__name__}")
            # (grad_and_value's aux must be tensors: a user's aux is passed only when there is one.)
            return (loss * scale).reshape(()), ((loss.detach(), aux) if has_aux else loss.detach())

        grad_fn = torch.func.grad_and_value(scaled_loss, has_aux=True)
        acc: dict[str, torch.Tensor] = {}
        loss_sum = torch.zeros((), dtype=torch.float64, device=c.device)
        auxes = []
        for mb in micro:
            grads, (_, out) = grad_fn({u.name: params[u.name] for u in plan.units}, mb)
            loss, aux = out if has_aux else (out, None)
            for u in plan.units:
                g = grads[u.name]
                if u.placement.grads:  # sharded gradients are reduced per micro-batch, as eager
                    g = comm.reduce_scatter(prepare_for_comm(g, policy, prediv))
                g = g.to(accum_dtype)
                acc[u.name] = g if u.name not in acc else acc[u.name] + g
            loss_sum = loss_sum + loss.to(torch.float64)
            auxes.append(aux)
        red = {u.name: acc[u.name] if u.placement.grads
               else reduce_whole(comm, prepare_for_comm(acc[u.name], policy, prediv), u.placement).to(accum_dtype)
               for u in plan.units}
        inv = prediv / (n * k * scale)
        norm_sq, loss_total = norm_and_loss(plan.units, red, inv, loss_sum, comm, c.device)
        factor = inv * clip_coefficient(policy.clip, norm_sq.sqrt())
        grads = {name: g * factor.to(g.dtype) for name, g in red.items()}

        target = master if c.has_master else optimizer_view(plan, c.rank, params)
        new_target, new_opt = step.opt.graph_update(grads, opt_state, target, lr, t,
                                                    momentum if has_momentum else None)
        # Parameters are never sharded in this graph: gather where only the optimizer state is.
        new_params = {u.name: comm.all_gather(new_target[u.name].to(c.param_dtype)) if u.placement.optimizer
                      else new_target[u.name].to(c.param_dtype) for u in plan.units}
        new_master = new_target if c.has_master else None
        if c.donate:
            # Write into the input state's buffers, unless the step overflowed (then it is skipped
            # and the input state must stay as it was).
            ok = torch.isfinite(norm_sq)
            new_params = _write_back(params, new_params, ok)
            new_master = _write_back(master, new_master, ok) if new_master is not None else None
            new_opt = _write_back(opt_state, new_opt, ok)
        return new_params, new_master, new_opt, torch.stack([norm_sq, loss_total]), auxes


def _group_of(comm):
    if not isinstance(comm, ProcessGroupCollectives):
        return None
    import torch.distributed as dist

    return comm.group if comm.group is not None else dist.group.WORLD


def _write_back(old, new, ok: torch.Tensor):
    def put(o, x):
        if o is x:
            return o
        with torch.no_grad():
            o.copy_(torch.where(ok, x, o))
        return o

    return optree.tree_map(put, old, new)
