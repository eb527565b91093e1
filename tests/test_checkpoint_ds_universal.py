"""An fnzero checkpoint written as a DeepSpeed universal checkpoint (`specs/checkpoint-format.md`
§DeepSpeed universal (written)): the files, names and values without DeepSpeed (these run in CI),
what is refused, the `fnzero checkpoint convert` command, and DeepSpeed 0.19.8 itself resuming the
converted checkpoint at ZeRO stages 1, 2 and 3 on 1 and 2 gloo ranks (a subprocess with a
DeepSpeed interpreter: `FNZERO_DEEPSPEED_PYTHON`, or this one when it imports deepspeed;
skipped with the reason otherwise).
"""

from __future__ import annotations

import copy
import json
import os
import subprocess

import pytest
import torch
from _ds_universal_runner import build_model

import fnzero
from fnzero import CheckpointError
from fnzero.checkpoint import load, save, to_deepspeed_universal
from fnzero.cli._main import main
from fnzero.testing._threads import simulated_world

HERE = os.path.dirname(os.path.abspath(__file__))
ROWS = 4  # the global batch: micro ROWS / world on each rank
SAVED_STEPS, MORE_STEPS = 3, 2


def _config(stage: int, world: int, **extra) -> dict:
    c = {
        "train_micro_batch_size_per_gpu": ROWS // world,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        # torch_adam: DeepSpeed's AdamW as torch.optim.AdamW (its fused kernels need a build); fnzero ignores it
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01, "torch_adam": True}},
        "scheduler": {"type": "WarmupLR",
                      "params": {"warmup_min_lr": 1e-3, "warmup_max_lr": 1e-2, "warmup_num_steps": 10}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        "steps_per_print": 10**6,
    }
    c.update(extra)
    return c


def _batches(n: int, seed: int = 7) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(ROWS, 8, generator=g), torch.randn(ROWS, 4, generator=g)) for _ in range(n)]


def _train(base: torch.nn.Module, cfg_dict: dict, batches, comm):
    """fnzero on this rank's rows of each global batch; (sharded module, state, losses)."""
    cfg = fnzero.load_config(cfg_dict, world_size=comm.world_size)
    sm = fnzero.shard(copy.deepcopy(base), config=cfg, comm=comm)
    state = sm.init_state()
    step = fnzero.train_step(lambda p, b: torch.nn.functional.mse_loss(sm.apply(p, b[0]), b[1]), cfg)
    r, n = comm.rank, ROWS // comm.world_size
    losses = []
    for x, y in batches:
        state, m = step(state, (x[r * n:(r + 1) * n], y[r * n:(r + 1) * n]))
        losses.append(m["loss"])
    return sm, state, losses


def _saved(d: str, base: torch.nn.Module, stage: int, world: int, with_config: bool = True, **extra):
    """Train SAVED_STEPS at `stage` on `world` simulated ranks and save to `d`; every rank's
    consolidated {name: params / exp_avg / exp_avg_sq} and the step."""
    cfg_dict = _config(stage, world, **extra)

    def fn(comm):
        sm, state, _ = _train(base, cfg_dict, _batches(SAVED_STEPS), comm)
        cfg = fnzero.load_config(cfg_dict, world_size=world) if with_config else None
        save(d, state, config=cfg)
        return sm.state_dict(state), state  # (a collective at stage 3: every rank)

    results = simulated_world(world).run(fn)
    return results[0][0], [s for _, s in results]


def _by_name(states, field: str) -> dict[str, torch.Tensor]:
    """{parameter name: its whole `field` tensor} consolidated from every rank's state, by the plan
    (independent of the checkpoint code)."""
    plan = states[0].sharding.plan
    out = {}
    for u in plan.units:
        parts = [(getattr(s, field) if field in ("params", "master") else getattr(s.opt_state, field))[u.name]
                 for s in states]
        flat = parts[0] if parts[0].numel() == u.padded_numel else torch.cat(parts)
        for s in u.slots:
            out[s.name] = flat[s.offset:s.offset + s.numel].reshape(s.shape)
    return out


def _model_with_buffer_and_frozen() -> torch.nn.Module:
    m = build_model()
    m.register_buffer("seen", torch.arange(3, dtype=torch.float32))
    m[0].bias.requires_grad_(False)
    return m


@pytest.mark.parametrize("stage,world,bf16", [(3, 2, False), (1, 1, False), (2, 2, True)])
def test_universal_files_hold_the_weights_moments_step_and_schedule(tmp_path, stage, world, bf16):
    """zero/<name>/{fp32,exp_avg,exp_avg_sq,step}.pt equal the saved state's (consolidated across
    the saving ranks; a bf16 run's fp32 master, not its rounded params); the model-states files
    hold the step counts, the schedule's position, the buffer and placeholders;
    optimizer_state.pt the next step's lr and the Adam step."""
    # ~0.8 s for the three cases.
    extra = {"bf16": {"enabled": True}} if bf16 else {}
    want, states = _saved(str(tmp_path / "fz"), _model_with_buffer_and_frozen(), stage, world, **extra)
    if bf16:
        master, rounded = _by_name(states, "master"), _by_name(states, "params")
        assert all(rounded[n].dtype == torch.bfloat16 for n in rounded)
        assert any(not torch.equal(master[n], rounded[n].float()) for n in master)  # the master is not the params
        want = master
    d = to_deepspeed_universal(tmp_path / "fz", tmp_path / "ds")
    assert d == str(tmp_path / "ds" / "global_step3")
    assert (tmp_path / "ds" / "latest_universal").read_text() == "global_step3"
    trainable = ["0.weight", "2.weight", "2.bias"]
    assert sorted(os.listdir(os.path.join(d, "zero"))) == sorted([*trainable, "optimizer_state.pt"])
    moments = {f: _by_name(states, f) for f in ("exp_avg", "exp_avg_sq")}
    for name in trainable:
        files = sorted(os.listdir(os.path.join(d, "zero", name)))
        assert files == ["exp_avg.pt", "exp_avg_sq.pt", "fp32.pt", "step.pt"]
        got = {f: torch.load(os.path.join(d, "zero", name, f"{f}.pt")) for f in ("fp32", "exp_avg", "exp_avg_sq")}
        assert all(g["cat_dim"] == 0 and g["param"].dtype == torch.float32 for g in got.values())
        assert torch.equal(got["fp32"]["param"], want[name])
        for f in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(got[f]["param"], moments[f][name]), (name, f)
        assert torch.equal(torch.load(os.path.join(d, "zero", name, "step.pt")), torch.tensor(3.0))
    opt = torch.load(os.path.join(d, "zero", "optimizer_state.pt"))
    lr3 = fnzero.schedules.from_config(fnzero.load_config(_config(stage, world, **extra), world_size=world))(3)
    group = {"lr": lr3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01, "params": [0]}
    assert opt["param_groups"] == [group] and opt["optimizer_state_dict"]["param_groups"] == [group]
    assert torch.equal(opt["optimizer_state_dict"]["state"][0]["step"], torch.tensor(3.0))
    assert (opt["ds_version"], opt["clip_grad"]) == ("0.19.8", 1.0) and "loss_scaler" not in opt
    ms = torch.load(os.path.join(d, "mp_rank_00_model_states.pt"))
    z3 = torch.load(os.path.join(d, "zero_pp_rank_0_mp_rank_00_model_states.pt"))
    assert ms.keys() == z3.keys() and ms["param_shapes"] == z3["param_shapes"]
    assert (ms["global_steps"], ms["skipped_steps"], ms["lr_scheduler"]) == (3, 0, {"last_batch_iteration": 2})
    assert (ms["dp_world_size"], ms["mp_world_size"], ms["global_samples"]) == (world, 1, 3 * ROWS)
    assert [dict(g) for g in ms["param_shapes"]] == [{n: want[n].shape for n in trainable}]
    assert dict(ms["frozen_param_shapes"]) == {"0.bias": torch.Size([6])}
    assert ms["buffer_names"] == ["seen"] and torch.equal(ms["module"]["seen"].float(), torch.arange(3.0))
    assert all(ms["module"][n].numel() == 0 for n in [*trainable, "0.bias"])
    assert ms["ds_config"]["zero_optimization"]["stage"] == stage and ms["optimizer"] is None


def test_what_a_universal_checkpoint_cannot_hold_is_refused(tmp_path):
    """Each refusal is one CheckpointError naming what, and nothing is written."""
    base = build_model()
    cases = {
        "sgd": ({"optimizer": {"type": "SGD", "params": {"lr": 0.1}}}, "optimizer SGD"),
        "lamb": ({"optimizer": {"type": "Lamb", "params": {"lr": 0.01}}}, "optimizer Lamb"),
        "fp16": ({"fp16": {"enabled": True, "initial_scale_power": 8}}, "loss scale"),
    }
    for name, (extra, words) in cases.items():  # ~0.2 s each
        _saved(str(tmp_path / name), base, 0, 1, **extra)  # stage 0: Lamb reads whole tensors
        with pytest.raises(CheckpointError, match=words):
            to_deepspeed_universal(tmp_path / name, tmp_path / f"{name}-ds")
        assert not os.path.exists(tmp_path / f"{name}-ds" / "latest_universal")
    _saved(str(tmp_path / "nocfg"), base, 1, 1, with_config=False)
    with pytest.raises(CheckpointError, match="saved without its config"):
        to_deepspeed_universal(tmp_path / "nocfg", tmp_path / "nocfg-ds")
    to_deepspeed_universal(tmp_path / "nocfg", tmp_path / "nocfg-ds", config=_config(1, 1))
    with pytest.raises(CheckpointError, match="global_step3 exists"):
        to_deepspeed_universal(tmp_path / "nocfg", tmp_path / "nocfg-ds", config=_config(1, 1))
    assert sorted(os.listdir(tmp_path / "nocfg-ds")) == ["global_step3", "latest_universal"]


def test_checkpoint_convert_command(tmp_path, capsys):
    _saved(str(tmp_path / "fz"), build_model(), 2, 1)
    out = tmp_path / "ds"
    assert main(["checkpoint", "convert", str(tmp_path / "fz"), str(out), "--to", "deepspeed-universal",
                 "--ds-tag", "moved"]) == 0
    assert capsys.readouterr().out.strip() == str(out / "moved")
    assert (out / "latest_universal").read_text() == "moved"
    assert (out / "moved" / "zero" / "2.weight" / "exp_avg.pt").is_file()
    assert main(["checkpoint", "convert", str(tmp_path / "fz"), str(out), "--to", "fnzero"]) == 1
    assert "is not a DeepSpeed checkpoint" in capsys.readouterr().err
    assert main(["checkpoint", "convert", str(tmp_path / "none"), str(out), "--to", "deepspeed-universal"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("fnzero checkpoint convert: ") and "no checkpoint directory" in err


# -- DeepSpeed itself resumes it ------------------------------------------------------------------
def _deepspeed_runs(exe: str, tmp, world: int, stages) -> dict[int, dict]:
    """DeepSpeed resumes `tmp/ds` at each stage on `world` gloo ranks (one subprocess, one engine
    per stage) and takes MORE_STEPS on the continuation batches; {stage: losses, params}."""
    runs = [{"config": _config(s, world, checkpoint={"load_universal": True}), "out": str(tmp / f"ds{s}w{world}.pt")}
            for s in stages]
    spec = {"world": world, "load": str(tmp / "ds"), "batches": str(tmp / "batches.pt"), "runs": runs}
    (tmp / f"spec{world}.json").write_text(json.dumps(spec))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    r = subprocess.run([exe, os.path.join(HERE, "_ds_universal_runner.py"), str(tmp / f"spec{world}.json")],
                       capture_output=True, text=True, env={**env, "OMP_NUM_THREADS": "1"}, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    return {s: torch.load(run["out"]) for s, run in zip(stages, runs)}


def test_deepspeed_resumes_the_converted_checkpoint_as_fnzero_does(tmp_path, deepspeed_python):
    """fnzero trains 3 steps on 2 ranks (ZeRO-1) and saves; the checkpoint converted to universal is
    resumed by DeepSpeed 0.19.8 at ZeRO 1, 2, 3 on 1 and 2 ranks, and each takes the 2 steps that
    fnzero takes from its own checkpoint: the same losses and parameters in float32.

    Tolerance 1e-6 (absolute, parameters of size ~0.5; relative for the losses): a few float32
    ulps, the noise of summation order. Measured: fnzero against DeepSpeed 6e-8 (losses) and
    1.5e-8 (parameters), the same as DeepSpeed's own spread between its stages and world sizes;
    the two steps move the parameters by ~1e-2, and a wrong lr, Adam step or moment moves them
    by far more than the tolerance."""
    # ~25 s: two DeepSpeed subprocesses (import ~3 s, 3 engines each).
    base = build_model()
    _saved(str(tmp_path / "fz"), base, 1, 2)
    to_deepspeed_universal(tmp_path / "fz", tmp_path / "ds")
    more = _batches(SAVED_STEPS + MORE_STEPS)[SAVED_STEPS:]
    torch.save(more, tmp_path / "batches.pt")
    cfg = fnzero.load_config(_config(2, 1))
    sm = fnzero.shard(copy.deepcopy(base), config=cfg)
    saved, _ = load(tmp_path / "fz", like=sm.init_state())
    step = fnzero.train_step(lambda p, b: torch.nn.functional.mse_loss(sm.apply(p, b[0]), b[1]), cfg)
    before, losses = sm.state_dict(saved), []
    state = saved
    for b in more:
        state, m = step(state, b)
        losses.append(m["loss"])
    want = sm.state_dict(state)
    results = {}
    for world in (1, 2):
        for stage, got in _deepspeed_runs(deepspeed_python, tmp_path, world, (1, 2, 3)).items():
            results[(stage, world)] = got
    for (stage, world), got in results.items():
        assert got["global_steps"] == SAVED_STEPS + MORE_STEPS, (stage, world)
        torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(losses), rtol=1e-6, atol=0)
        for name, p in want.items():
            torch.testing.assert_close(got["params"][name], p, rtol=0, atol=1e-6, msg=f"{name} stage {stage} w{world}")
            assert (p - before[name]).abs().max() > 1e-3  # the steps moved it: the agreement is not vacuous
