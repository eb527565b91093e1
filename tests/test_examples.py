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


# What an example's stderr must not hold: a Python warning of any kind (FutureWarning,
# DeprecationWarning, UserWarning, ...), a line transformers logs (its `[transformers]` prefix:
# `use_cache=True is incompatible ...`), a from_pretrained load report. Progress bars may stay.
_NOISE = re.compile(r"Warning\b|\[transformers\]|LOAD REPORT|UNEXPECTED|MISSING|deprecated", re.I)


def _run(args, timeout=240, quiet=False):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    if quiet:
        noise = [line for line in proc.stderr.splitlines() if _NOISE.search(line)]
        assert not noise, proc.stderr
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


def _header(path):
    import json
    import struct

    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(n))


@pytest.mark.multiprocess
def test_train_gpt_resumes_across_the_plain_pipeline_and_tensor_parallel_runs_and_exports(tmp_path):
    """The README's runs of examples/train_gpt.py resume each other's checkpoints: one process
    (ZeRO-0) -> 2 tensor-parallel ranks -> 2 pipeline stages -> 2 ranks at ZeRO-3 -> 2
    sequence-parallel ranks at ZeRO-3, each going on
    from the step the one before saved, each exporting whole weights. (A pipeline's checkpoint
    into tensor-parallel ranks reads by name with the tp cut, as into a pipeline at tp 2:
    tests/test_pipeline.py; a fifth run here would cost more than it proves.)"""
    ckpt = str(tmp_path / "run")
    small = ["--layers", "2", "--d-model", "64", "--checkpoint-dir", ckpt]
    # (The first run also stands for "the example trains on one process": the loss falls.)
    out = _run([sys.executable, "examples/train_gpt.py", "--config", "examples/configs/zero0.json", "--steps", "30", *small])
    assert f"saved checkpoint {ckpt} (step 30)" in out, out
    start = _losses(out)[0]
    assert _losses(out)[1] < start - 1.0, out
    # The README's tp, pipeline and headline commands, each resuming the one before (tp on 2 ranks
    # rather than the README's 4: one tp group, on the suite's 2 cores).
    more = ["--steps", "5", *small]
    chain = [(readme_argv("examples/train_gpt.py", "examples/configs/tp2_zero1.json", nproc=2, extra=more), "tensor-parallel 2"),
             (readme_argv("examples/train_gpt.py", "examples/configs/pp2_zero1.json", extra=more), "x 2 pipeline stages"),
             (readme_argv("examples/train_gpt.py", "examples/configs/zero3.json", extra=more), "ZeRO stage 3"),
             (readme_argv("examples/train_gpt.py", "examples/configs/sp2_zero3.json", extra=more), "sequence-parallel 2")]
    for i, (argv, shows) in enumerate(chain):
        out = _run(argv)
        config = argv[argv.index("--config") + 1]
        step = 30 + 5 * i
        assert f"resumed from {ckpt} at step {step}" in out and f"(step {step + 5})" in out and shows in out, out
        assert _losses(out)[0] < start - 1.0, (config, out)  # it did not start over
        # Exported by every rank's call (one writes): whole bf16 weights in the model's own names.
        header = _header(tmp_path / "run" / "model.safetensors")
        assert header["wte.weight"]["dtype"] == "BF16" and header["wte.weight"]["shape"] == [256, 64], (config, header)
        assert header["blocks.1.fc.weight"]["shape"] == [256, 64], (config, header)
    assert len(re.findall(r"rank \d: model state", out)) == 2, out
    # The README's description of the output: progress lines carry rank 0's memory (memory_breakdown).
    assert re.search(r"^step +\d+ \| loss .* tok/s.*\nmemory: model state .* \| peak RSS ", out, re.M), out


@pytest.mark.multiprocess
def test_finetune_hf_two_ranks_meta_pretrained_checkpointing_bf16(tmp_path):
    """examples/finetune_hf.py: save_pretrained shards -> meta model -> ZeRO-3 on 2 ranks with the
    model's checkpointing and bf16 -> checkpoint -> export -> from_pretrained, same logits; no
    warning on stderr, no load report."""
    out = _run(readme_argv("examples/finetune_hf.py",
                           extra=["--steps", "12", "--seq-len", "32", "--out", str(tmp_path), "--reentrant"]),
               quiet=True)
    first, last = _losses(out)
    assert last < first - 0.5, out
    read = [float(x) for x in re.findall(r"read ([0-9.]+) MiB", out)]
    assert len(read) == 2 and len(set(read)) == 1, out  # each rank its own half
    assert "max abs diff 0\n" in out, out
    assert os.path.exists(tmp_path / "checkpoint" / "latest") and os.path.exists(tmp_path / "tuned" / "config.json")


@pytest.mark.multiprocess
def test_lora_generate_two_ranks_adapters_generate_as_peft_and_transformers(tmp_path):
    """examples/lora_generate.py: a meta-built PEFT LoRA Llama at ZeRO-3 on 2 ranks with its
    checkpointing, each rank holding half the frozen base; sampling while it trains; adapters out
    in PEFT's format; `PeftModel.from_pretrained` + transformers' generate give fnzero.generate's
    tokens; no warning on stderr."""
    out = _run(readme_argv("examples/lora_generate.py",
                           extra=["--steps", "4", "--sample-every", "2", "--new-tokens", "6", "--out", str(tmp_path)]),
               quiet=True)
    held = re.findall(r"rank \d: model state [0-9.]+ MiB, of which its part of the frozen base ([0-9.]+) MiB "
                      r"\(the whole base: ([0-9.]+) MiB\)", out)
    assert len(held) == 2 and all(abs(2 * float(part) - float(whole)) < 0.02 for part, whole in held), out
    assert len(re.findall(r"^step \d: loss [0-9.]+; sampled: ", out, re.M)) == 2, out
    assert "greedy True, seeded sampling True" in out, out
    assert sorted(os.listdir(tmp_path / "adapter")) == ["adapter_config.json", "adapter_model.safetensors"]
