"""Consolidated export (safetensors / torch), sharding, tied and frozen weights, export_live, CLI."""

from __future__ import annotations

import copy
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


def test_checkpoint_info_names_the_params_own_dtype_and_the_masters(tmp_path, capsys):
    from fnzero.checkpoint import info
    from fnzero.cli._main import main

    d, _ = _trained(tmp_path, kind="mlp:5,7,3", stage=2, world=1, precision="bf16")
    entry = info(d)["checkpoints"][0]
    assert (entry["param_dtype"], entry["master_dtype"]) == ("bfloat16", "float32")
    assert main(["checkpoint", "info", d]) == 0
    assert "66 parameters (bfloat16 params + float32 master)" in capsys.readouterr().out
    d32, _ = _trained(tmp_path / "fp32", kind="mlp:5,7,3", stage=2, world=1)
    assert main(["checkpoint", "info", d32]) == 0
    assert "66 parameters (float32 params), AdamState" in capsys.readouterr().out


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


# -- Hugging Face models: the export directory alone is a from_pretrained directory ------------------
@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_hf_exports_reload_with_from_pretrained_and_nothing_else(tmp_path, kind):
    """export_live takes the config from the sharded model, export from files from hf_config=;
    both directories load with AutoModelForCausalLM.from_pretrained(dir) alone, same logits."""
    import transformers
    from _worlds import hf_model

    base = hf_model(kind).eval()  # float64, small, built from its config class: nothing downloaded
    d, live = str(tmp_path / "ck"), str(tmp_path / "live")
    x = torch.randint(0, 51, (2, 8), generator=torch.Generator().manual_seed(0))
    cfg = fnzero.load_config({"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW"},
                              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}})

    def fn(comm):
        sm = fnzero.shard(copy.deepcopy(base), config=cfg, comm=comm)
        state = sm.init_state()
        save(d, state)
        paths = export_live(sm, state, live, dtype="fp64", progress=False)
        with torch.no_grad():
            return paths, sm.apply(state.params, input_ids=x).logits

    (paths, ours), (paths1, _) = simulated_world(2).run(fn)
    assert paths == paths1 == [os.path.join(live, f) for f in ("model.safetensors", "config.json", "generation_config.json")]
    files = export(d, tmp_path / "files", dtype="fp64", hf_config=base.config, progress=False)
    assert [os.path.basename(p) for p in files] == ["model.safetensors", "config.json"]  # a config has no generation config
    for where in (live, str(tmp_path / "files")):
        reloaded = transformers.AutoModelForCausalLM.from_pretrained(where)
        assert type(reloaded) is type(base) and reloaded.dtype == torch.float64  # the exported dtype, from config.json
        with torch.no_grad():
            theirs = reloaded(input_ids=x).logits
        assert torch.equal(theirs, ours), (where, (theirs - ours).abs().max())  # the same weights and float64 ops


def test_hf_config_from_a_save_pretrained_directory_and_refused_values(tmp_path):
    from _worlds import hf_model

    d, _ = _trained(tmp_path, kind="mlp:5,7,3", world=1, stage=0)
    src = tmp_path / "pretrained"
    hf_model("gpt2").save_pretrained(src)
    paths = export(d, tmp_path / "out", dtype="bf16", hf_config=src, progress=False)
    assert [os.path.basename(p) for p in paths] == ["model.safetensors", "config.json", "generation_config.json"]
    with open(paths[1]) as f, open(src / "config.json") as g:
        written, original = json.load(f), json.load(g)
    assert written == {**original, "dtype": "bfloat16"}  # the weights' dtype, as save_pretrained records it
    from fnzero.cli._main import main

    assert main(["export", d, str(tmp_path / "cli"), "--hf-config", str(src), "-q"]) == 0  # the command's form
    assert sorted(os.listdir(tmp_path / "cli")) == ["config.json", "generation_config.json", "model.safetensors"]
    with pytest.raises(fnzero.CheckpointError, match="there is no .*nowhere \\(give a save_pretrained directory"):
        export(d, tmp_path / "o2", hf_config=tmp_path / "nowhere", progress=False)
    with pytest.raises(fnzero.CheckpointError, match="hf_config= must be a Hugging Face config.*got a dict"):
        export(d, tmp_path / "o3", hf_config={"model_type": "gpt2"}, progress=False)


# -- every rank calls export: one writes, every rank returns its paths or its failure ---------------
def test_export_live_failing_midway_on_the_writer_reaches_every_rank(tmp_path):
    """Rank 0 fails after writing some shards (a directory stands where a later one goes) while
    the other rank takes part in the unit gathers: both raise, the other naming rank 0, none hangs."""
    out = tmp_path / "out"

    def fn(comm, target):
        _, sm, state, _ = setup("gpt", 3, comm, dtype=torch.float32)
        try:
            return export_live(sm, state, target, max_shard_size="2KB", progress=False)
        except Exception as e:  # noqa: BLE001 - each rank reports what it raised
            return f"{type(e).__name__}: {e}"

    paths = simulated_world(2).run(lambda comm: fn(comm, str(tmp_path / "probe")))[0]
    shards = [os.path.basename(p) for p in paths if p.endswith(".safetensors")]
    assert len(shards) > 4
    os.makedirs(out / shards[-2])  # the writer gets this far, then cannot rename the shard into place
    r0, r1 = simulated_world(2).run(lambda comm: fn(comm, str(out)))
    assert r0.startswith(("IsADirectoryError", "OSError")), r0
    assert r1.startswith("CheckpointError: the export failed on rank 0, the rank that writes it (this rank only "
                         "waited for it): " + r0.split(":")[0]), r1


def _export_on_every_rank(d: str, out: str, blocked: str):
    from fnzero.sharding import ProcessGroupCollectives

    _, sm, state, _ = setup("gpt", 3, ProcessGroupCollectives(), dtype=torch.float32)
    save(d, state)
    got = {"files": export(d, os.path.join(out, "files"), progress=False),
           "live": export_live(sm, state, os.path.join(out, "live"), progress=False)}
    try:
        export(d, blocked, progress=False)  # rank 0 cannot make this directory: a file stands there
    except Exception as e:  # noqa: BLE001 - each rank reports what it raised
        got["error"] = f"{type(e).__name__}: {e}"
    return got


@pytest.mark.multiprocess
def test_export_on_every_rank_of_a_gloo_world_writes_once_and_returns_the_same_paths(tmp_path):
    from fnzero.testing import run_world

    (tmp_path / "file").write_text("not a directory")
    r0, r1 = run_world(_export_on_every_rank, 2, str(tmp_path / "ck"), str(tmp_path / "out"),
                       str(tmp_path / "file" / "model.safetensors"), timeout=120)
    for form in ("files", "live"):
        assert r0[form] == r1[form] == [str(tmp_path / "out" / form / "model.safetensors")]
        assert os.listdir(tmp_path / "out" / form) == ["model.safetensors"]  # one complete file, no leftovers
    a, b = st.load_file(r0["files"][0]), st.load_file(r0["live"][0])
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert r0["error"].startswith("FileExistsError"), r0
    assert r1["error"].startswith("CheckpointError: the export failed on rank 0, the rank that writes it"), r1
    assert "FileExistsError" in r1["error"], r1
