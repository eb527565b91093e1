"""The figure script behind the README's plot runs end to end in a short mode, and what it draws
is what it claims: the four stages' loss curves coincide and their model-state bars are the
exact per-rank bytes, equal to the ZeRO formulas."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.multiprocess
def test_plot_stages_short_mode_draws_equal_curves_and_exact_memory(tmp_path):
    pytest.importorskip("matplotlib")
    out, js = tmp_path / "stages.png", tmp_path / "stages.json"
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "plot_stages.py"), "--world", "2", "--steps", "3",
           "--micro", "2", "--seq-len", "16", "--d-model", "32", "--layers", "2", "--heads", "2",
           "--out", str(out), "--json", str(js), "--one-world"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000
    import json

    res = json.loads(js.read_text())["results"]
    assert sorted(res) == ["0", "1", "2", "3"]
    base = res["0"]["losses"]
    for s in "123":
        assert res[s]["losses"] == pytest.approx(base, rel=1e-5), s
    for s in "0123":
        # fp32 AdamW: the measured bytes include padding to the world size, so they may exceed
        # the formula by a few elements per unit and never fall below it.
        got, want = res[s]["model_state"], res[s]["formula"]
        assert want <= got <= want * 1.01, (s, got, want)
    states = [res[s]["model_state"] for s in "0123"]
    assert states == sorted(states, reverse=True) and states[3] < states[0] / 1.9


# -m slow (two 2-rank jobs, 38 s on the 2-core CI machine): NVMe offload's numbers are checked in
# tests/test_offload_nvme_step.py; this checks the benchmark's rows.
@pytest.mark.slow
@pytest.mark.multiprocess
def test_bench_zero_nvme_configurations_train_the_same_model(tmp_path):
    # ZeRO-Infinity row of bench_zero.py: optimizer and parameters on NVMe give the in-memory run's
    # loss exactly (specs/offload.md §Parameters), and the script prints the table. (The optimizer-only
    # row, z3_nvme, is the same script path; tests/test_offload_nvme_step.py checks its numbers.)
    js = tmp_path / "zero.json"
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "bench_zero.py"), "--model", "gpt_tiny", "--world", "2",
           "--steps", "2", "--warmup", "1", "--configs", "z3,z3_nvme_params", "--nvme-dir", str(tmp_path),
           "--json", str(js)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    import json

    rows = json.loads(js.read_text())["rows"]
    assert sorted(rows) == ["z3", "z3_nvme_params"]
    assert rows["z3"]["loss"] == rows["z3_nvme_params"]["loss"]
    assert "optimizer + params on NVMe" in p.stdout
    assert not [f for f in os.listdir(tmp_path) if f.startswith("fnzero-rank")]  # scratch files removed


def test_bench_aio_short_mode_reports_every_round(tmp_path):

    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "bench_aio.py"), "--size", "8M", "--rounds", "2",
           "--dir", str(tmp_path)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    rows = [line.split() for line in p.stdout.splitlines() if line[:1].isdigit()]
    assert [r[0] for r in rows if r[1] == "fnzero"] == ["0", "1"]
    if shutil.which("fio"):
        assert "fnzero / fio, median of 2 rounds" in p.stdout
    else:
        assert "fio: not installed" in p.stdout
    assert list(tmp_path.iterdir()) == []  # the scratch file is gone


@pytest.mark.multiprocess
def test_bench_mesh_short_mode_reports_exact_state_and_traffic_per_axis(tmp_path):
    """benchmarks/bench_mesh.py on a tiny GPT: every configuration's state bytes are its formula,
    tp 2 holds fewer parameters per rank than dp 2 and sends tp traffic, dp 2 sends none."""
    import json

    js = tmp_path / "mesh.json"
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "bench_mesh.py"), "--model", "gpt_tiny", "--steps", "1",
           "--warmup", "0", "--configs", "dp2_z1,tp2_z1", "--json", str(js)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    rows = json.loads(js.read_text())
    for r in rows.values():
        assert r["state_bytes"] == r["formula"]
    assert rows["tp2_z1"]["psi_rank"] < rows["dp2_z1"]["psi_rank"] == rows["dp2_z1"]["psi"]
    assert rows["tp2_z1"]["tp_sent"] > 0 and rows["dp2_z1"]["tp_sent"] == 0
    assert rows["tp2_z1"]["dp_sent"] == 0 < rows["dp2_z1"]["dp_sent"]  # tp 2 on 2 ranks: dp is 1


def test_bench_moe_short_mode_measures_the_all_to_all_and_state_formulas(tmp_path, monkeypatch, capsys):
    """benchmarks/bench_moe.py on a tiny MoE GPT, 4 simulated ranks: every configuration's all-to-all
    bytes and model-state bytes are their formulas (specs/collectives.md §All-to-all, specs/mesh.md
    §Expert parallelism memory), splitting the experts shrinks the state, and the first loss is the
    same model's at every ep."""
    import json

    monkeypatch.syspath_prepend(os.path.join(ROOT, "benchmarks"))
    import bench_moe

    js = tmp_path / "moe.json"
    bench_moe.main(["--simulated", "--model", "tiny", "--steps", "1", "--warmup", "0", "--json", str(js)])
    rows = json.loads(js.read_text())["rows"]
    assert sorted(rows) == ["dense", "ep1", "ep2", "ep4"]
    for r in rows.values():
        assert r["a2a_equal"] and r["state_equal"] and r["a2a_bytes"] == r["a2a_formula"]
    assert rows["ep1"]["a2a_bytes"] == 0 < rows["ep2"]["a2a_bytes"] < rows["ep4"]["a2a_bytes"]
    states = [rows[k]["state_bytes"] for k in ("ep1", "ep2", "ep4", "dense")]
    assert states == sorted(states, reverse=True)
    assert rows["ep2"]["loss"] == pytest.approx(rows["ep1"]["loss"], rel=1e-6) == rows["ep4"]["loss"]
    out = capsys.readouterr().out
    assert "machine:" in out and "a2a KB/step" in out and out.count("\nep") == 3


def test_bench_comm_opt_counts_every_feature_at_its_formula(tmp_path, monkeypatch, capsys):
    """benchmarks/bench_comm_opt.py, 2 simulated ranks, two measured steps after one warm-up (the
    1-bit optimizers frozen by then): every row's counted bytes are its spec's formula; the 1-bit
    exchange is under 1/30 of AdamW's bytes, qwZ + qgZ half of unquantized bf16's, and Muon's
    stages 1-3 reach stage 0's loss (mics: tests/test_mics.py, it needs 4 ranks)."""
    import json

    monkeypatch.syspath_prepend(os.path.join(ROOT, "benchmarks"))
    import bench_comm_opt

    js = tmp_path / "comm.json"
    bench_comm_opt.main(["--simulated", "--world", "2", "--steps", "2", "--warmup", "1", "--features",
                         "muon,onebit,zeropp", "--json", str(js)])
    rows = json.loads(js.read_text())["rows"]
    for feature, table in rows.items():
        for r in table:
            assert r["bytes_per_step"] == r["formula_bytes"], (feature, r["config"])
    base, *onebit = rows["onebit"]
    assert all(r["bytes_per_step"] < base["bytes_per_step"] / 30 for r in onebit)
    assert rows["zeropp"][-1]["bytes_per_step"] < 0.51 * rows["zeropp"][0]["bytes_per_step"]
    assert all(r["loss"] == pytest.approx(rows["muon"][0]["loss"], rel=1e-6) for r in rows["muon"])
    assert "machine:" in capsys.readouterr().out


GPU_CHECKS = ["zero_equivalence[world=1]", "zero_equivalence[world=2]", "bf16_step", "fp16_step", "jit_whole_step",
              "offload_cpu_pinned", "checkpoint_roundtrip", "bench_zero"]


def test_gpu_check_skips_every_check_cleanly_without_cuda():
    """benchmarks/gpu_check.sh where no CUDA device is visible: one SKIP line per check, saying
    why, and exit status 0 (the whole run is for CUDA machines; --device cpu is its dry run)."""
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHON=sys.executable)
    p = subprocess.run(["bash", os.path.join(ROOT, "benchmarks", "gpu_check.sh")], capture_output=True, text=True,
                       timeout=300, env=env)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    lines = p.stdout.splitlines()
    assert [line.split()[:2] for line in lines] == [["SKIP", name] for name in GPU_CHECKS], p.stdout
    assert all("no CUDA device" in line for line in lines), p.stdout


@pytest.mark.slow  # 30-90 s on 2 shared cores: two runs of spawned ranks (`-m slow` runs it)
@pytest.mark.multiprocess
def test_gpu_check_dry_run_on_cpu_passes_and_fails_on_a_wrong_reference(tmp_path):
    """The checks' own logic, dry-run on gloo: ZeRO-0..3 against plain torch and the checkpoint
    round trip pass at world size 1; with the reference's weight decay off by 0.1 % the
    equivalence check FAILs, names the stage and the differing losses, and the exit status is 1.
    (`benchmarks/gpu_check.py --device cpu` runs every check this way.)"""
    cmd = ["bash", os.path.join(ROOT, "benchmarks", "gpu_check.sh"), "--device", "cpu", "--world", "1",
           "--checks", "zero_equivalence[world=1],checkpoint_roundtrip"]
    env = dict(os.environ, PYTHON=sys.executable)
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    status = [line.split()[:2] for line in p.stdout.splitlines() if not line.startswith("#")]
    assert status == [["PASS", "zero_equivalence[world=1]"], ["PASS", "checkpoint_roundtrip"]], p.stdout
    # The same check against a reference that trains something else must fail, naming what differs.
    with open(os.path.join(ROOT, "benchmarks", "_gpu_checks.py")) as f:
        src = f.read()
    wrong = src.replace("weight_decay=WD)", "weight_decay=WD * 1.001)")
    assert wrong != src
    (tmp_path / "_gpu_checks.py").write_text(wrong)
    shutil.copy(os.path.join(ROOT, "benchmarks", "gpu_check.py"), tmp_path)  # imports the copy beside it
    env["PYTHONPATH"] = ROOT
    cmd = [sys.executable, str(tmp_path / "gpu_check.py")] + cmd[2:-1] + ["zero_equivalence[world=1]"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert p.returncode == 1, p.stdout[-2000:] + p.stderr[-3000:]
    assert "FAIL zero_equivalence[world=1]" in p.stdout and "ZeRO-0, rank 0 of 1" in p.stdout and "losses" in p.stdout


@pytest.mark.multiprocess
# -m slow (22 s): generation itself is checked against transformers in tests/test_generate.py.
@pytest.mark.slow
def test_bench_generate_short_mode_gives_transformers_tokens_and_prints_peak_rss(tmp_path, monkeypatch, capsys):
    """benchmarks/bench_generate.py on a tiny Llama, rows hf and z3_2: fnzero's ZeRO-3 ranks return
    transformers' generate() tokens, and each rank's measured peak RSS is printed beside its formula.
    (Run in this process: its ranks fork from the test session's fork server, which has imported
    torch and fnzero already.)"""
    import json

    monkeypatch.syspath_prepend(os.path.join(ROOT, "benchmarks"))
    import bench_generate

    js = tmp_path / "gen.json"
    bench_generate.main(["--hidden", "64", "--layers", "2", "--vocab", "256", "--heads", "4", "--kv-heads", "2",
                         "--batch", "2", "--prompt", "8", "--new-tokens", "4", "--rows", "hf,z3_2", "--dir",
                         str(tmp_path), "--json", str(js)])
    out = capsys.readouterr().out
    rows = json.loads(js.read_text())["rows"]
    assert rows["z3_2"]["tokens_equal_hf"] is True and len(rows["z3_2"]["ranks"]) == 2
    assert all(x["peak"] > 0 and x["share"] > 0 for r in rows.values() for x in r["ranks"])
    assert "z3_2" in out and "peak RSS generating" in out
    table = [line.split(" | ") for line in out.splitlines() if line.startswith("| z3_2 |")]
    assert len(table) == 1 and table[0][3] == "yes", out  # tokens == hf
