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

import math
from typing import Any

import optree
import torch

from ._errors import ShardingError
from ._shard._collectives import ProcessGroupCollectives
from ._shard._module import optimizer_view
from ._state import TrainState
from ._step import TrainStep, _accum_dtype, _predivisor, _prepare_for_comm, loss_scale_after, split_micro_batches

__all__ = ["WholeStep", "whole_step_unsupported"]


def whole_step_unsupported(step: TrainStep, state: TrainState) -> str | None:
    """Why this step cannot be one graph for this state, or None when it can."""
    plan, comm = state.sharding.plan, state.sharding.comm
    if plan.any_sharded_params:
        return "stage 3 gathers parameter shards inside the forward"
    if step.host_opt is not None:
        return "offload_optimizer runs the optimizer on the host, outside any graph"
    if step.opt.graph_update is None:
        kind = str(getattr(getattr(step.config, "optimizer", None), "type", "this optimizer"))
        return f"the {kind} optimizer has no traceable update (graph_update)"
    if step.policy.timings:
        return "wall_clock_breakdown times phases that a single graph does not separate"
    if comm.world_size > 1 and not isinstance(comm, ProcessGroupCollectives):
        return f"its collectives ({type(comm).__name__}) are not a torch.distributed process group"
    return None


class WholeStep:
    """Calls the compiled graph of one whole step and does the host's part: splitting the batch,
    the schedule's scalars, the overflow skip and the loss-scale update."""

    def __init__(self, step: TrainStep, compile_kwargs: dict[str, Any]):
        self.step = step
        # Always one graph: a break would run the rest of the step eagerly, where the forward's
        # stage-3-style hooks and functorch's grad do not mix. A step that cannot be traced whole
        # raises here, and `fnzero.jit` falls back to compiling the loss only.
        self._graph = torch.compile(self._graph_fn, **dict(compile_kwargs, fullgraph=True))
        self._ctx: dict[str, Any] = {}

    def __call__(self, state: TrainState, batch: Any) -> tuple[TrainState, dict[str, Any]]:
        step, policy = self.step, self.step.policy
        sh = state.sharding
        plan, comm = sh.plan, sh.comm
        n, k = comm.world_size, policy.accumulation_steps
        micro = split_micro_batches(batch, k)
        step_no = int(state.step)
        count = int(state.opt_state.count)
        lr = float(step.sched(step_no))
        momentum = step.sched.momentum(step_no) if getattr(step.sched, "momentum", None) is not None else None
        param_dtype = next(iter(state.params.values())).dtype if state.params else plan.param_dtype
        scale = float(state.loss_scale.scale) if state.loss_scale is not None else 1.0
        # Static for the graph (a change recompiles): structure, world, dtypes. Traced: scalars.
        self._ctx = {
            "plan": plan, "rank": comm.rank, "n": n, "k": k, "param_dtype": param_dtype,
            "group": _group_of(comm),
            "device": sh.device, "has_master": state.master is not None, "donate": step.donate,
        }
        if momentum is not None:
            from .optim._validate import momentum_override

            momentum_override("the optimizer", momentum)
        f64 = dict(dtype=torch.float64, device=sh.device)
        scalars = torch.tensor([lr, count + 1, 0.0 if momentum is None else float(momentum), scale], **f64)
        with torch.enable_grad():
            new_params, new_master, new_opt, stats, auxes = self._graph(
                state.params, state.master, state.opt_state, scalars, micro, momentum is not None
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
        return state.replace(
            params=new_params,
            master=new_master,
            opt_state=new_opt,
            step=torch.tensor(step_no + 1, dtype=torch.int64),
            loss_scale=new_ls,
        ), metrics

    # -- the graph -------------------------------------------------------------------------------
    def _graph_fn(self, params, master, opt_state, scalars, micro, has_momentum: bool):
        import torch.distributed._functional_collectives as funcol

        c, step, policy = self._ctx, self.step, self.step.policy
        plan, rank, n, k, group = c["plan"], c["rank"], c["n"], c["k"], c["group"]
        param_dtype = c["param_dtype"]
        accum_dtype = _accum_dtype(policy, param_dtype)
        prediv = _predivisor(policy, plan, n, param_dtype, accum_dtype)
        lr, t, momentum, scale = scalars[0], scalars[1], scalars[2], scalars[3]
        names = [u.name for u in plan.units]
        placement = {u.name: u.placement for u in plan.units}
        has_aux = step.has_aux

        def scaled_loss(p, mb):
            out = step.loss_fn(p, mb)
            loss, aux = out if has_aux else (out, None)
            if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                raise ShardingError(f"loss_fn must return a scalar tensor, got {type(loss).__name__}")
            # (grad_and_value's aux must be tensors: a user's aux is passed only when there is one.)
            return (loss * scale).reshape(()), ((loss.detach(), aux) if has_aux else loss.detach())

        def reduce_scatter(g):
            g = _prepare_for_comm(g, policy, prediv)
            return g if n == 1 else funcol.reduce_scatter_tensor(g, "sum", 0, group)

        def all_reduce(g):
            g = _prepare_for_comm(g, policy, prediv)
            return g if n == 1 else funcol.all_reduce(g, "sum", group)

        grad_fn = torch.func.grad_and_value(scaled_loss, has_aux=True)
        acc: dict[str, torch.Tensor] = {}
        loss_sum = torch.zeros((), dtype=torch.float64, device=c["device"])
        auxes = []
        for mb in micro:
            grads, (_, out) = grad_fn({u: params[u] for u in names}, mb)
            loss, aux = out if has_aux else (out, None)
            for u in names:
                # Sharded gradients are reduced per micro-batch, as eager.
                g = reduce_scatter(grads[u]) if placement[u].grads else grads[u]
                g = g.to(accum_dtype)
                acc[u] = g if u not in acc else acc[u] + g
            loss_sum = loss_sum + loss.to(torch.float64)
            auxes.append(aux)
        red = {}
        for u in names:  # whole-unit gradients: reduced by where the optimizer state lives
            pl = placement[u]
            red[u] = acc[u] if pl.grads else (reduce_scatter if pl.optimizer else all_reduce)(acc[u]).to(accum_dtype)
        inv = prediv / (n * k * scale)
        norm_dtype = torch.float64 if accum_dtype == torch.float64 else torch.float32
        shard_sq = torch.zeros((), dtype=norm_dtype, device=c["device"])
        whole_sq = torch.zeros((), dtype=norm_dtype, device=c["device"])
        for u, g in red.items():
            if g.numel():
                sq = torch.linalg.vector_norm(g, dtype=norm_dtype).square()
                if placement[u].optimizer:
                    shard_sq = shard_sq + sq
                else:
                    whole_sq = whole_sq + sq
        vec = torch.stack([shard_sq.to(torch.float64) * (inv * inv), loss_sum])
        if n > 1:
            vec = funcol.all_reduce(vec, "sum", group)
        norm_sq = vec[0] + whole_sq.to(torch.float64) * (inv * inv)
        factor = inv
        if policy.clip > 0:
            coef = policy.clip / (norm_sq.sqrt() + 1e-6)
            factor = inv * torch.clamp(coef, max=1.0)
        grads = {u: red[u] * factor.to(red[u].dtype) for u in names}

        target = master if c["has_master"] else optimizer_view(plan, rank, params)
        new_target, new_opt = step.opt.graph_update(grads, opt_state, target, lr, t,
                                                    momentum if has_momentum else None)
        new_params = {}
        for u in names:
            s = new_target[u].to(param_dtype)
            gather = placement[u].optimizer and n > 1  # parameters are never sharded in this graph
            new_params[u] = funcol.all_gather_tensor(s, 0, group) if gather else s
        new_master = new_target if c["has_master"] else None
        if c["donate"]:
            # Write into the input state's buffers, unless the step overflowed (then it is skipped
            # and the input state must stay as it was).
            ok = torch.isfinite(norm_sq)
            new_params = _write_back(params, new_params, ok)
            new_master = _write_back(master, new_master, ok) if new_master is not None else None
            new_opt = _write_back(opt_state, new_opt, ok)
        return new_params, new_master, new_opt, torch.stack([norm_sq, vec[1]]), auxes


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
