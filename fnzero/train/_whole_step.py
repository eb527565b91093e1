"""The whole train step as one torch.compile graph: `fnzero.jit(step, scope="step")` at stages 0-2
(`specs/jit.md` §Whole step). It traces the eager step's own `tensor_phases` with what a graph can
carry (`torch.func` gradients, functional collectives, 0-dim scalars, the optimizer's
`graph_update`); `step_setup` runs before the graph and `step_verdict` after it."""

from __future__ import annotations

import dataclasses
from typing import Any

import optree
import torch

from .._state import StateMesh, TrainState
from ..state import StepPolicy
from ..sharding import ProcessGroupCollectives, FunctionalCollectives
from ._compile import compile_fn
from ._setup import StepSetup
from ._step import TrainStep, run_step
from ._tensor_phases import PhaseResult, StepContext, tensor_phases

__all__ = ["WholeStep", "whole_step_unsupported"]


def whole_step_unsupported(step: TrainStep, state: TrainState) -> str | None:
    """Why this step cannot be one graph for this state, or None when it can: what its parts
    declare (`why_not_traced`)."""
    block = step.config.optimizer
    name = block.type if block is not None else "this optimizer"
    return why_not_traced(state, step.policy, step.optimizer_for(state), name)


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
    opt: Any  # the optimizer the step runs on this state (`TrainStep.optimizer_for`)

    def key(self) -> tuple:
        return (id(self.plan), self.rank, self.n, self.k, self.param_dtype, self.accum_dtype, self.prediv,
                id(self.group), self.device, self.has_master, self.donate, self.own_lr, self.has_momentum, id(self.opt))


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
        opt = step.optimizer_for(state)

        def phases(setup: StepSetup) -> PhaseResult:
            if setup.momentum is not None:
                # The optimizer's own check reads a number; inside the graph the momentum is a tensor.
                from ..optim import momentum_override

                momentum_override("the optimizer", setup.momentum)
            statics = self._statics_for(state, setup, opt)
            # Traced, so a new value does not recompile: [lr, momentum, loss scale] (unused slots 0).
            scalars = torch.tensor([setup.lr or 0.0, setup.momentum or 0.0, setup.scale], dtype=torch.float64,
                                   device=sh.device)
            with torch.enable_grad():
                new_params, new_master, new_opt, stats, auxes = self._graph(
                    statics, state.params, state.master, state.opt_state, scalars, setup.micro)
            norm_sq, loss_total = stats.cpu()
            return PhaseResult(norm_sq, loss_total, auxes, (new_params, new_master, new_opt))

        return run_step(state, batch, step, opt, graph=phases)

    def _statics_for(self, state: TrainState, setup: StepSetup, opt) -> GraphStatics:
        sh = state.sharding
        statics = GraphStatics(sh.plan, sh.comm.rank, setup.n, setup.k, setup.param_dtype, setup.accum_dtype,
                               setup.prediv, _group_of(sh.comm), sh.device, state.master is not None, self.step.donate,
                               setup.lr is None, setup.momentum is not None, opt)
        return self._statics.setdefault(statics.key(), statics)

    # -- the graph -------------------------------------------------------------------------------
    def _graph_fn(self, c: GraphStatics, params, master, opt_state, scalars, micro):
        """The ladder's tensor phases (`_tensor_phases.tensor_phases`), traced: functional collectives,
        tensor scalars, `torch.func` gradients, the optimizer's `graph_update`."""
        step = self.step
        comm = FunctionalCollectives(c.group, c.rank, c.n)
        lr = None if c.own_lr else scalars[0]
        momentum = scalars[1] if c.has_momentum else None
        scale = scalars[2]
        # What the phases read of the host's setup: the reduction's numbers (the host's own
        # numbers, lr, momentum and scale, come as the tensors above).
        setup = StepSetup(micro=micro, step_no=-1, scale=1.0, lr=None, momentum=None, param_dtype=c.param_dtype,
                          accum_dtype=c.accum_dtype, prediv=c.prediv, n=c.n, k=c.k)
        x = StepContext(c.plan, StateMesh(comm), c.device, step.policy, step.loss_fn, step.has_aux, c.opt,
                        c.opt.graph_update, donate=False, traced=True)  # a graph's mesh: its data axis alone
        out = tensor_phases(x, setup, params, master, opt_state, scale, lr, momentum)
        new_params, new_master, new_opt = out.updated
        norm_sq = out.norm_sq
        if c.donate:
            # Write into the input state's buffers, unless the step overflowed (then it is skipped
            # and the input state must stay as it was).
            ok = torch.isfinite(norm_sq)
            new_params = _write_back(params, new_params, ok)
            new_master = _write_back(master, new_master, ok) if new_master is not None else None
            new_opt = _write_back(opt_state, new_opt, ok)
        return new_params, new_master, new_opt, torch.stack([norm_sq, out.loss_total]), out.auxes


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
