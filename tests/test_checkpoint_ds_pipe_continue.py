"""fnzero resumes a pipeline checkpoint DeepSpeed 0.19.8 itself wrote and takes the steps DeepSpeed
takes from it (specs/checkpoint-format.md §DeepSpeed, "Resuming in fnzero"): a two-stage
PipelineModule (5 layers, float32 AdamW with a WarmupLR schedule, gradient accumulation 2,
clipping 1.0) at ZeRO-1 on 2 gloo ranks (one per stage: each stage's optimizer files hold its own
layers), saved after 3 steps and continued 2 by a fresh DeepSpeed engine; fnzero loads the same
files into its PipelineModule of the same layers, in two stages on 2 simulated ranks and in one
stage on 1, and takes the same 2 steps on the same batches. DeepSpeed runs in a subprocess
(`_ds_pipe_runner.py`, the interpreter FNZERO_DEEPSPEED_PYTHON names or this one when it imports
deepspeed); skipped with the reason otherwise."""

from __future__ import annotations

import copy
import json
import os
import subprocess

import pytest
import torch
from _ds_pipe_runner import build_layers

import fnzero
from fnzero.checkpoint import load
from fnzero.testing._threads import simulated_world

HERE = os.path.dirname(os.path.abspath(__file__))
ROWS, GAS = 8, 2
SAVED_STEPS, MORE_STEPS = 3, 2


def _config(stages: int, stage: int) -> dict:
    return {
        "train_micro_batch_size_per_gpu": ROWS // GAS, "gradient_accumulation_steps": GAS, "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01, "torch_adam": True}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 1e-3, "warmup_max_lr": 1e-2,
                                                     "warmup_num_steps": 10}},
        "zero_optimization": {"stage": stage}, "pipeline": {"stages": stages}, "steps_per_print": 10**6,
    }


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(5)
    return [(torch.randn(ROWS, 8, generator=g), torch.randn(ROWS, 4, generator=g))
            for _ in range(SAVED_STEPS + MORE_STEPS)]


@pytest.fixture(scope="module")
def deepspeed_run(tmp_path_factory, deepspeed_python):  # noqa: F811
    """(the checkpoint DeepSpeed saved after SAVED_STEPS, {"losses", "params", "global_steps"} of its
    MORE_STEPS from it)."""
    tmp = tmp_path_factory.mktemp("ds_pipe_continue")
    batches = _batches()
    torch.save(batches[:SAVED_STEPS], tmp / "first.pt")
    torch.save(batches[SAVED_STEPS:], tmp / "more.pt")
    config = {k: v for k, v in _config(2, 1).items() if k != "pipeline"}  # (DeepSpeed's stages are the module's)
    spec = {"world": 2, "config": config, "first": str(tmp / "first.pt"), "more": str(tmp / "more.pt"),
            "save": str(tmp / "ds"), "out": str(tmp / "out.pt")}
    (tmp / "spec.json").write_text(json.dumps(spec))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    r = subprocess.run([deepspeed_python, os.path.join(HERE, "_ds_pipe_runner.py"), str(tmp / "spec.json")],
                       capture_output=True, text=True, env={**env, "OMP_NUM_THREADS": "1"}, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    return str(tmp / "ds"), torch.load(tmp / "out.pt")


def _fnzero_continues(root: str, stages: int, stage: int):
    """fnzero loads `root` into `stages` pipeline stages (one rank each) at ZeRO `stage` and takes
    MORE_STEPS: (losses, {name: param} of every stage, step, {name: param as loaded})."""
    layers = build_layers()  # once: the simulated ranks are threads sharing one RNG
    more = _batches()[SAVED_STEPS:]

    def fn(comm):
        cfg = fnzero.load_config(_config(stages, stage), world_size=stages)
        sm = fnzero.shard(fnzero.PipelineModule(copy.deepcopy(layers), torch.nn.functional.mse_loss,
                                                partition_method="uniform"), config=cfg, comm=comm)
        state, _ = load(root, like=sm.init_state())
        before = sm.gather(state)
        step = fnzero.train_step(fnzero.pipeline_loss(sm), cfg)
        losses = []
        for batch in more:
            state, m = step(state, batch)
            losses.append(float(m["loss"]))
        return losses, sm.gather(state), int(state.step), before

    out = simulated_world(stages).run(fn)
    merged = [{n: t for o in out for n, t in o[i].items()} for i in (1, 3)]
    return out[-1][0], merged[0], out[0][2], merged[1]


@pytest.mark.parametrize("stages,stage", [(2, 1), (1, 0)])
def test_fnzero_takes_the_steps_deepspeed_takes_from_its_pipeline_checkpoint(deepspeed_run, stages, stage):
    """Tolerance 1e-6 (relative for the losses, absolute for parameters of size ~0.5): a few float32
    ulps; the 2 steps move every parameter by > 1e-3, so a wrong lr, Adam step or moment fails."""
    root, want = deepspeed_run
    assert want["global_steps"] == SAVED_STEPS + MORE_STEPS
    losses, params, step, before = _fnzero_continues(root, stages, stage)
    assert step == SAVED_STEPS + MORE_STEPS and sorted(params) == sorted(want["params"])
    loss_err = max(abs(a - b) / abs(b) for a, b in zip(losses, want["losses"]))
    param_err = max(float((params[n] - p).abs().max()) for n, p in want["params"].items())
    print(f"{stages} stage(s), ZeRO-{stage}: fnzero vs DeepSpeed losses {loss_err:.1e} params {param_err:.1e}")
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(want["losses"]), rtol=1e-6, atol=0)
    for name, p in want["params"].items():
        torch.testing.assert_close(params[name], p, rtol=0, atol=1e-6, msg=name)
    assert min(float((p - before[n]).abs().max()) for n, p in params.items()) > 1e-3  # not vacuous
