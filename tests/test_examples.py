"""The examples run from a fresh checkout, in short mode (specs: README's run command). The README's
own commands are run here, read from README.md (`readme_argv`) and shortened by options appended
after them; tests/test_readme.py checks that each one is."""

import os
import re
import subprocess
import sys

import pytest

from _readme import readme_argv

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(args, timeout=240):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def _losses(out):
    m = re.search(r"loss ([0-9.]+) -> ([0-9.]+)", out)
    assert m, out
    return float(m.group(1)), float(m.group(2))


# The jitted examples trace with aot_eager: the graphs and their breaks are dynamo's whatever the
# backend, and inductor's code is checked against eager in tests/test_jit*.py (its cold compile
# would add half a minute per example here).
def test_train_gpt_with_its_whole_step_jitted_loss_falls_without_graph_breaks():
    out = _run([sys.executable, "examples/train_gpt.py", "--config", "examples/configs/zero0.json", "--steps", "40",
                "--layers", "1", "--d-model", "32", "--heads", "2", "--jit", "step", "--jit-backend", "aot_eager",
                "--checkpoint-dir", ""], timeout=420)
    first, last = _losses(out)
    assert last < first - 0.5, out
    assert re.search(r"jit: first step \(trace \+ compile\) [0-9.]+s, graph breaks: 0$", out, re.M), out


@pytest.mark.multiprocess
def test_train_gpt_zero3_two_ranks_jitted_per_unit_without_graph_breaks():
    # The default scope compiles each unit once; at stage 3 the gathers run between the graphs.
    out = _run([sys.executable, "-m", "fnzero.cli", "launch", "--nproc-per-node", "2", "examples/train_gpt.py",
                "--config", "examples/configs/zero3.json", "--steps", "40", "--layers", "2", "--d-model", "32",
                "--heads", "2", "--jit", "--jit-backend", "aot_eager", "--checkpoint-dir", ""], timeout=420)
    first, last = _losses(out)
    assert last < first - 0.5, out
    assert re.search(r"jit: first step \(trace \+ compile\) [0-9.]+s, graph breaks: 0$", out, re.M), out


@pytest.mark.multiprocess
def test_train_gpt_saves_resumes_on_another_world_and_exports(tmp_path):
    import json
    import struct

    ckpt = str(tmp_path / "run")
    small = ["--layers", "2", "--d-model", "64", "--checkpoint-dir", ckpt]
    # (This run and the next also stand for "the example trains on one process / on 2 ranks at
    # stage 3": the loss falls in each.)
    out1 = _run([sys.executable, "examples/train_gpt.py", "--config", "examples/configs/zero0.json", "--steps", "30", *small])
    assert f"saved checkpoint {ckpt} (step 30)" in out1, out1
    assert _losses(out1)[1] < _losses(out1)[0] - 1.0, out1
    # The 1-process stage-0 checkpoint resumes on 2 ranks at stage 3 and goes on from step 30.
    # (the README's headline command)
    out2 = _run(readme_argv("examples/train_gpt.py", "examples/configs/zero3.json", extra=["--steps", "30", *small]))
    assert f"resumed from {ckpt} at step 30" in out2 and f"(step 60)" in out2, out2
    assert _losses(out2)[0] < _losses(out1)[0] - 1.0, (out1, out2)  # it did not start over
    assert _losses(out2)[1] < _losses(out2)[0], out2
    assert len(re.findall(r"rank \d: model state", out2)) == 2, out2
    # The README's description of the output: progress lines carry rank 0's memory (memory_breakdown).
    assert re.search(r"^step +\d+ \| loss .* tok/s.*\nmemory: model state .* \| peak RSS ", out2, re.M), out2
    with open(tmp_path / "run" / "model.safetensors", "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    assert header["wte.weight"]["dtype"] == "BF16" and header["wte.weight"]["shape"] == [256, 64]
    # ... and on 2 tensor-parallel ranks (specs/mesh.md): it resumes, trains, saves and exports whole weights.
    # (The README's tp command, on 2 ranks rather than its 4: one tp group, on the suite's 2 cores.)
    out3 = _run(readme_argv("examples/train_gpt.py", "examples/configs/tp2_zero1.json", nproc=2,
                            extra=["--steps", "10", *small]))
    assert f"resumed from {ckpt} at step 60" in out3 and "(step 70)" in out3 and "tensor-parallel 2" in out3, out3
    assert _losses(out3)[0] < _losses(out1)[0] - 1.0, out3
    with open(tmp_path / "run" / "model.safetensors", "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    assert header["blocks.0.fc.weight"]["shape"] == [256, 64], header


@pytest.mark.multiprocess
def test_finetune_hf_two_ranks_meta_pretrained_checkpointing_bf16(tmp_path):
    """examples/finetune_hf.py: save_pretrained shards -> meta model -> ZeRO-3 on 2 ranks with the
    model's checkpointing and bf16 -> checkpoint -> export -> from_pretrained, same logits."""
    out = _run(readme_argv("examples/finetune_hf.py",
                           extra=["--steps", "12", "--seq-len", "32", "--out", str(tmp_path), "--reentrant"]))
    first, last = _losses(out)
    assert last < first - 0.5, out
    read = [float(x) for x in re.findall(r"read ([0-9.]+) MiB", out)]
    assert len(read) == 2 and len(set(read)) == 1, out  # each rank its own half
    assert "max abs diff 0\n" in out, out
    assert os.path.exists(tmp_path / "checkpoint" / "latest") and os.path.exists(tmp_path / "tuned" / "config.json")


@pytest.mark.multiprocess
def test_train_gpt_in_two_pipeline_stages_trains_saves_and_exports(tmp_path):
    """The README's pipeline command: the GPT's layers cut into 2 stages, 1F1B (specs/mesh.md §Pipeline)."""
    ckpt = str(tmp_path / "run")
    out = _run(readme_argv("examples/train_gpt.py", "examples/configs/pp2_zero1.json",
                           extra=["--steps", "30", "--layers", "2", "--d-model", "64", "--checkpoint-dir", ckpt]))
    assert "x 2 pipeline stages" in out and f"saved checkpoint {ckpt} (step 30)" in out, out
    first, last = _losses(out)
    assert last < first - 0.5, out
    assert os.path.exists(tmp_path / "run" / "model.safetensors"), out
