"""Consolidated export (safetensors / torch), sharding, tied and frozen weights, export_live, CLI."""

from __future__ import annotations

import json
import os

import pytest
import safetensors.torch as st
import torch
from _ckpt_helpers import run_steps, setup
from _worlds import make_model

import fnzero
from fnzero.checkpoint import export, export_live, save
from fnzero.testing._threads import simulated_world


def _trained(tmp_path, kind="gpt_tied", stage=3, world=2, precision="fp32"):
    d = str(tmp_path / "ck")

    def fn(comm):
        _, sm, state, step = setup(kind, stage, comm, precision, dtype=torch.float32)
        state, _ = run_steps(kind, step, state, comm, 0, 1, dtype=torch.float32)
        save(d, state)
        out = str(tmp_path / f"live-{comm.rank}")
        export_live(sm, state, out, dtype="fp32", progress=False)
        return sm.state_dict(state)

    return d, simulated_world(world).run(fn)[0]


def test_export_loads_into_a_fresh_model_tied_weights_included(tmp_path):
    d, want = _trained(tmp_path)
    paths = export(d, tmp_path / "out", dtype="fp32", progress=False)
    assert paths == [str(tmp_path / "out" / "model.safetensors")]
    sd = st.load_file(paths[0])
    model = make_model("gpt_tied", torch.float32, seed=5)
    model.load_state_dict(sd)  # strict: every name, tied ones included
    for name, t in model.state_dict().items():
        assert torch.equal(t, want[name]), name
    assert model.head.weight is model.wte.weight
    # export_live from the running job wrote the same bytes
    live = st.load_file(str(tmp_path / "live-0" / "model.safetensors"))
    assert live.keys() == sd.keys() and all(torch.equal(live[k], sd[k]) for k in sd)
    assert not os.path.exists(tmp_path / "live-1")


def test_bf16_master_weights_are_exported_not_the_rounded_params(tmp_path):
    d, want = _trained(tmp_path, kind="mlp:5,7,3", stage=2, precision="bf16")
    sd = st.load_file(export(d, tmp_path / "o.safetensors", dtype="fp32", progress=False)[0])
    assert all(torch.equal(sd[k], want[k].float()) for k in sd)
    sd16 = st.load_file(export(d, tmp_path / "o16.safetensors", dtype="bf16", progress=False)[0])
    assert all(v.dtype == torch.bfloat16 and torch.equal(v, want[k].to(torch.bfloat16)) for k, v in sd16.items())


def test_tied_first_follows_the_safetensors_convention(tmp_path):
    d, _ = _trained(tmp_path)
    p = export(d, tmp_path / "first.safetensors", tied="first", progress=False)[0]
    assert "head.weight" not in st.load_file(p)
    model = make_model("gpt_tied", torch.float32, seed=5)
    missing, unexpected = st.load_model(model, p)
    assert not unexpected


def test_sharded_export_with_hf_index(tmp_path):
    d, want = _trained(tmp_path)
    paths = export(d, tmp_path / "sh" / "model.safetensors", max_shard_size="1KB", dtype="fp16", progress=False)
    index_path = paths[-1]
    assert index_path.endswith("model.safetensors.index.json") and len(paths) > 3
    with open(index_path) as f:
        index = json.load(f)
    assert set(index["weight_map"]) == set(want)
    merged = {}
    for fname in sorted(set(index["weight_map"].values())):
        p = tmp_path / "sh" / fname
        part = st.load_file(p)
        assert sum(v.numel() * v.element_size() for v in part.values()) <= 1000 or len(part) == 1
        merged.update(part)
    assert index["metadata"]["total_size"] == sum(v.numel() * v.element_size() for v in merged.values())
    assert all(torch.equal(merged[k], want[k].to(torch.float16)) for k in want)


def test_exclude_frozen_and_torch_format(tmp_path):
    d = str(tmp_path / "ck")

    def fn(comm):
        _, sm, state, _ = setup("mlp_frozen", 1, comm, dtype=torch.float32)
        save(d, state)
        return sm.state_dict(state)

    want = simulated_world(2).run(fn)[0]
    sd = st.load_file(export(d, tmp_path / "a.safetensors", exclude_frozen=True, progress=False)[0])
    assert "layers.0.weight" not in sd and "layers.0.bias" in sd
    p = export(d, tmp_path / "t", format="torch", progress=False)[0]
    assert p.endswith("pytorch_model.bin")
    sd = torch.load(p, weights_only=True)
    assert sd.keys() == want.keys() and all(torch.equal(sd[k], want[k]) for k in want)


def test_cli_export_and_info(tmp_path, capsys):
    from fnzero.cli._main import main

    d, want = _trained(tmp_path)
    assert main(["export", d, str(tmp_path / "cli"), "--dtype", "bf16", "--max-shard-size", "4KB", "-q"]) == 0
    printed = capsys.readouterr().out.split()
    assert printed[-1].endswith("model.safetensors.index.json")
    assert main(["checkpoint", "info", d, "--verify", "--config"]) == 0
    out = capsys.readouterr().out
    assert "saved by 2 rank(s) at ZeRO stage 3" in out and "checksums verified" in out
    assert main(["export", str(tmp_path / "nothing"), str(tmp_path / "x")]) == 1
    assert "no checkpoint directory" in capsys.readouterr().err
    assert main(["export", d, str(tmp_path / "x"), "--dtype", "int3"]) == 1
    assert main(["export", d, str(tmp_path / "x"), "--max-shard-size", "lots"]) == 1


def test_bad_arguments(tmp_path):
    d, _ = _trained(tmp_path, kind="mlp:3,2", world=1, stage=0)
    with pytest.raises(fnzero.CheckpointError, match="export format"):
        export(d, tmp_path / "x", format="pickle")
    with pytest.raises(fnzero.CheckpointError, match="tied must be"):
        export(d, tmp_path / "x", tied="both")
