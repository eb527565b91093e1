"""`fnzero.checkpoint.load` of a Hugging Face Trainer's `checkpoint-N/` built here without
DeepSpeed or transformers (specs/checkpoint-format.md §DeepSpeed, "A Hugging Face Trainer's
directory"): DeepSpeed's `latest` and `global_stepN/`, the Trainer's `trainer_state.json` and
`scheduler.pt` (a torch `LambdaLR`'s state, also in the model file's `lr_scheduler`, as the Trainer
hands its scheduler to DeepSpeed), and `training_args.bin` / `rng_state_0.pth` pickles that would
run code if anything unpickled them. The Trainer's counts are checked against DeepSpeed's."""

from __future__ import annotations

import json
import os
import pathlib

import pytest
import torch
from test_checkpoint_ds_resume import TAG, Net, _cfg, _zero2

import fnzero
from fnzero import CheckpointError
from fnzero.checkpoint import load
from fnzero.checkpoint._ds_trainer import TrainerStateWarning


class _Runs:
    """Unpickling this touches `marker`: proof that a file was unpickled."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (pathlib.Path.touch, (pathlib.Path(self.marker),))


def _lambda_lr(steps: int) -> dict:
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.AdamW([p])
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 1.0)
    for _ in range(steps):
        opt.step()
        sched.step()
    return sched.state_dict()


def _trainer_dir(tmp_path, global_step: int = 5, sched_steps: int = 5, model_sched_steps: int = 5) -> str:
    """checkpoint-5/ after 5 optimizer steps (DeepSpeed's global_steps 5, Adam's step 5)."""
    root = str(tmp_path / "out" / "checkpoint-5")
    _zero2(root, lr_scheduler=_lambda_lr(model_sched_steps))
    with open(os.path.join(root, "trainer_state.json"), "w") as f:
        json.dump({"global_step": global_step, "epoch": 1.25, "log_history": [{"loss": 1.0, "step": 5}]}, f)
    torch.save(_lambda_lr(sched_steps), os.path.join(root, "scheduler.pt"))
    for name in ("training_args.bin", "rng_state_0.pth"):
        torch.save(_Runs(str(tmp_path / f"ran_{name}")), os.path.join(root, name))
    return root


def _like():
    return fnzero.shard(Net(), stage=2, config=_cfg()).init_state()


def test_a_trainer_dir_whose_counts_agree_loads_and_runs_nothing(tmp_path):
    root = _trainer_dir(tmp_path)
    for path in (root, os.path.join(root, TAG)):
        state, _ = load(path, like=_like())  # (pytest's warnings are errors: none is raised)
        assert int(state.step) == 5
    assert not list(tmp_path.glob("ran_*"))


def test_a_trainer_step_that_is_not_deepspeeds_warns_with_both(tmp_path):
    root = _trainer_dir(tmp_path, global_step=6)
    with pytest.warns(TrainerStateWarning, match=r"global_step 6 \(trainer_state.json\) is not DeepSpeed's "
                                                 r"global_steps 5; fnzero resumes DeepSpeed's count \(5 applied"):
        state, _ = load(root, like=_like())
    assert int(state.step) == 5


@pytest.mark.parametrize("case,match", [
    ("scheduler", r"scheduler.pt: the Trainer's schedule has last_epoch 4, but the optimizer took 5 steps"),
    ("model_scheduler", r"the schedule's last_epoch 6 is not the optimizer's step 5 \(global_steps 5\)"),
    ("not_json", r"trainer_state.json: not JSON"),
    ("step_type", r"trainer_state.json: 'global_step' should be an int, not '5'"),
])
def test_trainer_counts_that_disagree_are_refused_with_both(tmp_path, case, match):
    root = _trainer_dir(tmp_path, sched_steps=4 if case == "scheduler" else 5,
                        model_sched_steps=6 if case == "model_scheduler" else 5)
    if case in ("not_json", "step_type"):
        with open(os.path.join(root, "trainer_state.json"), "w") as f:
            f.write("{global_step: 5" if case == "not_json" else json.dumps({"global_step": "5"}))
    with pytest.raises(CheckpointError, match=match):
        load(root, like=_like())
    assert not list(tmp_path.glob("ran_*"))
