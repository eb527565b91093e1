"""`fnzero.train_step`: the pure training step `(state, batch) -> (state, metrics)`, and `run_step`,
its one ladder for the eager step and the whole-step graph alike: `_setup`, `_tensor_phases`,
`_grads`, `_update`, `_verdict`, each entered once (`specs/architecture.md` §How a batch flows)."""

from __future__ import annotations

import copy
from typing import Any, Callable

import torch

from ..optim import GradientTransformation, Optimizer
from ..schedules import from_config as schedule_from_config
from .._errors import ShardingError
from .._state import TrainState
from ..state import built_per_model, exchanging_optimizer_refused, optimizer_or_config, step_policy
from ._setup import StepSetup, split_micro_batches, step_setup
from ._tensor_phases import PhaseResult, eager_phases
from ._verdict import finish_step

__all__ = ["TrainStep", "train_step", "run_step", "split_micro_batches", "optimizer_or_config"]

_UNSET = object()


def train_step(
    loss_fn: Callable[..., Any],
    config: Any,
    *,
    donate: bool = False,
    has_aux: bool = False,
    optimizer: GradientTransformation | Optimizer | None = None,
) -> "TrainStep":
    """Build the pure step `(state, batch) -> (new_state, metrics)` for `loss_fn(params, batch)`.

    `loss_fn` returns the mean loss of one micro-batch (or `(loss, aux)` with `has_aux=True`); it
    receives the parameters as `state.params`-shaped aliases and runs the model with
    `sm.apply(params, ...)`. `batch` is this rank's data for one optimizer step: a list of
    `gradient_accumulation_steps` micro-batches, or one pytree split along dim 0.

    Metrics: `loss` (mean over micro-batches and ranks), `lr`, `grad_norm` (global, before
    clipping), `loss_scale`, `skipped` (fp16 overflow), and `aux` when `has_aux`.

    `donate=True` lets the step write into the input state's buffers (like JAX's donate_argnums):
    no second copy of the model state is allocated, and the input state must not be used again.

    `optimizer`: a chain of gradient transformations (`fnzero.optim.chain`; it runs the
    implementation it declares, else its own arithmetic) or an `Optimizer` (an implementation,
    run as it is), used instead of the config's chain; give the same one to `sm.init_state`. It
    keeps its own learning rate (metrics' `lr` is None) unless the config has a `scheduler`.
    """
    return TrainStep(loss_fn, config, donate=donate, has_aux=has_aux, optimizer=optimizer)


class TrainStep:
    """The pure step built by `train_step`; call it as `step(state, batch)`.

    Its parts are plain attributes (`loss_fn`, `config`, `donate`, `has_aux`) so transforms such as
    `fnzero.jit` can rebuild it around a different loss function.
    """

    def __init__(self, loss_fn: Callable[..., Any], config: Any, *, donate: bool = False, has_aux: bool = False,
                 optimizer: GradientTransformation | Optimizer | None = None):
        self.loss_fn = loss_fn
        self.config = config
        self._given = optimizer
        self.donate = donate
        self.has_aux = has_aux
        self.policy = step_policy(config)
        # A config's optimizer that reads facts of the model (per_head_muon's heads) is built by
        # `optimizer_for` from the state's sharding, where `shard` resolved them.
        self._per_model = built_per_model(optimizer, config)
        self.opt = None if self._per_model else optimizer_or_config(optimizer, config)
        self._model = _UNSET  # the state's `Sharding.config_optimizer` that `opt` was built with
        # A given optimizer keeps its own learning rate unless the config schedules one.
        own_lr = optimizer is not None and config.scheduler is None
        self.sched = None if own_lr else schedule_from_config(config)

    def optimizer_for(self, state: TrainState) -> Optimizer:
        """The optimizer this step runs on `state`: the given or config's one; a config's that reads
        facts of the model built with the state's `Sharding.config_optimizer` (again for another model's state)."""
        model = state.sharding.config_optimizer
        if self._per_model and self._model is not model:
            self.opt, self._model = optimizer_or_config(None, self.config, model=model), model
        return self.opt

    def with_loss_fn(self, loss_fn: Callable[..., Any]) -> "TrainStep":
        """The same step (config, optimizer, schedule) around another loss function."""
        new = copy.copy(self)
        new.loss_fn = loss_fn
        return new

    def __call__(self, state: TrainState, batch: Any) -> tuple[TrainState, dict[str, Any]]:
        if not isinstance(state, TrainState):
            raise ShardingError(f"train_step expects a fnzero.TrainState, got {type(state).__name__}")
        if state.opt_state is None:  # an optimizer's state is never None (a stateless one's is `()`)
            raise ShardingError(
                "this state has no optimizer state: it was made for inference (fnzero.init_inference, whose int8 "
                "weights cannot be trained either); train a state from sm.init_state() with an optimizer")
        if (state.loss_scale is None) != (self.policy.loss_scale is None):
            raise ShardingError(
                "the state's loss scaling does not match this step's config (fp16 on one side only); "
                "build both from the same config"
            )
        state.sharding.plan.check_params(state.params, "state.params")
        opt = self.optimizer_for(state)
        if opt.exchanges_gradients:
            _check_exchanging_optimizer(state)
        with torch.enable_grad():
            return run_step(state, batch, self, opt)


def run_step(state: TrainState, batch: Any, step: TrainStep, opt,
             graph: Callable[[StepSetup], PhaseResult] | None = None) -> tuple[TrainState, dict[str, Any]]:
    """The ladder, one for both ways of running a step: the host's setup (`_setup.py`), the tensor
    phases (`_tensor_phases.py`: eagerly, or `graph(setup)`, the whole-step graph around them),
    then the verdict on the two numbers every rank agreed on and the next state (`_verdict.py`),
    an fp16 overflow skipped with only the loss scale moved."""
    setup = step_setup(state, batch, step.policy, step.sched, opt)
    if graph is not None:
        out = graph(setup)
    else:
        out = eager_phases(state, setup, opt, step.policy, step.loss_fn, step.has_aux, step.donate)
    return finish_step(state, setup, out, step.policy, step.has_aux)


def _check_exchanging_optimizer(state: TrainState) -> None:
    """An optimizer that exchanges its momentum itself (1-bit Adam, 0/1 Adam, 1-bit LAMB) runs on
    whole parameters held by every data-parallel rank: ZeRO stage 0, no offload, no tensor, pipeline
    or expert parallelism (`specs/optim.md` §1-bit optimizers)."""
    sh = state.sharding
    sharded = [u.name for u in sh.plan.units if u.placement.params or u.placement.grads or u.placement.optimizer]
    where = ("sharded ZeRO units (" + ", ".join(sharded[:3]) + ")") if sharded else None
    if where is None and state.master is not None and any(m.device != p.device for m, p in
                                                          zip(state.master.values(), state.params.values())):
        where = "offload_optimizer"
    mesh = sh.mesh
    if where is None and (mesh.tp is not None and mesh.tp.size > 1):
        where = "tensor parallelism"
    if where is None and mesh.pp is not None:
        where = "pipeline parallelism"
    if where is None and mesh.ep is not None:
        where = "expert parallelism"
    if where is not None:
        raise exchanging_optimizer_refused(f"this state uses {where}")
