"""The one ladder of a training step: its phases in order, run eagerly or traced into one graph.

    step_setup          the host's decisions before any tensor work (micro-batches, lr, ...)
    tensor_phases       gradients reduced by placement, one all-reduce of norm and loss, the clip
                        factor, the optimizer on this rank's slice, the parameters published
    step_verdict        the metrics, the fp16 overflow verdict and the next loss scale (host)
    next_state

`run_step` is the ladder; `tensor_phases` its middle, written once for both ways of running it. A
`StepContext` says how: the eager step (`_step.py`) passes the state's own mesh, Python
numbers, autograd hooks and the optimizer's `update`; the whole-step graph (`_whole_step.py`)
passes a mesh of torch's traceable functional collectives, 0-dim tensors, `torch.func` and the optimizer's
`graph_update`, and calls `tensor_phases` inside the compiled function (`specs/architecture.md`
§How a batch flows). The one difference of order: eagerly an fp16 overflow skips the optimizer
before it runs; in a graph the optimizer runs and its results are discarded.

Whether a step can run traced at all is what its parts declare (`not_traceable`): the plan, each
mesh axis, the quantization codecs, the policy, the optimizer and the collectives each say why
they cannot be traced, or nothing (`why_not_traced`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

import torch

from .._state import StateMesh, TrainState
from ..pipeline import PipelineLoss, sum_tied_gradients, units_for_norm
from ._grads import GradientCollector, forward_backward, sum_over_replicas, traced_forward_backward
from ._phases import (
    StepSetup, Timer, clip_factor, clip_norm, next_state, norm_and_loss, step_setup, step_verdict, unscale_factor,
)
from ..state import StepPolicy
from ._update import OptimizerScalars, optimizer_update, publish_params

__all__ = ["StepContext", "PhaseResult", "tensor_phases", "run_step", "why_not_traced"]


@dataclasses.dataclass(frozen=True)
class StepContext:
    """How the tensor phases run, and what they read besides the state's tensors. `mesh`: the
    state's axes (`StateMesh`), which the phases ask for each collective. `traced`: inside the
    whole-step graph (numbers are 0-dim tensors, the mesh is its data axis alone, functional,
    gradients come from `torch.func`); else eager. `update`: the optimizer's `update`, `update_`
    (donated) or `graph_update`. ZeRO++'s `quantization` is None where the state has none (a graph
    never has it, nor a mesh axis besides data)."""

    plan: Any
    mesh: StateMesh
    device: torch.device
    policy: StepPolicy
    loss_fn: Callable[..., Any]
    has_aux: bool
    opt: Any
    update: Callable
    donate: bool
    traced: bool = False
    quantization: Any = None
    exchange: Callable | None = None  # `optimizer_exchange`: the 1-bit optimizers' compressed all-reduce
    param_source: Any = None  # `offload_param: nvme`'s store, where new placeholder shards are written
    timer: Timer = dataclasses.field(default_factory=lambda: Timer(False, torch.device("cpu")))


@dataclasses.dataclass(frozen=True)
class PhaseResult:
    """What the tensor phases give the host: the squared gradient norm and the loss summed over
    ranks (floats eagerly, 0-dim tensors from a graph), the auxes, and the new (params, master,
    opt_state), or None where an eager step stopped at an overflow."""

    norm_sq: Any
    loss_total: Any
    auxes: list
    updated: tuple | None


def run_step(state: TrainState, batch: Any, policy: StepPolicy, sched, opt, has_aux: bool,
             phases: Callable[[StepSetup], PhaseResult], timer: Timer | None = None) -> tuple[TrainState, dict]:
    """The ladder: `step_setup`, the tensor phases (`phases(setup)`: `tensor_phases` eagerly or the
    compiled graph around it), `step_verdict` on the two numbers every rank agreed on, and the next
    state; an fp16 overflow is skipped (the loss scale still moves)."""
    setup = step_setup(state, batch, policy, sched, opt)
    out = phases(setup)
    norm_sq, loss_total = float(out.norm_sq), float(out.loss_total)
    metrics, new_ls = step_verdict(state, setup, policy, norm_sq, loss_total, out.auxes, has_aux)
    if timer is not None and timer.on:
        metrics["timings"] = timer.totals
    if metrics["skipped"]:
        return state.replace(loss_scale=new_ls), metrics  # (donated buffers were left as they were)
    return next_state(state, *out.updated, new_ls), metrics


def tensor_phases(x: StepContext, setup: StepSetup, params, master, opt_state, scale, lr, momentum) -> PhaseResult:
    """From the micro-batches to the published parameters: each micro-batch's forward and
    backward with gradients reduced by placement as they come, one all-reduce of norm and loss,
    one factor for unscaling and clipping, the optimizer on this rank's slice, the new parameters
    gathered where only the optimizer state is sharded. The micro-batches are `setup.micro`;
    `scale`, `lr` and `momentum` are Python numbers eagerly and 0-dim tensors in a graph, so a new
    value never recompiles."""
    grads, loss_sum, auxes = _gradients(x, setup, params, scale)
    # Gradients stay as reduced (sums of loss-scaled gradients) until one multiply by
    # `unscale * clip_coef` just before the optimizer.
    unscale = unscale_factor(setup.prediv, 1 if setup.local else setup.n, setup.k, scale)  # local: not summed
    norm_sq, loss_total = norm_and_loss(units_for_norm(x.plan, x.mesh.pp), grads, unscale, loss_sum, x.mesh, x.device,
                                        setup.local)
    if x.traced:
        grad_norm = norm_sq.sqrt()  # an overflow is judged after the graph, its updates discarded
    else:
        norm_sq, loss_total = float(norm_sq), float(loss_total)
        x.timer.stop("comm")
        if not math.isfinite(norm_sq):  # skipped (fp16) or refused: the verdict says which
            return PhaseResult(norm_sq, loss_total, auxes, None)
        grad_norm = math.sqrt(norm_sq)
    factor, global_norm = clip_factor(x.policy.clip, clip_norm(setup, x.policy.clip, grads, unscale, grad_norm),
                                      unscale)
    x.timer.start()
    new_slices, new_master, new_opt_state = optimizer_update(
        x.plan, x.mesh.data.rank, params, master, opt_state, grads, OptimizerScalars(factor, lr, momentum, global_norm),
        x.opt, x.update, setup.param_dtype, x.donate, x.mesh.data, exchange=x.exchange, param_source=x.param_source)
    x.timer.stop("optimizer")
    x.timer.start()
    new_params = publish_params(x.plan, x.mesh.data, params, new_slices, x.donate, x.mesh.expert_data)
    x.timer.stop("comm")
    return PhaseResult(norm_sq, loss_total, auxes, (new_params, new_master, new_opt_state))


def _gradients(x: StepContext, setup: StepSetup, params, scale):
    """Every micro-batch's forward and backward, with the gradients reduced by placement as they
    come: (gradient per unit, Σ loss, auxes). Eagerly autograd hooks hand each unit's gradient to
    the collector, and a pipeline's schedule runs the micro-batches across its stages (summing the
    copies of weights its stages share); traced, `torch.func` gives each micro-batch's gradients."""
    mesh = x.mesh
    collector = GradientCollector(x.plan, mesh.data, x.policy, setup.prediv, setup.accum_dtype, mesh.expert_data,
                                  x.quantization, reduce=not setup.local)
    if x.traced:
        loss_sum, auxes = traced_forward_backward(x.loss_fn, params, setup.micro, scale, x.has_aux, collector, x.device)
        return collector.gradients(x.device), loss_sum, auxes
    leaves = {u.name: params[u.name].detach().requires_grad_(True) for u in x.plan.units}
    trim = x.policy.trim_heap and x.device.type == "cpu"
    run = x.loss_fn.forward_backward if isinstance(x.loss_fn, PipelineLoss) else _forward_backward(x.loss_fn)
    loss_sum, auxes = run(leaves, setup.micro, scale, x.has_aux, collector, trim, x.timer)
    grads = collector.gradients(x.device)
    if mesh.replicas is not None:
        grads = sum_over_replicas(grads, mesh.replicas)
    if mesh.pp is not None and mesh.pp.ties:
        grads = sum_tied_gradients(grads, x.plan, mesh.pp)
    return grads, loss_sum, auxes


def _forward_backward(loss_fn):
    return lambda *args: forward_backward(loss_fn, *args)


def why_not_traced(state: TrainState, policy: StepPolicy, opt, optimizer_name: str) -> str | None:
    """Why this step cannot run as one graph for this state, from what its parts declare
    (`not_traceable`: a reason, or None), or None when it can. `optimizer_name` names the
    optimizer in its reason."""
    sh = state.sharding
    parts = (sh.plan, sh.mesh, sh.quantization, policy)  # the mesh: each axis' layout, MiCS's replicas
    for part in parts:
        reason = getattr(part, "not_traceable", None) if part is not None else None
        if reason is not None:
            return reason
    if not opt.traceable:
        return f"the {optimizer_name} optimizer has no traceable update (graph_update)"
    if sh.comm.world_size > 1 and not getattr(type(sh.comm), "traceable", False):
        return f"its collectives ({type(sh.comm).__name__}) are not a torch.distributed process group"
    return None
