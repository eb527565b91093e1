"""`fnzero.train_step`: the pure training step `(state, batch) -> (state, metrics)`.

One mechanism serves every placement (`specs/sharding.md`, `specs/collectives.md`); each unit's
`Placement` says what of it is sharded, and the step reads nothing else:

* The loss is differentiated with respect to fresh aliases of `state.params` (one flat buffer or
  shard per unit), so the input state is never touched.
* A post-accumulate-grad hook on each alias moves the unit's gradient into this step's accumulator
  as soon as backward produces it: with gradients sharded it is reduce-scattered there, so only one
  unit's full gradient exists at a time; with parameters sharded `GatherUnit`'s backward already
  reduced it to a shard.
* After the last micro-batch, whole-unit gradients are reduced: all-reduced where the optimizer
  state is replicated, reduce-scattered where it is sharded. One scalar all-reduce gives the global
  gradient norm, the fp16 overflow verdict (a non-finite norm on any rank) and the mean loss.
* The optimizer updates this rank's master slice; units whose optimizer state is sharded but
  parameters are not all-gather the new parameters.
"""

from __future__ import annotations

import copy
from typing import Any, Callable

import torch

from .. import optim as _optim, schedules as _schedules
from .._errors import ShardingError
from .._state import TrainState
from ._ladder import PhaseResult, StepContext, run_step, tensor_phases
from ._phases import StepSetup, Timer, split_micro_batches
from ..sharding import stepped_in_place
from ..state import built_per_model, exchanging_optimizer_refused, optimizer_or_config, step_policy
from ._update import optimizer_exchange

__all__ = ["TrainStep", "train_step", "split_micro_batches", "optimizer_or_config"]

_UNSET = object()


def train_step(
    loss_fn: Callable[..., Any],
    config: Any,
    *,
    donate: bool = False,
    has_aux: bool = False,
    optimizer: "_optim.GradientTransformation | _optim.Optimizer | None" = None,
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
                 optimizer: "_optim.GradientTransformation | _optim.Optimizer | None" = None):
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
        self.sched = None if own_lr else _schedules.from_config(config)

    def optimizer_for(self, state: TrainState) -> "_optim.Optimizer":
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
            return self._eager(state, batch, opt)

    def _eager(self, state: TrainState, batch: Any, opt) -> tuple[TrainState, dict[str, Any]]:
        """The ladder (`_ladder.run_step`) run eagerly: the state's own collectives, autograd
        hooks, Python numbers, the optimizer's `update` (`update_` when donated)."""
        sh = state.sharding
        timer = Timer(self.policy.timings, sh.device)

        def phases(setup: StepSetup) -> PhaseResult:
            param_source = stepped_in_place(state)  # an older state than its files' is refused before any work
            if sh.watchdog is not None:  # its verdicts name the step a rank was stuck in
                sh.watchdog.at_step(setup.step_no + 1)
            x = StepContext(sh.plan, sh.mesh, sh.device, self.policy, self.loss_fn, self.has_aux, opt,
                            opt.update_ if self.donate else opt.update, self.donate, quantization=sh.quantization,
                            exchange=optimizer_exchange(opt, sh.comm), param_source=param_source, timer=timer)
            return tensor_phases(x, setup, state.params, state.master, state.opt_state, setup.scale, setup.lr,
                                 setup.momentum)

        return run_step(state, batch, self.policy, self.sched, opt, self.has_aux, phases, timer)


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
