"""fnzero resumes an fp16 checkpoint DeepSpeed 0.19.8 wrote, loss scaler included, and takes the
steps DeepSpeed takes from it (specs/checkpoint-format.md §DeepSpeed, "Resuming in fnzero";
specs/loss-scaling.md): AdamW with WarmupLR, gradient accumulation 2 and clipping, ZeRO-2 on 2 gloo
ranks (and ZeRO-3, continued at ZeRO-3), fp16 with a dynamic scale of 2**8, window 3, hysteresis 2.
The targets of batches 0 and 4 are scaled so that their gradients overflow fp16. Batch 0 spends one unit of hysteresis (scale kept,
step skipped); batches 1 and 2 are clean; saved there (DeepSpeed's scaler: cur_iter 3,
last_overflow_iter 0, cur_hysteresis 1). DeepSpeed continues at ZeRO-2 and ZeRO-1 (its own spread):
batch 3 is clean and does not raise the scale (2 clean steps before it, window 3), batch 4
overflows with no hysteresis left and halves it. fnzero takes the same steps only when its loss
scale state is DeepSpeed's: a good-steps count one too high raises on batch 3, hysteresis from the
config (2) keeps the scale on batch 4. No step raises the scale: on a raise DeepSpeed 0.19.8
unscales that step's gradients by the raised scale, which fnzero does not do. The harness is
`test_checkpoint_ds_continue.py`'s (`_ds_universal_runner.py`); skipped without DeepSpeed."""

from __future__ import annotations

import copy
import json
import os
import subprocess

import pytest
import torch
from _ds_universal_runner import build_model

import fnzero
from fnzero.checkpoint import load
from fnzero.testing._threads import simulated_world

HERE = os.path.dirname(os.path.abspath(__file__))
ROWS, GAS = 8, 2
SAVED_STEPS, MORE_STEPS = 3, 2


def _config(stage: int, world: int) -> dict:
    return {
        "train_micro_batch_size_per_gpu": ROWS // (GAS * world),
        "gradient_accumulation_steps": GAS,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01, "torch_adam": True}},
        "scheduler": {"type": "WarmupLR",
                      "params": {"warmup_min_lr": 1e-3, "warmup_max_lr": 1e-2, "warmup_num_steps": 10}},
        "fp16": {"enabled": True, "initial_scale_power": 8, "loss_scale_window": 3, "hysteresis": 2,
                 "min_loss_scale": 1},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        "steps_per_print": 10**6,
    }


def _batches(n: int, seed: int = 11) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = [(torch.randn(ROWS, 8, generator=g), torch.randn(ROWS, 4, generator=g)) for _ in range(n)]
    for i in (0, 4):  # the output's gradient, scaled by 256, overflows fp16: a skipped step
        out[i] = (out[i][0], out[i][1] * 1e4)
    return out


@pytest.fixture(scope="module", params=[2, 3], ids=["saved_at_zero2", "saved_at_zero3"])
def deepspeed_run(request, tmp_path_factory, deepspeed_python):  # noqa: F811
    """DeepSpeed trains at ZeRO-2 (continued at 2 and 1) or ZeRO-3 (continued at 3, the only stage
    that reads its files): (checkpoint root, saved stage, {stage: losses, params, masters,
    global_steps, skipped_steps, loss_scale})."""
    saved = request.param
    tmp = tmp_path_factory.mktemp(f"ds_fp16_zero{saved}")
    batches = _batches(SAVED_STEPS + MORE_STEPS)
    torch.save(batches[:SAVED_STEPS], tmp / "first.pt")
    torch.save(batches[SAVED_STEPS:], tmp / "more.pt")
    stages = (2, 1) if saved == 2 else (3,)
    runs = [{"config": _config(s, 2), "out": str(tmp / f"ds{s}.pt")} for s in stages]
    spec = {"world": 2, "load": str(tmp / "ds"), "batches": str(tmp / "more.pt"), "runs": runs,
            "train": {"config": _config(saved, 2), "batches": str(tmp / "first.pt"), "save": str(tmp / "ds")}}
    (tmp / "spec.json").write_text(json.dumps(spec))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    r = subprocess.run([deepspeed_python, os.path.join(HERE, "_ds_universal_runner.py"), str(tmp / "spec.json")],
                       capture_output=True, text=True, env={**env, "OMP_NUM_THREADS": "1"}, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    return str(tmp / "ds"), saved, {s: torch.load(run["out"]) for s, run in zip(stages, runs)}


def _fnzero_continues(root: str, stage: int, world: int):
    """fnzero loads `root` at `stage` on `world` simulated ranks and takes MORE_STEPS:
    (losses, {name: fp32 master}, step, loss scale as loaded, loss scale after)."""
    cfg_dict = _config(stage, world)
    more = _batches(SAVED_STEPS + MORE_STEPS)[SAVED_STEPS:]
    base = build_model()

    def fn(comm):
        cfg = fnzero.load_config(cfg_dict, world_size=world)
        sm = fnzero.shard(copy.deepcopy(base), config=cfg, comm=comm)
        state, _ = load(root, like=sm.init_state(), config=cfg)
        loaded = (float(state.loss_scale.scale), int(state.loss_scale.good_steps), int(state.loss_scale.hysteresis))
        step = fnzero.train_step(lambda p, b: torch.nn.functional.mse_loss(sm.apply(p, b[0].half()).float(), b[1]), cfg)
        r, n = comm.rank, ROWS // world
        losses = []
        for x, y in more:
            state, m = step(state, (x[r * n:(r + 1) * n], y[r * n:(r + 1) * n]))
            losses.append(float(m["loss"]))
        params = sm.gather(state)  # the fp32 masters
        return losses, params, int(state.step), loaded, float(state.loss_scale.scale)

    return simulated_world(world).run(fn)[0]


def _spread(a: dict, b: dict) -> tuple[float, float]:
    loss = max(abs(x - y) / abs(y) for x, y in zip(a["losses"], b["losses"]))
    return loss, max(float((a["masters"][n] - b["masters"][n]).abs().max()) for n in a["masters"])


@pytest.mark.parametrize("stage,world", [(2, 2), (1, 1), (3, 2)])
def test_fnzero_takes_deepspeeds_fp16_steps_and_loss_scale(deepspeed_run, stage, world):
    """Tolerance: DeepSpeed's own ZeRO-1 against ZeRO-2 spread, at least 1e-5 (fp32 masters of size
    ~0.4 moved by one fp16 gradient: its accumulation order). The loss scale is DeepSpeed's exactly."""
    root, saved, ds = deepspeed_run
    want = ds[saved]
    ds_loss_spread, ds_param_spread = _spread(ds[1], want) if 1 in ds else (0.0, 0.0)
    assert want["global_steps"] == SAVED_STEPS + MORE_STEPS and want["skipped_steps"] == 2
    assert all(r["loss_scale"] == 128.0 for r in ds.values())  # 256 kept on batch 0, halved on batch 4
    losses, masters, step, loaded, scale = _fnzero_continues(root, stage, world)
    assert loaded == (256.0, 2, 1)  # DeepSpeed's scaler: cur_iter 3, last_overflow_iter 0, cur_hysteresis 1
    assert step == SAVED_STEPS + MORE_STEPS - 2  # applied steps: DeepSpeed's global_steps less skipped_steps
    assert scale == want["loss_scale"]
    loss_err, param_err = _spread({"losses": losses, "masters": masters}, want)
    print(f"saved at {saved}, stage {stage} world {world}: fnzero vs DeepSpeed losses {loss_err:.1e} masters {param_err:.1e}; "
          f"DeepSpeed ZeRO-1 vs ZeRO-2 {ds_loss_spread:.1e} {ds_param_spread:.1e}")
    assert loss_err <= max(ds_loss_spread, 1e-6) and param_err <= max(ds_param_spread, 1e-5)
