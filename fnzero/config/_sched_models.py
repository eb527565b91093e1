"""`scheduler`: the learning-rate schedule type and its per-type `params`.

Names and defaults follow deepspeed/runtime/lr_schedules.py. Values that would make DeepSpeed
divide by zero or silently fall back (an unknown warmup_type becomes "log" there) are errors.
"""

from __future__ import annotations

from typing import Annotated, Literal, Union

from pydantic import Field, model_validator

from ._types import Bool, Int, Model, NonNegFloat, NonNegInt, PosInt, before, lowered

__all__ = [
    "SchedulerConfig", "SchedulerParams", "SCHEDULER_PARAMS", "SCHEDULER_TYPES",
    "WarmupLRParams", "WarmupDecayLRParams", "WarmupCosineLRParams", "OneCycleParams", "LRRangeTestParams",
]

LastIter = Annotated[Int, Field(ge=-1)]
WarmupType = Literal["log", "linear"]


class _WarmupBase(Model):
    # Shared fields; not itself a union member, so the two subclasses never shadow each other.
    warmup_min_lr: NonNegFloat = Field(0.0, description="Learning rate at step 0.")
    warmup_num_steps: PosInt = Field(1000, description="Steps of warmup.")
    warmup_type: WarmupType = Field("log", description="Shape of the warmup ramp: log or linear.")
    last_batch_iteration: LastIter = Field(-1, description="Step to resume from; -1 starts fresh.")

    _wt = before(lowered, "warmup_type")


class WarmupLRParams(_WarmupBase):
    """`scheduler.params` for WarmupLR: ramp from warmup_min_lr to warmup_max_lr, then hold."""

    warmup_max_lr: NonNegFloat | None = Field(
        None, description="Learning rate after warmup; null = the optimizer's lr (resolved at load when known)."
    )


class _WarmupWithinTotal(Model):
    """Params whose warmup must end by `total_num_steps`."""

    @model_validator(mode="after")
    def _order(self) -> "_WarmupWithinTotal":
        total, warmup = self.total_num_steps, self.warmup_num_steps  # type: ignore[attr-defined]
        if total < warmup:
            raise ValueError(f"total_num_steps {total} is less than warmup_num_steps {warmup}; the schedule would "
                             "never finish warming up, so raise total_num_steps or lower warmup_num_steps")
        return self


class WarmupDecayLRParams(_WarmupBase, _WarmupWithinTotal):
    """`scheduler.params` for WarmupDecayLR: WarmupLR, then linear decay to 0 at total_num_steps."""

    warmup_max_lr: NonNegFloat = Field(0.001, description="Learning rate after warmup.")
    total_num_steps: PosInt = Field(description="Total training steps; required.")


class WarmupCosineLRParams(_WarmupWithinTotal):
    """`scheduler.params` for WarmupCosineLR: warmup as a ratio of the optimizer lr, then cosine decay."""

    total_num_steps: PosInt = Field(description="Total training steps; required.")
    warmup_min_ratio: NonNegFloat = Field(0.0, description="Starting lr as a fraction of the optimizer lr.")
    warmup_num_steps: PosInt = Field(1000, description="Steps of warmup.")
    cos_min_ratio: NonNegFloat = Field(0.0001, description="Final lr as a fraction of the optimizer lr.")
    warmup_type: WarmupType = Field("log", description="Shape of the warmup ramp: log or linear.")
    last_batch_iteration: LastIter = Field(-1, description="Step to resume from; -1 starts fresh.")

    _wt = before(lowered, "warmup_type")


class OneCycleParams(Model):
    """`scheduler.params` for OneCycle. cycle_min_lr and cycle_max_lr have no default in DeepSpeed either."""

    cycle_min_lr: NonNegFloat = Field(description="Lower learning rate of the cycle; required.")
    cycle_max_lr: NonNegFloat = Field(description="Upper learning rate of the cycle; required.")
    decay_lr_rate: NonNegFloat = Field(0.0, description="Learning-rate decay after the cycle; 0 = none.")
    cycle_first_step_size: PosInt = Field(2000, description="Steps in the rising half of the cycle.")
    cycle_second_step_size: NonNegInt | None = Field(None, description="Steps in the falling half; null = first size.")
    cycle_first_stair_count: NonNegInt = Field(0, description="Stairs in the rising half; 0 = smooth.")
    cycle_second_stair_count: NonNegInt | None = Field(None, description="Stairs in the falling half; null = first count.")
    decay_step_size: NonNegInt = Field(0, description="Interval of post-cycle decay; 0 = none.")
    cycle_momentum: Bool = Field(True, description="Cycle momentum (beta1) inversely to the lr.")
    cycle_min_mom: NonNegFloat = Field(0.8, description="Lower momentum of the cycle.")
    cycle_max_mom: NonNegFloat = Field(0.9, description="Upper momentum of the cycle.")
    decay_mom_rate: NonNegFloat = Field(0.0, description="Momentum decay after the cycle; 0 = none.")
    last_batch_iteration: LastIter = Field(-1, description="Step to resume from; -1 starts fresh.")

    @model_validator(mode="after")
    def _order(self) -> "OneCycleParams":
        if self.cycle_min_lr > self.cycle_max_lr:
            raise ValueError(f"cycle_min_lr {self.cycle_min_lr!r} exceeds cycle_max_lr {self.cycle_max_lr!r}; swap them")
        if self.decay_lr_rate > 0 and self.decay_step_size == 0:
            raise ValueError("decay_lr_rate > 0 needs decay_step_size > 0 (DeepSpeed divides by it); set decay_step_size")
        return self


class LRRangeTestParams(Model):
    """`scheduler.params` for LRRangeTest: grow the lr from lr_range_test_min_lr each step interval."""

    lr_range_test_min_lr: NonNegFloat = Field(1e-3, description="Starting learning rate.")
    lr_range_test_step_size: PosInt = Field(2000, description="Steps per increase interval.")
    lr_range_test_step_rate: NonNegFloat = Field(1.0, description="Growth per interval.")
    lr_range_test_staircase: Bool = Field(False, description="Step-wise (true) or continuous (false) growth.")
    last_batch_iteration: LastIter = Field(-1, description="Step to resume from; -1 starts fresh.")


SCHEDULER_PARAMS: dict[str, type[Model]] = {
    "WarmupLR": WarmupLRParams, "WarmupDecayLR": WarmupDecayLRParams, "WarmupCosineLR": WarmupCosineLRParams,
    "OneCycle": OneCycleParams, "LRRangeTest": LRRangeTestParams,
}
SCHEDULER_TYPES = tuple(SCHEDULER_PARAMS)
SchedulerParams = Union[WarmupLRParams, WarmupDecayLRParams, WarmupCosineLRParams, OneCycleParams, LRRangeTestParams]


class SchedulerConfig(Model):
    """`scheduler`: `type` (matched case-insensitively, stored canonically) and its validated `params`."""

    type: Literal["WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle", "LRRangeTest"] = Field(
        description="Learning-rate schedule type."
    )
    params: SchedulerParams = Field(description="Per-type parameters.")

    @model_validator(mode="after")
    def _params_match_type(self) -> "SchedulerConfig":
        if type(self.params) is not SCHEDULER_PARAMS[self.type]:
            raise ValueError(f"params of type {type(self.params).__name__} do not belong to scheduler type {self.type}")
        return self
