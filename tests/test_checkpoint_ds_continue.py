"""fnzero resumes a checkpoint DeepSpeed 0.19.8 itself wrote and takes the steps DeepSpeed takes
from it (specs/checkpoint-format.md §DeepSpeed, "Resuming in fnzero"): float32 AdamW with a WarmupLR
schedule, gradient accumulation 2 and clipping, ZeRO-2 on 2 gloo ranks, saved after 3 steps;
DeepSpeed continues 2 steps at ZeRO-2 and at ZeRO-1 (its own stage-to-stage spread), and fnzero,
loading the same files into 2 simulated ranks and into 1, at ZeRO-1, 2 and 3, takes the same 2 steps
on the same batches; and the same from a stage-0 checkpoint (Adam's state per parameter index in
the model file), continued by DeepSpeed at stage 0 and by fnzero at ZeRO-2 on 2 ranks and stage 0
on 1. DeepSpeed runs in a subprocess (`_ds_universal_runner.py`, the interpreter
FNZERO_DEEPSPEED_PYTHON names or this one when it imports deepspeed); skipped with the reason
otherwise."""

from __future__ import annotations

import copy
import json
import os
import subprocess

import pytest
import torch
from _ds_universal_runner import build_model
from test_checkpoint_ds_universal import deepspeed_python  # noqa: F401  (the fixture)

import fnzero
from fnzero.checkpoint import load
from fnzero.testing._threads import simulated_world

HERE = os.path.dirname(os.path.abspath(__file__))
ROWS, GAS = 8, 2  # the global batch: GAS micro-batches of ROWS / (GAS * world) rows on each rank
SAVED_STEPS, MORE_STEPS = 3, 2


def _config(stage: int, world: int) -> dict:
    return {
        "train_micro_batch_size_per_gpu": ROWS // (GAS * world),
        "gradient_accumulation_steps": GAS,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01, "torch_adam": True}},
        "scheduler": {"type": "WarmupLR",
                      "params": {"warmup_min_lr": 1e-3, "warmup_max_lr": 1e-2, "warmup_num_steps": 10}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        "steps_per_print": 10**6,
    }


def _batches(n: int, seed: int = 11) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(ROWS, 8, generator=g), torch.randn(ROWS, 4, generator=g)) for _ in range(n)]


@pytest.fixture(scope="module")
def deepspeed_run(tmp_path_factory, deepspeed_python):  # noqa: F811
    """DeepSpeed trains SAVED_STEPS at ZeRO-2 on 2 ranks and saves, then resumes it at ZeRO-2 and
    at ZeRO-1 and takes MORE_STEPS: (checkpoint root, {stage: losses, params, global_steps})."""
    return _deepspeed_runs(tmp_path_factory.mktemp("ds_continue"), deepspeed_python, 2, (2, 1))


@pytest.fixture(scope="module")
def deepspeed_stage0_run(tmp_path_factory, deepspeed_python):  # noqa: F811
    """The same at ZeRO stage 0 (the optimizer state in the model file), continued at stage 0."""
    return _deepspeed_runs(tmp_path_factory.mktemp("ds_continue0"), deepspeed_python, 0, (0,))


def _deepspeed_runs(tmp, deepspeed_python: str, saved: int, continued: tuple[int, ...]):
    batches = _batches(SAVED_STEPS + MORE_STEPS)
    torch.save(batches[:SAVED_STEPS], tmp / "first.pt")
    torch.save(batches[SAVED_STEPS:], tmp / "more.pt")
    runs = [{"config": _config(s, 2), "out": str(tmp / f"ds{s}.pt")} for s in continued]
    spec = {"world": 2, "load": str(tmp / "ds"), "batches": str(tmp / "more.pt"), "runs": runs,
            "train": {"config": _config(saved, 2), "batches": str(tmp / "first.pt"), "save": str(tmp / "ds")}}
    (tmp / "spec.json").write_text(json.dumps(spec))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    r = subprocess.run([deepspeed_python, os.path.join(HERE, "_ds_universal_runner.py"), str(tmp / "spec.json")],
                       capture_output=True, text=True, env={**env, "OMP_NUM_THREADS": "1"}, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    return str(tmp / "ds"), {s: torch.load(run["out"]) for s, run in zip(continued, runs)}


def _fnzero_continues(root: str, stage: int, world: int):
    """fnzero loads `root` at `stage` on `world` simulated ranks and takes MORE_STEPS on each rank's
    rows of the same global batches: (losses, {name: param}, step, {name: param as loaded})."""
    cfg_dict = _config(stage, world)
    more = _batches(SAVED_STEPS + MORE_STEPS)[SAVED_STEPS:]
    base = build_model()  # once: the simulated ranks are threads sharing one RNG

    def fn(comm):
        cfg = fnzero.load_config(cfg_dict, world_size=world)
        sm = fnzero.shard(copy.deepcopy(base), config=cfg, comm=comm)
        state, _ = load(root, like=sm.init_state())
        before = sm.state_dict(state)
        step = fnzero.train_step(lambda p, b: torch.nn.functional.mse_loss(sm.apply(p, b[0]), b[1]), cfg)
        r, n = comm.rank, ROWS // world
        losses = []
        for x, y in more:
            state, m = step(state, (x[r * n:(r + 1) * n], y[r * n:(r + 1) * n]))
            losses.append(float(m["loss"]))
        return losses, sm.state_dict(state), int(state.step), before

    return simulated_world(world).run(fn)[0]


def _spread(a: dict, b: dict) -> tuple[float, float]:
    loss = max(abs(x - y) / abs(y) for x, y in zip(a["losses"], b["losses"]))
    return loss, max(float((a["params"][n] - b["params"][n]).abs().max()) for n in a["params"])


@pytest.mark.parametrize("stage,world", [(2, 2), (3, 2), (2, 1), (1, 1)])
def test_fnzero_takes_the_steps_deepspeed_takes_from_its_checkpoint(deepspeed_run, stage, world):
    """Tolerance 1e-6 (relative for the losses, absolute for parameters of size ~0.5): a few
    float32 ulps. DeepSpeed's own spread between ZeRO-2 and ZeRO-1 continuations is asserted
    below it; the 2 steps move the parameters by > 1e-3, so a wrong lr, Adam step or moment fails."""
    root, ds = deepspeed_run
    want = ds[2]
    ds_loss_spread, ds_param_spread = _spread(ds[1], want)
    assert ds_loss_spread <= 1e-6 and ds_param_spread <= 1e-6
    assert want["global_steps"] == SAVED_STEPS + MORE_STEPS
    losses, params, step, before = _fnzero_continues(root, stage, world)
    assert step == SAVED_STEPS + MORE_STEPS
    got = {"losses": losses, "params": params}
    loss_err, param_err = _spread(got, want)
    print(f"stage {stage} world {world}: fnzero vs DeepSpeed losses {loss_err:.1e} params {param_err:.1e}; "
          f"DeepSpeed ZeRO-1 vs ZeRO-2 {ds_loss_spread:.1e} {ds_param_spread:.1e}")
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(want["losses"]), rtol=1e-6, atol=0)
    for name, p in want["params"].items():
        torch.testing.assert_close(params[name], p, rtol=0, atol=1e-6, msg=name)
    assert min(float((p - before[n]).abs().max()) for n, p in params.items()) > 1e-3  # not vacuous


@pytest.mark.parametrize("stage,world", [(2, 2), (0, 1)])
def test_fnzero_takes_the_steps_deepspeed_takes_from_its_stage0_checkpoint(deepspeed_stage0_run, stage, world):
    """As above from a stage-0 checkpoint (Adam's state per parameter index in the model file)."""
    root, ds = deepspeed_stage0_run
    want = ds[0]
    losses, params, step, before = _fnzero_continues(root, stage, world)
    assert step == SAVED_STEPS + MORE_STEPS == want["global_steps"]
    loss_err, param_err = _spread({"losses": losses, "params": params}, want)
    print(f"from stage 0, stage {stage} world {world}: fnzero vs DeepSpeed losses {loss_err:.1e} params {param_err:.1e}")
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(want["losses"]), rtol=1e-6, atol=0)
    for name, p in want["params"].items():
        torch.testing.assert_close(params[name], p, rtol=0, atol=1e-6, msg=name)
    assert min(float((p - before[n]).abs().max()) for n, p in params.items()) > 1e-3  # not vacuous
