"""fnzero reads the universal checkpoints DeepSpeed 0.19.8's own `ds_to_universal` writes
(`specs/checkpoint-format.md` §DeepSpeed, "Universal (read)"): DeepSpeed trains on 2 gloo ranks,
saves, converts with its command (`--inject_missing_state`: a plain model records no
`universal_checkpoint_info`), and fnzero

* exports the universal checkpoint bit for bit equal to the fp32 weights DeepSpeed's engine held
  (trainable, frozen, buffers; ZeRO 1-3, fp32, bf16 and fp16), and loads it into the same state as
  the original checkpoint it was converted from (every leaf equal, the loss scale too);
* resumes it, converted from a ZeRO-2 and a ZeRO-3 run, and takes the steps DeepSpeed takes from it
  with `"checkpoint": {"load_universal": true}`.

DeepSpeed runs in subprocesses (`scripts/deepspeed_checkpoints.py`, `_ds_universal_runner.py`) with
the interpreter `FNZERO_DEEPSPEED_PYTHON` names, else this one when it imports deepspeed; skipped
with the reason otherwise. Without DeepSpeed: `test_checkpoint_ds_universal_read.py`.
"""

from __future__ import annotations

import json
import os
import subprocess

import pytest
import torch
from safetensors.torch import load_file
from test_checkpoint_deepspeed import _fixture_model
from test_checkpoint_ds_continue import (MORE_STEPS, SAVED_STEPS, Saved, _batches, _config, _distance,
                                        _fnzero_continues)

import fnzero
from fnzero.checkpoint import export, info, load

HERE = os.path.dirname(os.path.abspath(__file__))
NAMES = ["s1_fp32", "s1_bf16", "s2_fp32", "s2_bf16", "s3_fp32", "s3_bf16", "s2_fp16"]  # (stage 0: nothing to convert)
TAG, UNIVERSAL = "global_step2", "global_step2_universal"
_CONVERT = """
import sys
from deepspeed.checkpoint import ds_to_universal as u
for src, dst in zip(sys.argv[1::2], sys.argv[2::2]):
    sys.argv = ["ds_to_universal", "--input_folder", src, "--output_folder", dst, "--num_extract_workers", "1",
                "--num_merge_workers", "1", "--inject_missing_state"]
    u.main(u.parse_arguments())
"""


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # DeepSpeed's interpreter has its own packages
    return {**env, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", "PYTHONWARNINGS": "ignore"}


@pytest.fixture(scope="module")
def converted(tmp_path_factory, deepspeed_python):  # noqa: F811
    """DeepSpeed's checkpoints (`scripts/deepspeed_checkpoints.py`: a tied head, a frozen layer, two
    buffers, 2 steps on 2 ranks), each converted by `ds_to_universal` into NAME/global_step2_universal
    beside the original (NAME's `latest` and `latest_universal` name one each)."""
    # ~15 s: the checkpoints (~11 s), one process converting them all (~2 s).
    out = str(tmp_path_factory.mktemp("ds_universal"))
    run = subprocess.run([deepspeed_python, os.path.join(HERE, "scripts", "deepspeed_checkpoints.py"), out, *NAMES],
                         env=_env(), capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    pairs = [os.path.join(out, n, t) for n in NAMES for t in (TAG, UNIVERSAL)]
    run = subprocess.run([deepspeed_python, "-c", _CONVERT, *pairs], env=_env(), capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    return out


@pytest.mark.parametrize("name", NAMES)
def test_the_universal_checkpoint_exports_what_deepspeeds_engine_held(converted, name, tmp_path):
    """Bit for bit: the trainable parameters from zero/<name>/fp32.pt (the fp32 master), the frozen
    layer from `module` (ZeRO-1/2) or every rank's `frozen_param_fragments` (ZeRO-3), the buffers
    from `module`, the integer one keeping its dtype; the tied head under its own name too."""
    root = os.path.join(converted, name)
    expected = torch.load(os.path.join(root, "expected.pt"), weights_only=True)
    [out] = export(root, str(tmp_path), tag=UNIVERSAL, progress=False)
    got = load_file(out)
    assert set(got) == set(expected) | {"head.weight"} and torch.equal(got["head.weight"], got["emb.weight"])
    for n, want in expected.items():
        assert got[n].dtype == (torch.float32 if want.is_floating_point() else want.dtype), n
        assert torch.equal(got[n].to(want.dtype), want), n
    rep = info(root, verify=True)
    assert (rep["latest"], rep["latest_universal"]) == (TAG, UNIVERSAL)
    c = next(c for c in rep["checkpoints"] if c["tag"] == UNIVERSAL)
    assert c["deepspeed"]["universal"] and c["health"] == "ok (every tensor read and checked)"
    assert (c["step"], c["world_size"], c["stage"]) == (2, 2, int(name[1]))


def _fields(state) -> dict[str, dict]:
    out = {"params": state.params, "frozen": state.frozen, "buffers": state.buffers,
           "exp_avg": state.opt_state.exp_avg, "exp_avg_sq": state.opt_state.exp_avg_sq,
           "counts": {"step": state.step, "count": state.opt_state.count}}
    if state.master is not None:
        out["master"] = state.master
    if state.loss_scale is not None:
        out["loss_scale"] = {"scale": state.loss_scale.scale, "good_steps": state.loss_scale.good_steps,
                             "hysteresis": state.loss_scale.hysteresis}
    return out


@pytest.mark.parametrize("name,stage", [("s1_fp32", 3), ("s1_bf16", 2), ("s2_fp32", 1), ("s2_bf16", 3),
                                        ("s3_fp32", 2), ("s3_bf16", 1), ("s2_fp16", 2)])
def test_the_universal_checkpoint_loads_as_the_checkpoint_it_was_converted_from(converted, name, stage):
    """Into a state of another stage (world 1), every leaf equal to what the original checkpoint
    loads to: weights, master, both moments, Adam's count and the step, the buffers, the fp16 loss
    scale. The frozen layer is the model's own either way (the model holds DeepSpeed's frozen
    weights, as the model DeepSpeed resumes a universal checkpoint into must); `latest` picks the
    original, `checkpoint.load_universal` the universal one, as DeepSpeed's engine does."""
    root = os.path.join(converted, name)
    expected = torch.load(os.path.join(root, "expected.pt"), weights_only=True)
    cfg = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW"}, "zero_optimization": {"stage": stage}}
    if name.endswith("bf16"):
        cfg["bf16"] = {"enabled": True}
    if name.endswith("fp16"):
        cfg["fp16"] = {"enabled": True, "loss_scale_window": 2}

    def like():
        model = _fixture_model()
        with torch.no_grad():
            for n, p in model.named_parameters():
                if not p.requires_grad:
                    p.copy_(expected[n])
        return fnzero.shard(model, config=fnzero.load_config(cfg)).init_state()

    original = _fields(load(root, like=like())[0])
    universal_cfg = fnzero.load_config({**cfg, "checkpoint": {"load_universal": True}})
    universal = _fields(load(root, like=like(), config=universal_cfg)[0])
    assert original.keys() == universal.keys()
    for field, tensors in original.items():
        assert tensors.keys() == universal[field].keys(), field
        for k, t in tensors.items():
            assert torch.equal(torch.as_tensor(universal[field][k]), torch.as_tensor(t)), (field, k)
    assert int(original["counts"]["step"]) == 2


@pytest.fixture(scope="module", params=[2, 3])
def continued(request, tmp_path_factory, deepspeed_python):  # noqa: F811
    """DeepSpeed trains SAVED_STEPS at ZeRO `param` on 2 ranks (float32 AdamW, WarmupLR, gradient
    accumulation 2, clipping), saves, converts with ds_to_universal, and a fresh engine resumes the
    universal checkpoint (`load_universal`) at the same stage and takes MORE_STEPS: (the universal
    tag directory, the stage, DeepSpeed's losses and parameters)."""
    # ~12 s each: two DeepSpeed subprocesses of 2 ranks.
    stage, tmp = request.param, tmp_path_factory.mktemp(f"ds_universal_continue{request.param}")
    batches = _batches("mlp")
    torch.save(batches[:SAVED_STEPS], tmp / "first.pt")
    torch.save(batches[SAVED_STEPS:], tmp / "more.pt")
    train = {"world": 2, "load": str(tmp / "ds"), "batches": str(tmp / "first.pt"), "runs": [],
             "train": {"config": _config(stage, 2), "batches": str(tmp / "first.pt"), "save": str(tmp / "ds"),
                       "universal": True}}
    resume = {"world": 2, "load": str(tmp / "ds"), "batches": str(tmp / "more.pt"),
              "runs": [{"config": {**_config(stage, 2), "checkpoint": {"load_universal": True}},
                        "out": str(tmp / "ds_more.pt")}]}
    for i, spec in enumerate((train, resume)):
        (tmp / f"spec{i}.json").write_text(json.dumps(spec))
        r = subprocess.run([deepspeed_python, os.path.join(HERE, "_ds_universal_runner.py"), str(tmp / f"spec{i}.json")],
                           capture_output=True, text=True, env=_env(), timeout=600)
        assert r.returncode == 0, r.stderr[-4000:]
    tag = f"global_step{SAVED_STEPS}_universal"
    assert (tmp / "ds" / "latest_universal").read_text() == tag
    return str(tmp / "ds" / tag), stage, torch.load(tmp / "ds_more.pt")


@pytest.mark.parametrize("stage,world", [(2, 2), (3, 2), (1, 1)])
def test_fnzero_takes_the_steps_deepspeed_takes_from_its_universal_checkpoint(continued, stage, world):
    """Tolerance 1e-6 (relative for the losses, absolute for parameters of size ~0.5): a few float32
    ulps, as DeepSpeed's own spread between stages (`test_checkpoint_ds_continue.py`); the 2 steps
    move the parameters by > 1e-3, so a wrong lr, Adam step or moment fails."""
    root, saved_stage, want = continued
    assert want["global_steps"] == SAVED_STEPS + MORE_STEPS
    losses, params, step, loaded = _fnzero_continues(root, Saved("fp32", saved_stage, 2, (saved_stage,)), stage, world)
    before = loaded["master"]
    assert step == SAVED_STEPS + MORE_STEPS
    loss_err, param_err = _distance({"losses": losses, "masters": params}, {**want, "masters": want["params"]})
    print(f"universal from ZeRO-{saved_stage}, fnzero at stage {stage} world {world}: losses {loss_err:.1e} "
          f"params {param_err:.1e}")
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(want["losses"]), rtol=1e-6, atol=0)
    for name, p in want["params"].items():
        torch.testing.assert_close(params[name], p, rtol=0, atol=1e-6, msg=name)
    assert min(float((p - before[n]).abs().max()) for n, p in params.items()) > 1e-3  # not vacuous
