"""fp16 dynamic loss scaling transitions (specs/loss-scaling.md), against a transcription of
DeepSpeed 0.19.8's DynamicLossScaler.update_scale state machine (runtime/fp16/loss_scaler.py)."""

from hypothesis import given
from hypothesis import strategies as st

from fnzero.state import LossScalePolicy, init_loss_scale, update_loss_scale


class DeepSpeedScaler:
    """cur_iter/last_overflow_iter bookkeeping as in DeepSpeed 0.19.8's loss_scaler.py: a clean
    step raises the scale when the clean steps before it since the last overflow (or the start),
    `stable_interval`, are a positive multiple of the window."""

    def __init__(self, p: LossScalePolicy):
        self.cur_scale = 2.0 ** p.initial_scale_power
        self.cur_iter, self.last_overflow_iter = 0, -1
        self.scale_window, self.min_scale = p.window, p.min_scale
        self.delayed_shift = self.cur_hysteresis = p.hysteresis
        self.consecutive_hysteresis = p.consecutive_hysteresis

    def update_scale(self, overflow):
        if overflow:
            if self.delayed_shift == 1 or self.cur_hysteresis == 1:
                self.cur_scale = max(self.cur_scale / 2.0, self.min_scale)
            else:
                self.cur_hysteresis -= 1
            self.last_overflow_iter = self.cur_iter
        else:
            if self.consecutive_hysteresis:
                self.cur_hysteresis = self.delayed_shift
            stable_interval = (self.cur_iter - self.last_overflow_iter) - 1
            if stable_interval > 0 and stable_interval % self.scale_window == 0:
                if not self.consecutive_hysteresis:
                    self.cur_hysteresis = self.delayed_shift
                self.cur_scale *= 2.0
        self.cur_iter += 1


policies = st.builds(
    LossScalePolicy,
    initial_scale_power=st.integers(0, 16),
    window=st.integers(1, 6),
    hysteresis=st.integers(1, 4),
    consecutive_hysteresis=st.booleans(),
    min_scale=st.sampled_from([1.0, 0.25, 8.0]),
)


@given(policy=policies, overflows=st.lists(st.booleans(), max_size=60))
def test_matches_deepspeed_scaler(policy, overflows):
    ref = DeepSpeedScaler(policy)
    state = init_loss_scale(policy)
    for o in overflows:
        ref.update_scale(o)
        state = update_loss_scale(state, o, policy)
        assert float(state.scale) == ref.cur_scale
        assert int(state.hysteresis) == ref.cur_hysteresis


def test_named_transitions():
    p = LossScalePolicy(initial_scale_power=4, window=2, hysteresis=2, min_scale=4.0)
    s = init_loss_scale(p)
    assert float(s.scale) == 16
    s = update_loss_scale(s, True, p)  # first overflow spends hysteresis
    assert (float(s.scale), int(s.hysteresis)) == (16, 1)
    s = update_loss_scale(s, True, p)  # second one halves
    assert float(s.scale) == 8
    s = update_loss_scale(s, True, p)
    s = update_loss_scale(s, True, p)  # floor at min_scale
    assert float(s.scale) == 4
    s = update_loss_scale(s, False, p)
    s = update_loss_scale(s, False, p)
    assert float(s.scale) == 4  # DeepSpeed 0.19.8 waits for `window` clean steps after the first
    s = update_loss_scale(s, False, p)  # the window's worth of clean steps before this one doubles it
    assert float(s.scale) == 8
    s = update_loss_scale(s, False, p)
    s = update_loss_scale(s, False, p)  # then every window
    assert float(s.scale) == 16


def test_static_scale_never_moves():
    p = LossScalePolicy(static_scale=128.0)
    s = init_loss_scale(p)
    for o in [True, False, True]:
        s = update_loss_scale(s, o, p)
    assert float(s.scale) == 128.0


class FP16OptimizerScaler:
    """DeepSpeed 0.19.8's FP16_Optimizer._update_scale (fused_optimizer.py; the unfused one is the
    same), transcribed: the scaler of fp16 without ZeRO, which has no hysteresis."""

    def __init__(self, scale, window, min_scale):
        self.cur_scale, self.window, self.min_scale = scale, window, min_scale
        self.cur_iter, self.last_overflow_iter = 0, -1

    def update(self, skip):
        if skip:
            self.cur_scale = max(self.cur_scale / 2.0, self.min_scale)
            self.last_overflow_iter = self.cur_iter
        else:
            stable_interval = (self.cur_iter - self.last_overflow_iter) - 1
            if stable_interval > 0 and stable_interval % self.window == 0:
                self.cur_scale *= 2.0
        self.cur_iter += 1


@given(policy=policies, overflows=st.lists(st.booleans(), max_size=40))
def test_without_zero_the_scaler_is_fp16_optimizers(policy, overflows):
    """Where no optimizer state is sharded (stage 0) DeepSpeed runs FP16_Optimizer, whose scaler has
    no hysteresis: `scaler_for` gives that one whatever the policy's hysteresis; under ZeRO the policy."""
    from fnzero.sharding import Placement
    from fnzero.state import scaler_for

    assert scaler_for(policy, Placement(optimizer=True)) is policy
    stage0 = scaler_for(policy, Placement())
    ref = FP16OptimizerScaler(2.0 ** policy.initial_scale_power, policy.window, policy.min_scale)
    state = init_loss_scale(stage0)
    for o in overflows:
        ref.update(o)
        state = update_loss_scale(state, o, stage0)
        assert float(state.scale) == ref.cur_scale


def test_a_stage0_step_halves_on_the_first_overflow_and_a_zero_step_spends_hysteresis():
    """The step reads its scaler from the state's placement, not the config's stage: the same config
    (hysteresis 2, no zero block) sharded at stage 0 halves the scale on an overflowing step, at
    stage 2 (`shard(stage=2)`) it spends one unit of hysteresis first, as DeepSpeed's two scalers do."""
    import torch

    import fnzero

    cfg = fnzero.load_config({"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
                              "fp16": {"enabled": True, "initial_scale_power": 8, "hysteresis": 2}})
    scales = {}
    for stage in (0, 2):
        sm = fnzero.shard(torch.nn.Linear(2, 1), stage=stage, config=cfg)
        step = fnzero.train_step(lambda p, b: sm.apply(p, b).float().sum() * b.float().sum(), cfg)
        state, _ = step(sm.init_state(), torch.full((1, 2), float("inf")).half())
        scales[stage] = (float(state.loss_scale.scale), int(state.step))
    assert scales == {0: (128.0, 0), 2: (256.0, 0)}
