"""fnzero.schedules: each schedule against a simulation of DeepSpeed's scheduler classes,
stepped the way DeepSpeed's engine steps them; plus validation and from_config.

DeepSpeed cannot be installed here, so `_ds` below transcribes the state machines of
deepspeed/runtime/lr_schedules.py (constructor side effects, step(), get_lr()) and `engine_lrs`
drives one as deepspeed/runtime/engine.py does: the scheduler is built once, the optimizer
step reads param_groups[0]["lr"] (and "betas"), and scheduler.step() follows each applied
step but not a skipped (fp16 overflow) one.
"""

from __future__ import annotations

import math
from types import SimpleNamespace as NS

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from fnzero._errors import ConfigError
from fnzero import schedules

SETTINGS = settings(max_examples=400, deadline=None, derandomize=True)


# -- a transcription of DeepSpeed's schedulers -------------------------------------------


class _SimOptimizer:
    def __init__(self, lr, betas=None):
        group = {"lr": lr}
        self.defaults = {"lr": lr}
        if betas is not None:
            group["betas"] = betas
            self.defaults["betas"] = betas
        self.param_groups = [group]


class _ds:
    class WarmupLR:
        def __init__(self, optimizer, warmup_min_lr=0.0, warmup_max_lr=None, warmup_num_steps=1000,
                     warmup_type="log", last_batch_iteration=-1):
            if not isinstance(warmup_num_steps, int) or warmup_num_steps <= 0:
                raise ValueError("warmup_num_steps")
            self.optimizer = optimizer
            if warmup_max_lr is None:
                warmup_max_lr = optimizer.param_groups[0]["lr"]
            self.min_lr = warmup_min_lr
            self.delta_lr = warmup_max_lr - warmup_min_lr
            self.warmup_num_steps = max(2, warmup_num_steps)
            self.warmup_type = warmup_type
            self.inverse_log_warm_up = 1.0 / math.log(self.warmup_num_steps)
            self.last_batch_iteration = last_batch_iteration
            if last_batch_iteration == -1:
                self.optimizer.param_groups[0]["lr"] = self.get_lr()

        def get_lr(self):
            if self.last_batch_iteration < 0:
                return self.min_lr
            return self.min_lr + (self.delta_lr * self._get_gamma())

        def _warm(self):
            if self.warmup_type == "log":
                return self.inverse_log_warm_up * math.log(self.last_batch_iteration + 1)
            return self.last_batch_iteration / self.warmup_num_steps

        def _get_gamma(self):
            if self.last_batch_iteration < self.warmup_num_steps:
                return self._warm()
            return 1.0

        def step(self):
            self.last_batch_iteration += 1
            self.optimizer.param_groups[0]["lr"] = self.get_lr()

    class WarmupDecayLR(WarmupLR):
        def __init__(self, optimizer, total_num_steps, warmup_min_lr=0.0, warmup_max_lr=0.001,
                     warmup_num_steps=1000, warmup_type="log", last_batch_iteration=-1):
            self.total_num_steps = total_num_steps
            super().__init__(optimizer, warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type, last_batch_iteration)

        def _get_gamma(self):
            if self.last_batch_iteration < self.warmup_num_steps:
                return self._warm()
            return max(0.0, float(self.total_num_steps - self.last_batch_iteration)
                       / float(max(1.0, self.total_num_steps - self.warmup_num_steps)))

    class WarmupCosineLR:
        def __init__(self, optimizer, total_num_steps, warmup_min_ratio=0.0, warmup_num_steps=1000,
                     cos_min_ratio=0.0001, warmup_type="log", last_batch_iteration=-1):
            if not isinstance(warmup_num_steps, int) or warmup_num_steps <= 0:
                raise ValueError("warmup_num_steps")
            self.optimizer = optimizer
            self.total_num_steps = total_num_steps
            self.last_batch_iteration = last_batch_iteration
            self.cos_min_ratio = cos_min_ratio
            self.warmup_type = warmup_type
            self.warmup_min_ratio = warmup_min_ratio
            self.warmup_num_steps = max(2, warmup_num_steps)
            self.inverse_log_warm_up = 1.0 / math.log(self.warmup_num_steps)
            self.org_lr = optimizer.param_groups[0]["lr"]
            if last_batch_iteration == -1:
                self.optimizer.param_groups[0]["lr"] = self.get_lr()

        def get_lr_ratio(self):
            if self.last_batch_iteration < 0:
                return 0.0
            if self.last_batch_iteration < self.warmup_num_steps:
                if self.warmup_type == "log":
                    ratio = self.inverse_log_warm_up * math.log(self.last_batch_iteration + 1)
                else:
                    ratio = self.last_batch_iteration / self.warmup_num_steps
                return self.warmup_min_ratio + ratio * (1.0 - self.warmup_min_ratio)
            real_last_step = self.last_batch_iteration - self.warmup_num_steps + 1
            real_total_steps = max(1, self.total_num_steps - self.warmup_num_steps)
            progress = min(1.0, real_last_step / real_total_steps)
            ratio = (1 + math.cos(math.pi * progress)) / 2
            return max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * ratio)

        def get_lr(self):
            if self.last_batch_iteration < 0:
                return 0.0
            return self.org_lr * self.get_lr_ratio()

        def step(self):
            self.last_batch_iteration += 1
            self.optimizer.param_groups[0]["lr"] = self.get_lr()

    class OneCycle:
        def __init__(self, optimizer, cycle_min_lr, cycle_max_lr, decay_lr_rate=0.0, cycle_first_step_size=2000,
                     cycle_second_step_size=None, cycle_first_stair_count=0, cycle_second_stair_count=None,
                     decay_step_size=0, cycle_momentum=True, cycle_min_mom=0.8, cycle_max_mom=0.9,
                     decay_mom_rate=0.0, last_batch_iteration=-1):
            self.optimizer = optimizer
            first = float(cycle_first_step_size)
            second = float(cycle_second_step_size) if cycle_second_step_size is not None else first
            self.total_size = first + second
            self.step_ratio = first / self.total_size
            self.first_step_size, self.second_step_size = first, second
            self.first_stair_count = cycle_first_stair_count
            self.second_stair_count = cycle_first_stair_count if cycle_second_stair_count is None else cycle_second_stair_count
            self.decay_step_size = decay_step_size
            self.skip_lr_decay = self.skip_mom_decay = math.isclose(decay_step_size, 0)
            self.min_lr, self.max_lr = cycle_min_lr, cycle_max_lr
            if last_batch_iteration == -1:
                optimizer.param_groups[0]["lr"] = cycle_min_lr
            self.decay_lr_rate = decay_lr_rate
            if math.isclose(decay_lr_rate, 0):
                self.skip_lr_decay = True
            self.cycle_momentum = cycle_momentum
            if cycle_momentum:
                if "betas" not in optimizer.defaults:
                    self.cycle_momentum = False  # DeepSpeed logs a warning and carries on
                else:
                    self.decay_mom_rate = decay_mom_rate
                    self.min_mom, self.max_mom = (cycle_min_mom, 0.99), (cycle_max_mom, 0.99)
                    if last_batch_iteration == -1:
                        optimizer.param_groups[0]["betas"] = self.min_mom
                    if math.isclose(decay_mom_rate, 0):
                        self.skip_mom_decay = True
            self.last_batch_iteration = last_batch_iteration

        def _get_scale_factor(self):
            batch_iteration = self.last_batch_iteration + 1
            cycle = math.floor(1 + batch_iteration / self.total_size)
            x = 1.0 + batch_iteration / self.total_size - cycle
            if x <= self.step_ratio:
                scale_factor, stair_count = x / self.step_ratio, self.first_stair_count
            else:
                scale_factor, stair_count = (x - 1) / (self.step_ratio - 1), self.second_stair_count
            if stair_count > 0:
                cycle_iteration = batch_iteration % self.total_size
                if cycle_iteration <= self.first_step_size:
                    stair_position = cycle_iteration * stair_count / self.first_step_size
                else:
                    stair_position = (self.total_size - cycle_iteration) * stair_count / self.second_step_size
                scale_factor = math.floor(stair_position) / stair_count
            return scale_factor

        def get_lr(self):
            if self.last_batch_iteration < self.total_size:
                return self.min_lr + (self.max_lr - self.min_lr) * self._get_scale_factor()
            if self.skip_lr_decay:
                return self.min_lr
            decay_interval = (self.last_batch_iteration - self.total_size + 1) / self.decay_step_size
            return self.min_lr / (1 + self.decay_lr_rate * decay_interval)

        def get_mom(self):
            if self.last_batch_iteration < self.total_size:
                base_height = (self.max_mom[0] - self.min_mom[0]) * self._get_scale_factor()
                return (self.max_mom[0] - base_height, 0.99)
            if self.skip_mom_decay:
                return self.max_mom
            decay_interval = (self.last_batch_iteration - self.total_size + 1) / self.decay_step_size
            return (self.max_mom[0] * (1 + self.decay_mom_rate * decay_interval), 0.99)

        def step(self):
            self.last_batch_iteration += 1
            self.optimizer.param_groups[0]["lr"] = self.get_lr()
            if self.cycle_momentum:
                self.optimizer.param_groups[0]["betas"] = self.get_mom()

    class LRRangeTest:
        def __init__(self, optimizer, lr_range_test_min_lr=1e-3, lr_range_test_step_size=2000,
                     lr_range_test_step_rate=1.0, lr_range_test_staircase=False, last_batch_iteration=-1):
            self.optimizer = optimizer
            self.min_lr = lr_range_test_min_lr
            self.step_size, self.step_rate = lr_range_test_step_size, lr_range_test_step_rate
            self.staircase = lr_range_test_staircase
            self.last_batch_iteration = last_batch_iteration
            if last_batch_iteration == -1:
                optimizer.param_groups[0]["lr"] = self.min_lr

        def get_lr(self):
            interval = float(self.last_batch_iteration + 1) / self.step_size
            if self.staircase:
                interval = math.floor(interval)
            return self.min_lr * (1 + self.step_rate * interval)

        def step(self):
            self.last_batch_iteration += 1
            self.optimizer.param_groups[0]["lr"] = self.get_lr()


def engine_run(cls, params, n_applied, *, base_lr=0.01, betas=(0.9, 0.999), skips=()):
    """The (lr, beta1) each applied step runs with, as DeepSpeed's engine drives `cls`.

    `skips[j]` micro-steps overflow before applied step j: the optimizer step is skipped and
    the scheduler is not stepped, so they must not move the schedule.
    """
    opt = _SimOptimizer(base_lr, betas)
    sched = cls(opt, **params)
    seen = []
    for j in range(n_applied):
        group = opt.param_groups[0]
        for _ in range(skips[j] if j < len(skips) else 0):
            # engine: an overflow skips optimizer.step() and lr_scheduler.step() alike, so a
            # skipped micro-step ran with this same lr and leaves it in place.
            pass
        seen.append((group["lr"], group["betas"][0] if "betas" in group else None))
        sched.step()  # engine: after an applied optimizer step
    return seen


def check_against_engine(schedule, cls, params, n, *, base_lr=0.01, betas=(0.9, 0.999), momentum=False):
    seen = engine_run(cls, params, n, base_lr=base_lr, betas=betas)
    for k, (lr, mom) in enumerate(seen):
        assert schedule(k) == lr, (k, schedule(k), lr)
        assert schedule.lr(k) == lr
        if momentum:
            assert schedule.momentum(k) == mom, (k, schedule.momentum(k), mom)


# -- parity --------------------------------------------------------------------------------

lr_st = st.floats(0.0, 1.0, allow_subnormal=False)
warm_steps_st = st.one_of(st.sampled_from([1, 2, 3]), st.integers(1, 60))
last_st = st.one_of(st.just(-1), st.integers(0, 80))
kind_st = st.sampled_from(["log", "linear"])


@SETTINGS
@given(lo=lr_st, hi=st.one_of(st.none(), lr_st), n=warm_steps_st, kind=kind_st, last=last_st, base=lr_st)
def test_warmup_lr_matches_deepspeed(lo, hi, n, kind, last, base):
    params = dict(warmup_min_lr=lo, warmup_max_lr=hi, warmup_num_steps=n, warmup_type=kind, last_batch_iteration=last)
    s = schedules.warmup_lr(**params, base_lr=base)
    check_against_engine(s, _ds.WarmupLR, params, 3 * n + 10, base_lr=base)
    assert s.momentum is None


@SETTINGS
@given(total=st.integers(0, 120), lo=lr_st, hi=lr_st, n=warm_steps_st, kind=kind_st, last=last_st, base=lr_st)
def test_warmup_decay_lr_matches_deepspeed(total, lo, hi, n, kind, last, base):
    params = dict(total_num_steps=total, warmup_min_lr=lo, warmup_max_lr=hi, warmup_num_steps=n, warmup_type=kind,
                  last_batch_iteration=last)
    s = schedules.warmup_decay_lr(**params, base_lr=base)
    check_against_engine(s, _ds.WarmupDecayLR, params, total + n + 10, base_lr=base)


@SETTINGS
@given(total=st.integers(0, 120), wmin=st.floats(0.0, 1.0), n=warm_steps_st, cmin=st.floats(0.0, 1.0), kind=kind_st,
       last=last_st, base=lr_st)
def test_warmup_cosine_lr_matches_deepspeed(total, wmin, n, cmin, kind, last, base):
    params = dict(total_num_steps=total, warmup_min_ratio=wmin, warmup_num_steps=n, cos_min_ratio=cmin,
                  warmup_type=kind, last_batch_iteration=last)
    s = schedules.warmup_cosine_lr(**params, base_lr=base)
    check_against_engine(s, _ds.WarmupCosineLR, params, total + n + 10, base_lr=base)


@SETTINGS
@given(
    lo=lr_st, hi=lr_st, decay_lr_rate=st.sampled_from([0.0, 0.001, 0.5, 2.0]),
    first=st.integers(1, 30), second=st.one_of(st.none(), st.integers(0, 30)),
    stairs1=st.sampled_from([-1, 0, 1, 2, 3, 7]), stairs2=st.one_of(st.none(), st.sampled_from([0, 1, 2, 5])),
    decay_step_size=st.sampled_from([0, 1, 3, 10]), cycle_momentum=st.booleans(),
    min_mom=st.floats(0.5, 0.9), max_mom=st.floats(0.8, 0.99), decay_mom_rate=st.sampled_from([0.0, 0.01, 0.2]),
    last=last_st, base=lr_st, base_beta=st.floats(0.0, 0.99), has_betas=st.booleans(),
)
def test_one_cycle_matches_deepspeed(lo, hi, decay_lr_rate, first, second, stairs1, stairs2, decay_step_size,
                                     cycle_momentum, min_mom, max_mom, decay_mom_rate, last, base, base_beta, has_betas):
    params = dict(cycle_min_lr=lo, cycle_max_lr=hi, decay_lr_rate=decay_lr_rate, cycle_first_step_size=first,
                  cycle_second_step_size=second, cycle_first_stair_count=stairs1, cycle_second_stair_count=stairs2,
                  decay_step_size=decay_step_size, cycle_momentum=cycle_momentum, cycle_min_mom=min_mom,
                  cycle_max_mom=max_mom, decay_mom_rate=decay_mom_rate, last_batch_iteration=last)
    n = 2 * (first + (first if second is None else second)) + 3 * max(decay_step_size, 1) + 5
    betas = (base_beta, 0.999) if has_betas else None
    # DeepSpeed cycles momentum only for optimizers with betas; from_config mirrors that by
    # turning cycle_momentum off for the others.
    s = schedules.one_cycle(**{**params, "cycle_momentum": cycle_momentum and has_betas},
                            base_lr=base, base_momentum=base_beta if has_betas else None)
    check_against_engine(s, _ds.OneCycle, params, n, base_lr=base, betas=betas, momentum=cycle_momentum and has_betas)
    if not (cycle_momentum and has_betas):
        assert s.momentum is None


@SETTINGS
@given(lo=lr_st, size=st.integers(1, 20), rate=st.floats(0.0, 10.0), staircase=st.booleans(), last=last_st, base=lr_st)
def test_lr_range_test_matches_deepspeed(lo, size, rate, staircase, last, base):
    params = dict(lr_range_test_min_lr=lo, lr_range_test_step_size=size, lr_range_test_step_rate=rate,
                  lr_range_test_staircase=staircase, last_batch_iteration=last)
    s = schedules.lr_range_test(**params, base_lr=base)
    check_against_engine(s, _ds.LRRangeTest, params, 4 * size + 5, base_lr=base)


def test_skipped_steps_do_not_advance_the_schedule():
    params = dict(warmup_min_lr=0.0, warmup_max_lr=1.0, warmup_num_steps=10, warmup_type="linear")
    seen = engine_run(_ds.WarmupLR, params, 12, skips=(0, 3, 0, 2))
    s = schedules.warmup_lr(**params)
    assert [s(k) for k in range(12)] == [lr for lr, _ in seen]


def test_first_steps_follow_the_engine_convention():
    # WarmupLR: the constructor writes min_lr, and step() first moves to iteration 0 whose log
    # ramp is log(1) = 0, so the first two steps both use min_lr.
    s = schedules.warmup_lr(0.1, 1.0, warmup_num_steps=10)
    assert s(0) == s(1) == 0.1 and s(2) == 0.1 + 0.9 * math.log(2) / math.log(10)
    # WarmupCosineLR: before the first step() DeepSpeed's get_lr is 0.
    c = schedules.warmup_cosine_lr(100, warmup_min_ratio=0.5, warmup_num_steps=10, base_lr=1.0)
    assert c(0) == 0.0 and c(1) == 0.5
    # warmup_num_steps=1 is treated as 2, as DeepSpeed's max(2, n) does.
    assert [schedules.warmup_lr(0, 1, 1, "linear")(k) for k in range(4)] == \
        [schedules.warmup_lr(0, 1, 2, "linear")(k) for k in range(4)] == [0.0, 0.0, 0.5, 1.0]
    # Resuming: the first step keeps the optimizer's lr, then the schedule continues from L.
    r = schedules.warmup_lr(0.0, 1.0, 10, "linear", last_batch_iteration=4, base_lr=0.123)
    assert r(0) == 0.123 and r(1) == 0.5
    assert schedules.warmup_lr(0.0, 1.0, 10, "linear", last_batch_iteration=4)(0) == 0.4


# -- validation, API -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: schedules.warmup_lr(warmup_num_steps=0), r"^warmup_lr: warmup_num_steps=0 must be >= 1$"),
        (lambda: schedules.warmup_lr(warmup_num_steps=2.5), r"warmup_num_steps=2.5 must be an integer"),
        (lambda: schedules.warmup_lr(warmup_type="cosine"), r"warmup_type='cosine' must be 'log' or 'linear'"),
        (lambda: schedules.warmup_lr(warmup_min_lr=-1.0), r"warmup_min_lr=-1.0 must be >= 0"),
        (lambda: schedules.warmup_lr(last_batch_iteration=-2), r"last_batch_iteration=-2 must be >= -1"),
        (lambda: schedules.warmup_decay_lr(-5), r"total_num_steps=-5 must be >= 0"),
        (lambda: schedules.warmup_decay_lr(10, warmup_num_steps=-1), r"warmup_num_steps=-1"),
        (lambda: schedules.warmup_cosine_lr(10, base_lr=float("inf")), r"base_lr=inf must be a finite number"),
        (lambda: schedules.warmup_cosine_lr(10, warmup_num_steps=0, base_lr=0.1), r"warmup_num_steps=0"),
        (lambda: schedules.one_cycle(0.1, 1.0, cycle_first_step_size=0), r"cycle_first_step_size=0 must be >= 1"),
        (lambda: schedules.one_cycle(0.1, 1.0, cycle_second_step_size=-1), r"cycle_second_step_size=-1"),
        (lambda: schedules.one_cycle(0.1, 1.0, decay_step_size=-1), r"decay_step_size=-1"),
        (lambda: schedules.one_cycle(0.1, 1.0, cycle_momentum="yes"), r"cycle_momentum='yes'"),
        (lambda: schedules.lr_range_test(lr_range_test_step_size=0), r"lr_range_test_step_size=0 must be >= 1"),
        (lambda: schedules.constant(float("nan")), r"constant: lr=nan"),
    ],
)
def test_bad_hyper_parameters_are_named(make, message):
    with pytest.raises(ConfigError, match=message):
        make()


def test_schedule_api():
    s = schedules.constant(0.5)
    assert s(0) == s.lr(7) == 0.5 and s.momentum is None
    with pytest.raises(ValueError):
        s(-1)
    with pytest.raises(TypeError):
        s(1.5)
    with pytest.raises(Exception):
        s.lr = None  # frozen
    assert schedules.warmup_lr(warmup_type="LINEAR")(5) == schedules.warmup_lr(warmup_type="linear")(5)


class _Params:
    def __init__(self, **kw):
        self._kw = kw

    def model_dump(self):
        return dict(self._kw)


def _cfg(opt_type="AdamW", opt_params=None, sched_type=None, sched_params=None):
    opt_params = {"lr": 0.02} if opt_params is None else opt_params
    optimizer = None if opt_type is None else NS(type=opt_type, params=_Params(**opt_params))
    scheduler = None if sched_type is None else NS(type=sched_type, params=_Params(**(sched_params or {})))
    return NS(optimizer=optimizer, scheduler=scheduler)


def test_from_config():
    assert schedules.from_config(_cfg())(123) == 0.02
    assert schedules.from_config(_cfg(opt_params={}))(0) == 1e-3  # the optimizer's default lr
    s = schedules.from_config(_cfg(sched_type="warmuplr", sched_params=dict(warmup_num_steps=4, warmup_max_lr=None)))
    assert s(100) == 0.02  # warmup_max_lr null = the optimizer's lr
    s = schedules.from_config(_cfg(sched_type="WarmupCosineLR", sched_params=dict(total_num_steps=20, warmup_num_steps=2)))
    assert s(0) == s(1) == 0.0 and s(2) == pytest.approx(0.02) and s(20) == pytest.approx(0.02 * 1e-4)
    params = dict(cycle_min_lr=0.01, cycle_max_lr=0.1, cycle_first_step_size=5)
    assert schedules.from_config(_cfg(sched_type="OneCycle", sched_params=params)).momentum(1) == pytest.approx(0.88)
    assert schedules.from_config(_cfg("SGD", {"lr": 0.1, "momentum": 0.9}, "OneCycle", params)).momentum is None
    assert schedules.from_config(_cfg("Adagrad", None, "OneCycle", params)).momentum is None
    s = schedules.from_config(_cfg(sched_type="OneCycle", sched_params={**params, "last_batch_iteration": 3},
                                   opt_params={"lr": 0.5, "betas": (0.7, 0.9)}))
    assert (s(0), s.momentum(0)) == (0.5, 0.7)
    s = schedules.from_config(_cfg(sched_type="LRRangeTest", sched_params=dict(lr_range_test_step_size=3)))
    assert s(3) == 2e-3
    with pytest.raises(ConfigError, match="not supported"):
        schedules.from_config(_cfg(sched_type="StepLR"))
    with pytest.raises(ConfigError, match="scheduler WarmupLR: .*warmup_steps"):
        schedules.from_config(_cfg(sched_type="WarmupLR", sched_params=dict(warmup_steps=4)))
    with pytest.raises(ConfigError, match="no `optimizer` block"):
        schedules.from_config(_cfg(None, sched_type="WarmupCosineLR", sched_params=dict(total_num_steps=4)))
    with pytest.raises(ConfigError, match="neither"):
        schedules.from_config(_cfg(None))
    assert schedules.from_config(_cfg(None, sched_type="WarmupLR", sched_params={}))(10**6) == 0.001
