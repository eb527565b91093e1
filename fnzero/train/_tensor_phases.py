"""The tensor phases of a step (gradients, norm and loss, clip factor, optimizer update, publish),
written once for the eager step (`eager_phases`) and the whole-step graph, which a `StepContext`
tells apart (`specs/architecture.md` §How a batch flows: in a graph an fp16 overflow is discarded
after the optimizer ran, not skipped before it)."""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any, Callable

import torch

from .._state import StateMesh, TrainState
from ..pipeline import PipelineLoss, sum_tied_gradients, units_for_norm
from ..sharding import stepped_in_place
from ..state import StepPolicy
from ._grads import (
    GradientCollector, clip_factor, clip_norm, forward_backward, norm_and_loss, sum_over_replicas,
    traced_forward_backward, unscale_factor,
)
from ._setup import StepSetup
from ._update import OptimizerScalars, optimizer_update, publish_params

__all__ = ["StepContext", "PhaseResult", "Timer", "eager_phases", "tensor_phases"]


class Timer:
    """Wall-clock seconds per phase (`wall_clock_breakdown`); a no-op when off. On accelerators it
    synchronizes the device at phase boundaries, which is why it is opt-in."""

    def __init__(self, on: bool, device: torch.device):
        self.on = on
        self.sync = on and device.type == "cuda"
        self.totals = {"forward": 0.0, "backward": 0.0, "comm": 0.0, "optimizer": 0.0}
        self._t = 0.0

    def start(self) -> None:
        if self.on:
            if self.sync:
                torch.cuda.synchronize()
            self._t = time.perf_counter()

    def stop(self, phase: str) -> None:
        if self.on:
            if self.sync:
                torch.cuda.synchronize()
            self.totals[phase] += time.perf_counter() - self._t


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
    param_source: Any = None  # `offload_param: nvme`'s store, where new placeholder shards are written
    timer: Timer = dataclasses.field(default_factory=lambda: Timer(False, torch.device("cpu")))


@dataclasses.dataclass(frozen=True)
class PhaseResult:
    """What the tensor phases give the host: the squared gradient norm and the loss summed over
    ranks (floats eagerly, 0-dim tensors from a graph), the auxes, and the new (params, master,
    opt_state), or None where an eager step stopped at an overflow; `timings`, the wall-clock
    breakdown (`wall_clock_breakdown`), where it was taken."""

    norm_sq: Any
    loss_total: Any
    auxes: list
    updated: tuple | None
    timings: dict | None = None


def eager_phases(state: TrainState, setup: StepSetup, opt, policy: StepPolicy, loss_fn: Callable[..., Any],
                 has_aux: bool, donate: bool) -> PhaseResult:
    """`tensor_phases` run eagerly on `state`: its own mesh and collectives, autograd hooks, Python
    numbers, the optimizer's `update` (`update_` when donated), the wall-clock breakdown when the
    policy asks for it."""
    sh = state.sharding
    param_source = stepped_in_place(state)  # an older state than its files' is refused before any work
    if sh.watchdog is not None:  # its verdicts name the step a rank was stuck in
        sh.watchdog.at_step(setup.step_no + 1)
    timer = Timer(policy.timings, sh.device)
    x = StepContext(sh.plan, sh.mesh, sh.device, policy, loss_fn, has_aux, opt, opt.update_ if donate else opt.update,
                    donate, quantization=sh.quantization, param_source=param_source, timer=timer)
    out = tensor_phases(x, setup, state.params, state.master, state.opt_state, setup.scale, setup.lr, setup.momentum)
    return dataclasses.replace(out, timings=timer.totals) if timer.on else out


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
        x.opt, x.update, setup.param_dtype, x.donate, x.mesh.data, param_source=x.param_source)
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
