"""The last rung of the ladder (`_step.py`): the verdict on the two numbers every rank agreed on
(the squared gradient norm and the loss sum), the metrics, the next loss scale, and the next
state, or the same state where an fp16 overflow skips the step (`specs/sharding.md` §Step)."""

from __future__ import annotations

import math
from typing import Any

import torch

from .._errors import ShardingError
from .._state import TrainState
from ..state import StepPolicy, scaler_for, update_loss_scale
from ._setup import StepSetup
from ._tensor_phases import PhaseResult

__all__ = ["finish_step", "step_verdict", "loss_scale_after", "next_state"]


def finish_step(state: TrainState, setup: StepSetup, out: PhaseResult, policy: StepPolicy,
                has_aux: bool) -> tuple[TrainState, dict[str, Any]]:
    """(the next state, metrics) from the tensor phases' result: the verdict, then the state
    after an applied step, or the input state with only its loss scale moved where the step
    overflowed (a donated state's buffers were left as they were)."""
    metrics, new_ls = step_verdict(state, setup, policy, float(out.norm_sq), float(out.loss_total), out.auxes, has_aux)
    if out.timings is not None:
        metrics["timings"] = out.timings
    return next_state(state, None if metrics["skipped"] else out.updated, new_ls), metrics


def step_verdict(state: TrainState, setup: StepSetup, policy: StepPolicy, norm_sq: float, loss_total: float,
                 auxes: list, has_aux: bool) -> tuple[dict[str, Any], Any]:
    """(metrics, next loss scale) from the two numbers every rank agreed on. `metrics["skipped"]`
    is the fp16 overflow verdict (a non-finite norm on any rank): the step is then not applied.
    Without loss scaling a non-finite norm raises (`loss_scale_after`)."""
    overflow = not math.isfinite(norm_sq)
    metrics: dict[str, Any] = {
        "loss": loss_total / (setup.k * setup.n),
        "lr": setup.lr,
        "grad_norm": math.sqrt(norm_sq) if not overflow else float("inf"),
        "loss_scale": setup.scale if state.loss_scale is not None else None,
        "skipped": overflow,
    }
    if has_aux:
        metrics["aux"] = auxes if setup.k > 1 else auxes[0]
    return metrics, loss_scale_after(state, policy, overflow, setup.step_no, state.sharding.comm.rank)


def loss_scale_after(state: TrainState, policy: StepPolicy, overflow: bool, step_no: int, rank: int):
    """The next loss-scale state (None without fp16 scaling). A non-finite gradient norm without
    loss scaling cannot be skipped silently: it raises."""
    if state.loss_scale is None:
        if overflow:
            raise ShardingError(
                f"non-finite gradient norm at step {step_no} (rank {rank}) without fp16 loss scaling; "
                "the loss or the model produced inf/NaN"
            )
        return None
    return update_loss_scale(state.loss_scale, overflow, scaler_for(policy.loss_scale, state.sharding.plan.placement))


def next_state(state: TrainState, updated: tuple | None, loss_scale) -> TrainState:
    """The state after a step: with `updated` (new parameters, master and optimizer state) the
    step count advanced; without (a skipped step) the same state at the next loss scale."""
    if updated is None:
        return state.replace(loss_scale=loss_scale)
    params, master, opt_state = updated
    return state.replace(params=params, master=master, opt_state=opt_state,
                         step=torch.tensor(int(state.step) + 1, dtype=torch.int64), loss_scale=loss_scale)
