"""The whole train step as one torch.compile graph: `fnzero.jit(step, scope="step")`.

Without sharded parameters (stages 0-2) nothing in a step needs the host between reading the
batch and returning the new state, so the step's phases from the gradients to the new
parameters are traced into one graph (`specs/jit.md`). They are the eager step's own phases
(`_phases.py`, `_grads.py`, `_update.py`), called with what a graph can carry:

* gradients come from `torch.func.grad_and_value` over the loss function (autograd hooks cannot
  be traced) and go to the eager step's `GradientCollector`;
* the collectives are `FunctionalCollectives`, torch's traceable functional collectives over the
  step's process group, so each placement is reduced by the same rule as eagerly;
* the scalars (lr, momentum, loss scale, the clip factor) are 0-dim tensors, and the optimizer
  is its `graph_update` (the same signature as `update`, in tensor ops), so a schedule never
  recompiles.

The host's parts are the eager step's too: `step_setup` before the graph, and after it
`step_verdict` on the two numbers the graph returns (the squared norm and the loss sum), which
skips an fp16 step that overflowed and updates the loss scale.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import optree
import torch

from .._state import TrainState
from ..sharding.comm._collectives import ProcessGroupCollectives
from ..sharding.comm._functional import FunctionalCollectives
from ._grads import GradientCollector, traced_forward_backward
from ._jit import compile_fn
from ._phases import StepSetup, clip_factor, next_state, norm_and_loss, step_setup, step_verdict, unscale_factor
from ._step import TrainStep
from ._update import OptimizerScalars, optimizer_update, publish_params

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
    if state.sharding.ep is not None:
        return "expert parallelism's all-to-all runs inside the model's MoE layers"
    quantization = state.sharding.quantization
    if quantization is not None and quantization.gradients is not None:
        return "zero_quantized_gradients' quantized reduce-scatter is eager code, not traced"
    if state.sharding.replicas is not None:
        return "MiCS all-reduces the gradient shards across its replica groups, a collective the graph's ladder lacks"
    if step.policy.offload_optimizer is not None:
        return "offload_optimizer runs the optimizer on the host, outside any graph"
    if step.optimizer_for(state).graph_update is None:
        block = step.config.optimizer
        kind = block.type if block is not None else "this optimizer"
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
    accum_dtype: torch.dtype
    prediv: float
    group: Any  # the process group, or None for a world of one
    device: torch.device
    has_master: bool
    donate: bool
    own_lr: bool  # no schedule: the optimizer's own lr, a constant of the graph
    has_momentum: bool

    def key(self) -> tuple:
        return (id(self.plan), self.rank, self.n, self.k, self.param_dtype, self.accum_dtype, self.prediv,
                id(self.group), self.device, self.has_master, self.donate, self.own_lr, self.has_momentum)


class WholeStep:
    """Calls the compiled graph of one whole step around the host's phases: `step_setup` before
    it, `step_verdict` after it."""

    def __init__(self, step: TrainStep, compile_kwargs: dict[str, Any]):
        self.step = step
        # Always one graph: a break would run the rest of the step eagerly, where the forward's
        # stage-3-style hooks and functorch's grad do not mix. A step that cannot be traced whole
        # raises here, and `fnzero.jit` falls back to compiling the loss only.
        self._graph = compile_fn(self._graph_fn, dict(compile_kwargs, fullgraph=True))
        # One `GraphStatics` object per distinct value, passed to the graph as an argument: the
        # same object for the same statics, so torch.compile's guards on it hold between calls.
        self._statics: dict[tuple, GraphStatics] = {}

    def __call__(self, state: TrainState, batch: Any) -> tuple[TrainState, dict[str, Any]]:
        step = self.step
        sh = state.sharding
        sh.plan.check_params(state.params, "state.params")
        setup = step_setup(state, batch, step.policy, step.sched)
        if setup.momentum is not None:
            # The optimizer's own check reads a number; inside the graph the momentum is a tensor.
            from ..optim._validate import momentum_override

            momentum_override("the optimizer", setup.momentum)
        statics = self._statics_for(state, setup)
        # Traced, so a new value does not recompile: [lr, momentum, loss scale] (unused slots 0).
        scalars = torch.tensor([setup.lr or 0.0, setup.momentum or 0.0, setup.scale], dtype=torch.float64,
                               device=sh.device)
        with torch.enable_grad():
            new_params, new_master, new_opt, stats, auxes = self._graph(
                statics, state.params, state.master, state.opt_state, scalars, setup.micro)
        norm_sq, loss_total = (float(x) for x in stats.cpu())
        metrics, new_ls = step_verdict(state, setup, step.policy, norm_sq, loss_total, auxes, step.has_aux)
        if metrics["skipped"]:
            return state.replace(loss_scale=new_ls), metrics  # donated buffers were left as they were
        return next_state(state, new_params, new_master, new_opt, new_ls), metrics

    def _statics_for(self, state: TrainState, setup: StepSetup) -> GraphStatics:
        sh = state.sharding
        statics = GraphStatics(sh.plan, sh.comm.rank, setup.n, setup.k, setup.param_dtype, setup.accum_dtype,
                               setup.prediv, _group_of(sh.comm), sh.device, state.master is not None, self.step.donate,
                               setup.lr is None, setup.momentum is not None)
        return self._statics.setdefault(statics.key(), statics)

    # -- the graph -------------------------------------------------------------------------------
    def _graph_fn(self, c: GraphStatics, params, master, opt_state, scalars, micro):
        """The eager step's phases from the gradients to the new parameters (`_step._step`), with
        functional collectives and tensor scalars."""
        step, policy, plan = self.step, self.step.policy, c.plan
        comm = FunctionalCollectives(c.group, c.rank, c.n)
        lr = None if c.own_lr else scalars[0]
        momentum = scalars[1] if c.has_momentum else None
        scale = scalars[2]
        collector = GradientCollector(plan, comm, policy, c.prediv, c.accum_dtype)
        loss_sum, auxes = traced_forward_backward(step.loss_fn, params, micro, scale, step.has_aux, collector, c.device)
        grads = collector.gradients(c.device)
        unscale = unscale_factor(c.prediv, c.n, c.k, scale)
        norm_sq, loss_total = norm_and_loss(plan.units, grads, unscale, loss_sum, comm, c.device)
        factor, global_norm = clip_factor(policy.clip, norm_sq.sqrt(), unscale)
        new_slices, new_master, new_opt = optimizer_update(
            plan, c.rank, params, master, opt_state, grads, OptimizerScalars(factor, lr, momentum, global_norm),
            step.opt, step.opt.graph_update, c.param_dtype, donate=False, comm=comm)
        # Parameters are never sharded in this graph; gathered where only the optimizer state is.
        new_params = publish_params(plan, comm, params, new_slices, donate=False)
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
