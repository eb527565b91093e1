"""`fnzero.checkpoint.load` of an fp16 DeepSpeed ZeRO-2 checkpoint built here without DeepSpeed
(specs/checkpoint-format.md §DeepSpeed, "Resuming in fnzero"; specs/loss-scaling.md): the loss
scaler each rank's optimizer file pickles (DeepSpeed's `DynamicLossScaler` or `LossScaler`, saved
here by its qualified name from a stand-in class) becomes the state's loss scale, such that fnzero's
next cuts and raises are DeepSpeed's; a config whose fp16 block is not the scaler's policy is
refused, naming the field and both values."""

from __future__ import annotations

import os
import sys
import types

import pytest
import torch
from test_checkpoint_ds_resume import TAG, Net, _zero2
from test_loss_scale import DeepSpeedScaler

import fnzero
from fnzero import CheckpointError
from fnzero.checkpoint import load
from fnzero.state import LossScalePolicy, update_loss_scale

MODULE = "deepspeed.runtime.fp16.loss_scaler"
# DeepSpeed's DynamicLossScaler after 7 iterations, the last overflow at iteration 4 (one unit of
# hysteresis spent): the next clean step does not raise (stable_interval 2, window 3), the one after does.
DYNAMIC = {"cur_scale": 64.0, "dynamic": True, "cur_iter": 7, "last_overflow_iter": 4, "scale_factor": 2.0,
           "scale_window": 3, "min_scale": 1, "delayed_shift": 2, "cur_hysteresis": 1,
           "consecutive_hysteresis": False, "raise_error_at_min_scale": True, "dtype": torch.float16}
FP16 = {"enabled": True, "loss_scale_window": 3, "hysteresis": 2}


def _pickled_as_deepspeeds(monkeypatch, cls_name: str, attrs: dict):
    """A saver for objects of a class pickled as DeepSpeed's `cls_name` (importable by that name
    only while saving); the object with `attrs`."""
    fake = types.ModuleType(MODULE)
    cls = type(cls_name, (), {"__module__": MODULE})
    cls.__qualname__ = cls_name
    setattr(fake, cls_name, cls)
    obj = cls()
    obj.__dict__.update(attrs)
    parts = MODULE.split(".")
    for i in range(1, len(parts)):
        monkeypatch.setitem(sys.modules, ".".join(parts[:i]), types.ModuleType(".".join(parts[:i])))
    monkeypatch.setitem(sys.modules, MODULE, fake)
    return obj


def _fp16_checkpoint(root: str, monkeypatch, scaler: dict | None, cls_name: str = "DynamicLossScaler") -> None:
    """`_zero2`'s layout as an fp16 run writes it: half module weights, the fp16 block in its
    config, 7 global steps of which 2 skipped (Adam's step 5), each rank's scaler."""
    _zero2(root, global_steps=7, skipped_steps=2,
           ds_config={"zero_optimization": {"stage": 2}, "optimizer": {"type": "AdamW"}, "fp16": {"enabled": True}})
    d = os.path.join(root, TAG)
    ms = torch.load(os.path.join(d, "mp_rank_00_model_states.pt"), weights_only=True)
    ms["module"] = {n: t.half() if n != "buf" else t for n, t in ms["module"].items()}
    torch.save(ms, os.path.join(d, "mp_rank_00_model_states.pt"))
    with monkeypatch.context() as m:
        obj = None if scaler is None else _pickled_as_deepspeeds(m, cls_name, scaler)
        for r in range(2):
            p = os.path.join(d, f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt")
            sd = torch.load(p, weights_only=True)
            if obj is not None:
                sd["optimizer_state_dict"].update(loss_scaler=obj, dynamic_loss_scale=scaler["dynamic"], overflow=False)
            torch.save(sd, p)


def _like(fp16: dict | None = FP16):
    cfg = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW"}}
    if fp16 is not None:
        cfg["fp16"] = fp16
    cfg = fnzero.load_config(cfg)
    return fnzero.shard(Net(), stage=2, config=cfg).init_state(), cfg


def test_a_dynamic_scaler_resumes_with_deepspeeds_next_decisions(tmp_path, monkeypatch):
    root = str(tmp_path / "ds")
    _fp16_checkpoint(root, monkeypatch, DYNAMIC)
    like, cfg = _like()
    state, _ = load(root, like=like, config=cfg)
    ls = state.loss_scale
    assert (float(ls.scale), int(ls.good_steps), int(ls.hysteresis)) == (64.0, 2, 1)
    assert int(state.step) == 5  # applied steps: global_steps 7 less skipped_steps 2
    policy = LossScalePolicy(window=3, hysteresis=2)
    ref = DeepSpeedScaler(policy)
    ref.__dict__.update({k: DYNAMIC[k] for k in ("cur_scale", "cur_iter", "last_overflow_iter", "cur_hysteresis")})
    for overflow in [False, False, True, False, True, True, False, False, False, False]:
        ref.update_scale(overflow)
        ls = update_loss_scale(ls, overflow, policy)
        assert (float(ls.scale), int(ls.hysteresis)) == (ref.cur_scale, ref.cur_hysteresis)


def test_a_static_scaler_resumes_its_scale(tmp_path, monkeypatch):
    root = str(tmp_path / "ds")
    _fp16_checkpoint(root, monkeypatch, {"cur_scale": 128.0, "dynamic": False}, "LossScaler")
    like, cfg = _like({"enabled": True, "loss_scale": 128})
    state, _ = load(root, like=like, config=cfg)
    assert float(state.loss_scale.scale) == 128.0 and int(state.loss_scale.good_steps) == 0


def test_an_fp32_state_takes_the_masters_and_leaves_the_scale(tmp_path, monkeypatch):
    root = str(tmp_path / "ds")
    _fp16_checkpoint(root, monkeypatch, DYNAMIC)
    like, _ = _like(None)
    state, _ = load(root, like=like)
    assert state.loss_scale is None and int(state.step) == 5


@pytest.mark.parametrize("case,match", [
    ("static_config", r"loss scale is dynamic \(DynamicLossScaler at 64\), the config's fp16.loss_scale 128 is static"),
    ("window", r"loss scaler has scale_window 3, the config's fp16.loss_scale_window is 1000"),
    ("hysteresis", r"loss scaler has delayed_shift 2, the config's fp16.hysteresis is 4"),
    ("scale_factor", r"scale_factor is 4.0; fnzero raises and cuts the scale by 2"),
    ("no_scaler", r"zero_pp_rank_0_mp_rank_00_optim_states.pt: an fp16 checkpoint without its 'loss_scaler'"),
    ("bad_iter", r"loss scaler's 'cur_iter' is '7'"),
])
def test_a_scaler_the_config_does_not_continue_is_refused_and_named(tmp_path, monkeypatch, case, match):
    root = str(tmp_path / "ds")
    scaler = {**DYNAMIC, **{"scale_factor": {"scale_factor": 4.0}, "bad_iter": {"cur_iter": "7"}}.get(case, {})}
    _fp16_checkpoint(root, monkeypatch, None if case == "no_scaler" else scaler)
    fp16 = {"static_config": {"enabled": True, "loss_scale": 128}, "window": {"enabled": True, "hysteresis": 2},
            "hysteresis": {**FP16, "hysteresis": 4}}.get(case, FP16)
    like, cfg = _like(fp16)
    with pytest.raises(CheckpointError, match=match):
        load(root, like=like, config=cfg)
