"""fnzero.monitor: logging outside the pure step (specs/monitor.md)."""

import csv
import io
import sys
import types

import pytest
import torch

import fnzero
from fnzero.memory import model_state_bytes
from fnzero.monitor import Monitor, TIMING_KEYS

M = {"loss": 2.0, "lr": 1e-3, "grad_norm": 0.5, "loss_scale": None, "skipped": False}


def _cfg(**extra):
    return fnzero.load_config({"train_batch_size": 8, "steps_per_print": 2, **extra})


class _Clock:
    """Deterministic seconds: each call advances by `dt`."""

    def __init__(self, dt=0.5):
        self.t, self.dt = 0.0, dt

    def __call__(self):
        self.t += self.dt
        return self.t - self.dt


def _csv(path):
    with open(path, newline="") as f:
        return list(csv.reader(f))


class _Tty(io.StringIO):
    def isatty(self):
        return True


def _mon(cfg=None, **kw):
    out = kw.pop("stream", io.StringIO())
    kw.setdefault("clock", _Clock())
    return Monitor.from_config(cfg or _cfg(), rank=kw.pop("rank", 0), world_size=2, stream=out, **kw), out


def test_prints_every_steps_per_print_with_rates():
    mon, out = _mon(tokens_per_step=1000)
    for i in range(1, 6):
        mon.log(i, {**M, "loss": float(i)})
    lines = out.getvalue().splitlines()
    # 0.5 s/step: 1000/0.5 tok/s, 8 samples (train_batch_size) / 0.5 s
    assert lines == [
        "step     2 | loss 2.0000 | lr 1.00e-03 | grad norm 0.500 | 2,000 tok/s | 16.0 samples/s",
        "step     4 | loss 4.0000 | lr 1.00e-03 | grad norm 0.500 | 2,000 tok/s | 16.0 samples/s",
    ]
    mon.close()  # the unprinted last step
    assert out.getvalue().splitlines()[-1].startswith("step     5 | loss 5.0000")
    mon.close()
    assert len(out.getvalue().splitlines()) == 3


def test_total_steps_prints_the_last_step_and_scale_and_skips():
    mon, out = _mon(total_steps=3, samples_per_step=4)
    mon.log(1, {**M, "loss_scale": 65536.0, "skipped": True})
    mon.log(2, {**M, "loss_scale": torch.tensor(32768.0), "loss": torch.tensor(1.5)})
    mon.log(3, M)
    lines = out.getvalue().splitlines()
    assert lines[0] == "step     2 | loss 1.5000 | lr 1.00e-03 | grad norm 0.500 | scale 32768 | 8.0 samples/s | skipped 1"
    assert lines[1].startswith("step     3 |")
    mon.close()
    assert len(out.getvalue().splitlines()) == 2


def test_other_ranks_stay_silent(tmp_path):
    cfg = _cfg(csv_monitor={"enabled": True, "output_path": str(tmp_path), "job_name": "j"})
    with _mon(cfg, rank=1)[0] as mon:
        for i in range(1, 5):
            mon.log(i, M)
        assert mon.profile_flops(torch.nn.Linear(4, 4), torch.ones(1, 4)).total == 32
    assert mon.stream.getvalue() == "" and not (tmp_path / "j").exists()


def test_csv_monitor_layout_and_resume(tmp_path):
    cfg = _cfg(csv_monitor={"enabled": True, "output_path": str(tmp_path), "job_name": "job"}, wall_clock_breakdown=True)
    for run in range(2):  # a resumed run appends, without a second header
        with _mon(cfg)[0] as mon:
            mon.log(1, {**M, "loss_scale": 1024.0}, timings={"forward": 0.25, "optimizer": 0.001})
            mon.log(2, {**M, "timings": {"forward": 0.5}})
    d = tmp_path / "job"
    names = sorted(p.name for p in d.iterdir())
    assert names == ["Train_Samples_elapsed_time_ms_forward.csv", "Train_Samples_elapsed_time_ms_optimizer.csv",
                     "Train_Samples_grad_norm.csv", "Train_Samples_loss_scale.csv", "Train_Samples_lr.csv",
                     "Train_Samples_train_loss.csv"]
    rows = _csv(d / "Train_Samples_train_loss.csv")
    assert rows == [["step", "train_loss"], ["8", "2.0"], ["16", "2.0"], ["8", "2.0"], ["16", "2.0"]]
    rows = _csv(d / "Train_Samples_elapsed_time_ms_forward.csv")
    assert rows[:3] == [["step", "elapsed_time_ms_forward"], ["8", "250.0"], ["16", "500.0"]]
    assert len(_csv(d / "Train_Samples_loss_scale.csv")) == 3


def test_tensorboard_missing_names_the_package(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import fails as without tensorboard
    with pytest.raises(ImportError, match="pip install tensorboard"):
        _mon(_cfg(tensorboard={"enabled": True}), rank=1)  # every rank checks, not only rank 0


def test_tensorboard_writes_scalars(monkeypatch, tmp_path):
    from fnzero.monitor import _writers

    calls = []

    class FakeWriter:
        def __init__(self, log_dir):
            calls.append(("dir", log_dir))

        def add_scalar(self, name, value, x):
            calls.append((name, value, x))

        def flush(self):
            pass

        def close(self):
            calls.append("closed")

    monkeypatch.setattr(_writers, "check_tensorboard", lambda: None)
    monkeypatch.setattr("fnzero.monitor._monitor.check_tensorboard", lambda: None)
    monkeypatch.setattr(_writers, "_summary_writer", FakeWriter)
    cfg = _cfg(tensorboard={"enabled": True, "output_path": str(tmp_path), "job_name": "tb"})
    with _mon(cfg)[0] as mon:
        mon.log(1, M)
    assert calls[0] == ("dir", str(tmp_path / "tb"))
    assert ("Train/Samples/train_loss", 2.0, 8) in calls and ("Train/Samples/lr", 1e-3, 8) in calls
    assert calls[-1] == "closed"


def test_wall_clock_breakdown_prints_mean_timings():
    mon, out = _mon(_cfg(wall_clock_breakdown=True))
    mon.log(1, M, timings={"forward": 0.010, "backward": 0.020, "comm": 0.004, "optimizer": 0.002, "gather": 0.001})
    mon.log(2, {**M, "timings": {"forward": 0.030, "backward": 0.040, "comm": 0.006, "optimizer": 0.004}})
    line = out.getvalue().splitlines()[1]
    assert line == "time/step: forward 20.00 ms | backward 30.00 ms | comm 5.00 ms | optimizer 3.00 ms | gather 0.50 ms"
    assert TIMING_KEYS == ("forward", "backward", "comm", "optimizer")
    mon2, out2 = _mon()  # off in the config: not printed
    mon2.log(2, M, timings={"forward": 1.0})
    assert "time/step" not in out2.getvalue()


def test_memory_breakdown_counts_the_state():
    cfg = fnzero.load_config({"train_batch_size": 2, "steps_per_print": 1, "memory_breakdown": True,
                              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "zero_optimization": {"stage": 2}})
    sm = fnzero.shard(torch.nn.Linear(64, 64), config=cfg)
    state = sm.init_state()
    mon, out = _mon(cfg)
    mon.log(1, M, state=state)
    mem = out.getvalue().splitlines()[1]
    msb = model_state_bytes(state)
    assert mem.startswith(f"memory: model state {msb.total / 2**20:.2f} MiB (params {msb.params / 2**20:.2f} MiB")
    assert "peak RSS" in mem


def test_flops_profile_breakdown_and_achieved_rate(tmp_path):
    cfg = _cfg(flops_profiler={"enabled": True, "profile_step": 3, "module_depth": 1, "top_modules": 1},
               gradient_accumulation_steps=2)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16, bias=False), torch.nn.ReLU(), torch.nn.Linear(16, 4, bias=False))
    mon, out = _mon(cfg, clock=_Clock(dt=0.001))
    assert [mon.should_profile(i) for i in (1, 2, 3, 4)] == [False, False, True, False]
    mon.log(1, M)
    mon.log(2, M)
    prof = mon.profile_flops(model, torch.ones(5, 8))
    assert prof.total == 2 * 5 * 8 * 16 + 2 * 5 * 16 * 4 == 1920
    assert prof.by_module == {"Sequential": 1920, "Sequential.0": 1280, "Sequential.2": 640}
    assert prof.top == {0: [("Sequential", 1920)], 1: [("Sequential.0", 1280)]}
    assert prof.step_flops == 1920 * 3 * 2 and prof.output.shape == (5, 4)
    text = out.getvalue()
    assert "flops profiler" in text and "depth 1: Sequential.0 1.28 KFLOP (66.7%)" in text
    assert "achieved ~ 11.52 MFLOP/s per rank" in text  # 11520 FLOP in the last step's 1 ms
    mon.log(3, M)
    mon.log(4, M)
    assert out.getvalue().splitlines()[-1].endswith("| 11.52 MFLOP/s per rank")
    # with its own backward, a call is counted as is; output_file takes the report
    cfg = _cfg(flops_profiler={"enabled": True, "output_file": str(tmp_path / "flops.txt"), "detailed": False})
    mon, out = _mon(cfg)
    x = torch.ones(5, 8)
    prof = mon.profile_flops(lambda: model(x).sum().backward(), includes_backward=True, calls_per_step=1)
    assert prof.step_flops == prof.total > 1920
    assert out.getvalue() == "" and "profiled call" in (tmp_path / "flops.txt").read_text()


def test_progress_bar_only_on_terminals(monkeypatch):
    made = []

    class FakeTqdm:
        def __init__(self, **kw):
            self.kw, self.n, self.lines, self.closed = kw, 0, [], False
            made.append(self)

        def update(self, k):
            self.n += k

        def write(self, line, file=None):
            self.lines.append(line)

        def set_postfix(self, **kw):
            self.postfix = kw

        def close(self):
            self.closed = True

    monkeypatch.setitem(sys.modules, "tqdm", types.SimpleNamespace(tqdm=FakeTqdm))
    mon, out = _mon(stream=io.StringIO(), total_steps=4)  # not a terminal: no bar
    assert made == []
    with _mon(stream=_Tty(), total_steps=4)[0] as mon:
        for i in range(1, 5):
            mon.log(i, M)
    (bar,) = made
    assert bar.kw["total"] == 4 and bar.n == 4 and bar.closed and len(bar.lines) == 2
    assert bar.postfix["loss"] == "2.0000"
    monkeypatch.setitem(sys.modules, "tqdm", None)  # a terminal without tqdm: lines, no bar
    mon, out = _mon(stream=_Tty())
    mon.log(2, M)
    assert out.getvalue().startswith("step     2")


def test_from_config_takes_what_load_config_takes(tmp_path):
    mon = Monitor.from_config({"train_micro_batch_size_per_gpu": 3, "steps_per_print": 7}, rank=0, world_size=2,
                              stream=io.StringIO())
    assert mon.steps_per_print == 7 and mon.samples_per_step == 6


def test_memory_breakdown_names_a_ranks_share_of_a_mesh():
    """specs/monitor.md: on a pipeline (and tp) mesh the model-state line says which stage's layers
    and which tensor-parallel slice this rank holds."""
    from fnzero.testing import gpt_layers, simulated_world

    def rank(comm):
        cfg = fnzero.load_config({"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 2,
                                  "steps_per_print": 1, "memory_breakdown": True, "pipeline": {"stages": 2},
                                  "optimizer": {"type": "AdamW"}}, world_size=2)
        pipe = fnzero.PipelineModule(gpt_layers(vocab_size=16, seq_len=4, d_model=8, n_layer=2, n_head=2),
                                     lambda out, y: out.sum(), partition_method="uniform")
        sm = fnzero.shard(pipe, config=cfg, comm=comm)
        mon, out = _mon(cfg)
        mon.log(1, M, state=sm.init_state())
        return out.getvalue().splitlines()[1], sm.plan.num_params

    for r, (line, n) in enumerate(simulated_world(2).run(rank)):
        layers = "0-1" if r == 0 else "2-3"
        assert f"of {n:,} parameters (pp stage {r}/2, layers {layers}), sharded over 1 dp rank(s)" in line
