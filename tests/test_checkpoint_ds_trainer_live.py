"""A real Hugging Face Trainer's `checkpoint-N/` (specs/checkpoint-format.md §DeepSpeed, "A Hugging
Face Trainer's directory"): transformers' Trainer fine-tunes a tiny Llama under DeepSpeed 0.19.8 at
ZeRO-2 and ZeRO-3 on 2 gloo ranks (`scripts/hf_trainer_checkpoint.py`, in DeepSpeed's interpreter);
fnzero reads what the job left: `info`, `load` into a state at another world size and stage equal
bit for bit to the weights the Trainer saved (`model.safetensors`), its count agreeing with
`trainer_state.json`, and `deepspeed_to_fnzero`. Skipped with the reason where DeepSpeed, or
Accelerate beside it, is not importable (FNZERO_DEEPSPEED_PYTHON names the interpreter)."""

from __future__ import annotations

import json
import os
import subprocess
import warnings

import optree
import pytest
import torch
from safetensors.torch import load_file

import fnzero
from fnzero.checkpoint import info, load
from fnzero.checkpoint._ds_layout import describe
from fnzero.testing._threads import simulated_world

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(scope="module", params=[2, 3])
def trainer_run(request, tmp_path_factory):
    """(checkpoint-3 of a Trainer run at ZeRO `stage`, the stage)."""
    python = os.environ.get("FNZERO_DEEPSPEED_PYTHON")
    if not python:
        pytest.skip("set FNZERO_DEEPSPEED_PYTHON to an interpreter with deepspeed==0.19.8, transformers and accelerate")
    probe = subprocess.run([python, "-c", "import deepspeed, accelerate, transformers"], capture_output=True, text=True,
                           env={**os.environ, "DS_ACCELERATOR": "cpu"}, timeout=300)
    if probe.returncode != 0:
        pytest.skip(f"{python} cannot import deepspeed, accelerate and transformers: {probe.stderr[-300:]}")
    out = tmp_path_factory.mktemp(f"trainer{request.param}")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    r = subprocess.run([python, os.path.join(HERE, "scripts", "hf_trainer_checkpoint.py"), str(out), str(request.param)],
                       capture_output=True, text=True, timeout=600,
                       env={**env, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "DS_ACCELERATOR": "cpu"})
    assert r.returncode == 0, r.stderr[-4000:]
    return str(out / "checkpoint-3"), request.param


def _llama():
    import importlib.util as iu

    spec = iu.spec_from_file_location("_hf_trainer_script", os.path.join(HERE, "scripts", "hf_trainer_checkpoint.py"))
    script = iu.module_from_spec(spec)
    spec.loader.exec_module(script)
    return script.llama()


def test_a_trainers_checkpoint_resumes_and_converts(trainer_run, tmp_path):
    root, stage = trainer_run
    entry = info(root)["checkpoints"][0]
    assert (entry["step"], entry["world_size"], entry["stage"]) == (3, 2, stage)
    with open(os.path.join(root, "trainer_state.json")) as f:
        assert json.load(f)["global_step"] == 3
    ds_config = describe(root).meta["ds_config"]  # (read as fnzero reads it: DeepSpeed's classes are not here)
    saved = load_file(os.path.join(root, "model.safetensors"))
    base = _llama()
    for world, to_stage in ((2, 5 - stage), (1, stage)):
        # The job's config, Accelerate's steps_per_print=inf included, at another stage (and world:
        # its global batch then follows from the micro-batch).
        moved = {k: v for k, v in ds_config.items() if k != "train_batch_size" or world == 2}
        cfg = fnzero.load_config({**moved, "zero_optimization": {"stage": to_stage}}, world_size=world)

        def fn(comm):
            import copy

            sm = fnzero.shard(copy.deepcopy(base), config=cfg, comm=comm)
            with warnings.catch_warnings():
                warnings.simplefilter("error")  # (the Trainer's count agrees: no TrainerStateWarning)
                state, _ = load(root, like=sm.init_state(), config=cfg)
            return int(state.step), sm.state_dict(state)

        for step, sd in simulated_world(world).run(fn):
            assert step == 3
            assert all(torch.equal(sd[n], t) for n, t in saved.items()), (world, to_stage)
    out = fnzero.deepspeed_to_fnzero(root, str(tmp_path / "fz"))
    cfg = fnzero.load_config(ds_config, world_size=2)
    like = fnzero.shard(_llama(), config=cfg).init_state()
    a, b = load(out, like=like)[0], load(root, like=like, config=cfg)[0]
    assert all(torch.equal(x, y) for x, y in zip(optree.tree_leaves(a), optree.tree_leaves(b)) if isinstance(x, torch.Tensor))

