"""`fnzero export` / `fnzero checkpoint info` of checkpoints DeepSpeed 0.19.8 itself wrote
(specs/checkpoint-format.md §DeepSpeed): the consolidated weights equal, bit for bit, the full fp32
weights DeepSpeed's engine holds, at ZeRO stages 0-3 in fp32 and bf16 and stage 2 in fp16 with a
dynamic loss scaler (world 2), for a MoE model at ZeRO-2 and at stage 0 (4 experts over 2
expert-parallel ranks, named by global expert id as DeepSpeed's expert files name them), for a two-stage
pipeline (`layer_*` files, which DeepSpeed's own zero_to_fp32 does not read), and for a tiny
Hugging Face Llama at ZeRO-3, whose export with its config loads with `from_pretrained`.

DeepSpeed runs in a subprocess (`tests/scripts/deepspeed_checkpoints.py`, once per session, all
checkpoints from one pair of processes: ~12 s on two idle cores), with the interpreter named by
`FNZERO_DEEPSPEED_PYTHON`, else this one when it can import deepspeed; otherwise these tests skip,
saying so. fnzero's side never imports DeepSpeed."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

from fnzero.checkpoint import export, info

HERE = os.path.dirname(os.path.abspath(__file__))
NAMES = ["s0_fp32", "s0_bf16", "s1_fp32", "s1_bf16", "s2_fp32", "s2_bf16", "s3_fp32", "s3_bf16", "s2_fp16",
         "llama_bf16", "moe_fp32", "moe_bf16", "moe0_fp32", "pipe_fp32",
         "pipe_bf16"]  # (pipelines last: their topology stays set up)


def _deepspeed_python() -> str | None:
    named = os.environ.get("FNZERO_DEEPSPEED_PYTHON")
    if named:
        return named
    return sys.executable if importlib.util.find_spec("deepspeed") is not None else None


@pytest.fixture(scope="session")
def ds_checkpoints(tmp_path_factory):
    python = _deepspeed_python()
    if python is None:
        pytest.skip("DeepSpeed is not importable here and FNZERO_DEEPSPEED_PYTHON names no interpreter that has it "
                    "(DS_BUILD_OPS=0 pip install deepspeed==0.19.8 in any venv; CPU is enough)")
    out = str(tmp_path_factory.mktemp("deepspeed"))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", "PYTHONWARNINGS": "ignore"}
    env.pop("PYTHONPATH", None)  # DeepSpeed's interpreter has its own packages
    t0 = time.monotonic()
    run = subprocess.run([python, os.path.join(HERE, "scripts", "deepspeed_checkpoints.py"), out, *NAMES],
                         env=env, capture_output=True, text=True, timeout=600)
    if run.returncode != 0:
        pytest.fail(f"DeepSpeed could not write the checkpoints ({python}):\n{run.stderr[-4000:]}")
    print(f"DeepSpeed wrote {len(NAMES)} checkpoints in {time.monotonic() - t0:.1f} s")
    return out


@pytest.mark.parametrize("name", NAMES)
def test_export_equals_what_deepspeeds_engine_holds(ds_checkpoints, name, tmp_path):
    root = os.path.join(ds_checkpoints, name)
    expected = torch.load(os.path.join(root, "expected.pt"), weights_only=True)
    [out] = export(root, str(tmp_path), progress=False)
    got = load_file(out)
    for n, want in expected.items():
        assert n in got, n
        assert got[n].dtype == (torch.float32 if want.is_floating_point() else want.dtype), n
        assert torch.equal(got[n].to(want.dtype), want), n
    if name.startswith("s"):  # the tied head is written under its own name too, as state_dict() has it
        assert set(got) == set(expected) | {"head.weight"} and torch.equal(got["head.weight"], got["emb.weight"])
    else:
        assert set(got) == set(expected), set(got) ^ set(expected)


@pytest.mark.parametrize("name", ["s0_bf16", "s3_bf16", "pipe_bf16", "s2_fp16"])
def test_info_describes_the_checkpoint(ds_checkpoints, name):
    rep = info(os.path.join(ds_checkpoints, name), verify=True)
    [c] = rep["checkpoints"]
    assert (rep["format"], rep["latest"], c["tag"], c["step"], c["master_dtype"]) == (
        "deepspeed", "global_step2", "global_step2", 2, "float32")
    assert c["health"] == "ok (every tensor read and checked)"
    assert c["deepspeed"]["lr_scheduler"] == {"last_batch_iteration": 1}
    assert (c["stage"], c["world_size"], c["deepspeed"]["pp_degree"], c["param_dtype"]) == {
        "s0_bf16": (0, 2, 1, "bfloat16"), "s3_bf16": (3, 2, 1, "bfloat16"), "pipe_bf16": (0, 1, 2, "bfloat16"),
        "s2_fp16": (2, 2, 1, "float16")}[name]
    if name == "s2_fp16":  # DynamicLossScaler read as data: 2**8, halved at each overflow-skipped step
        skipped = c["deepspeed"]["skipped_steps"]
        assert c["fp16_loss_scale"] == 2.0 ** (8 - skipped) or skipped == 0 and c["fp16_loss_scale"] >= 2.0**8
    else:
        assert c["deepspeed"]["skipped_steps"] == 0


def test_a_hugging_face_model_exported_with_its_config_loads_with_from_pretrained(ds_checkpoints, tmp_path):
    transformers = pytest.importorskip("transformers")
    root = os.path.join(ds_checkpoints, "llama_bf16")
    paths = export(root, str(tmp_path), hf_config=os.path.join(root, "hf"), progress=False)
    assert sorted(os.path.basename(p) for p in paths) == ["config.json", "model.safetensors"]
    model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path))
    expected, got = torch.load(os.path.join(root, "expected.pt"), weights_only=True), model.state_dict()
    assert type(model).__name__ == "LlamaForCausalLM" and set(got) == set(expected)
    assert all(torch.equal(got[n], expected[n]) for n in expected)


def test_the_commands_read_a_tag_directory(ds_checkpoints, tmp_path, capsys):
    from fnzero.cli import main

    tag_dir = os.path.join(ds_checkpoints, "s2_bf16", "global_step2")
    assert main(["checkpoint", "info", tag_dir]) == 0
    said = capsys.readouterr().out
    assert "ZeRO stage 2" in said and "deepspeed 0.19.8" in said and "bfloat16 params + float32 master" in said
    assert main(["export", tag_dir, str(tmp_path), "--dtype", "bf16", "--tied", "first", "-q"]) == 0
    got = load_file(os.path.join(tmp_path, "model.safetensors"))
    assert "head.weight" not in got and got["emb.weight"].dtype == torch.bfloat16


def _fixture_model():
    """The model `scripts/deepspeed_checkpoints.py` trains (a tied head, a frozen layer, two buffers)."""
    import importlib.util as iu

    spec = iu.spec_from_file_location("_ds_fixture_script", os.path.join(HERE, "scripts", "deepspeed_checkpoints.py"))
    script = iu.module_from_spec(spec)
    spec.loader.exec_module(script)
    torch.manual_seed(1)
    return script._mlp(torch)


@pytest.mark.parametrize("name,stage", [("s1_fp32", 3), ("s2_bf16", 1), ("s3_bf16", 2), ("s3_fp32", 0),
                                        ("s1_bf16", 3), ("s0_fp32", 2), ("s0_bf16", 3)])
def test_load_resumes_the_checkpoint_into_a_train_state(ds_checkpoints, name, stage):
    """`fnzero.checkpoint.load` reads DeepSpeed's files into a state of another stage and world
    size (1): the fp32 weights DeepSpeed's engine holds (the master of a bf16 run, its params
    rounded from it), the tied head, the frozen layer, the buffers, Adam's step and fnzero's."""
    from fnzero.checkpoint import load
    import fnzero

    root = os.path.join(ds_checkpoints, name)
    expected = torch.load(os.path.join(root, "expected.pt"), weights_only=True)
    cfg = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW"}, "zero_optimization": {"stage": stage}}
    if name.endswith("bf16"):
        cfg["bf16"] = {"enabled": True}
    sm = fnzero.shard(_fixture_model(), config=fnzero.load_config(cfg))
    state, client = load(root, like=sm.init_state())
    # (DeepSpeed's stage-0 bf16 wrapper steps Adam once with zero gradients when built: its count is 3)
    assert (int(state.step), int(state.opt_state.count), client) == (2, 3 if name == "s0_bf16" else 2, {})
    got = sm.state_dict(state)
    for n, want in expected.items():
        if n.startswith(("frozen.", "step_buf", "count")):
            assert torch.equal(got[n], want.to(got[n].dtype)), n
    masters = {n: state.master[u.name][s.offset:s.offset + s.numel].view(s.shape)
               for u in sm.plan.units for s in u.slots for n in (s.name, *s.aliases)} if state.master is not None else None
    for n in ("emb.weight", "l1.weight", "l1.bias", "l2.weight", "l2.bias"):
        assert torch.equal(got[n], expected[n].to(got[n].dtype)), n  # (bf16: rounded from the master)
        if masters is not None:
            assert torch.equal(masters[n], expected[n]), n
    assert torch.equal(got["head.weight"], got["emb.weight"])
    assert all(float(t.abs().sum()) > 0 for t in state.opt_state.exp_avg_sq.values())


def test_load_resumes_the_fp16_loss_scaler(ds_checkpoints):
    """DeepSpeed's DynamicLossScaler (2**8, window 2, hysteresis 2 by default) becomes the state's
    loss scale; a config with another hysteresis is refused, naming it."""
    from fnzero import CheckpointError
    from fnzero.checkpoint import load
    import fnzero

    root = os.path.join(ds_checkpoints, "s2_fp16")
    [c] = info(root)["checkpoints"]
    for hysteresis in (2, 3):
        cfg = fnzero.load_config({"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW"},
                                  "fp16": {"enabled": True, "loss_scale_window": 2, "hysteresis": hysteresis}})
        like = fnzero.shard(_fixture_model(), config=cfg).init_state()
        if hysteresis == 3:
            with pytest.raises(CheckpointError, match="delayed_shift 2, the config's fp16.hysteresis is 3"):
                load(root, like=like, config=cfg)
            continue
        state, _ = load(root, like=like, config=cfg)
        assert float(state.loss_scale.scale) == c["fp16_loss_scale"]
        assert int(state.step) == 2 - c["deepspeed"]["skipped_steps"]


def test_a_parameter_frozen_in_the_checkpoint_is_not_resumed_as_trainable(ds_checkpoints):
    """The fixture's frozen layer has no Adam state in DeepSpeed's files: a state that trains it is
    refused, naming it, rather than given moments from elsewhere."""
    from fnzero import CheckpointError
    from fnzero.checkpoint import load
    import fnzero

    model = _fixture_model()
    model.frozen.requires_grad_(True)
    cfg = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW"}, "zero_optimization": {"stage": 2}}
    like = fnzero.shard(model, config=fnzero.load_config(cfg)).init_state()
    with pytest.raises(CheckpointError, match=r"holds no optimizer state for 'frozen\.(weight|bias)' \(frozen when it "
                                              r"was saved\)"):
        load(os.path.join(ds_checkpoints, "s2_fp32"), like=like)


def _by_saved_name(states, field: str) -> dict[str, torch.Tensor]:
    """{name in DeepSpeed's files: whole fp32 tensor} of `field` ("master", "params", "exp_avg",
    "exp_avg_sq") from every simulated rank's leaves: each rank's elements of its units' slots (a
    pipeline stage's layers, its experts named by global id as the whole model names them)."""
    from fnzero.checkpoint._tree import state_leaves, units_by_key

    out, shapes = {}, {}
    for st in states:
        units, ep = units_by_key(st.sharding.plan), st.sharding.ep
        for leaf in state_leaves(st):
            top, _, rest = leaf.path.partition("/")
            if leaf.unit is None or (top if top in ("master", "params") else rest.partition("/")[0]) != field:
                continue
            u = units[leaf.unit]
            for s in u.slots:
                a, b = max(leaf.lo, s.offset), min(leaf.hi, s.offset + s.numel)
                name = s.name if ep is None or not u.is_expert else \
                    f"{u.module}.{ep.renames[u.module](s.name[len(u.module) + 1:], ep.rank)[0]}"
                if a < b:
                    buf = out.setdefault(name, torch.full((s.numel,), float("nan")))
                    buf[a - s.offset:b - s.offset] = leaf.tensor.reshape(-1)[a - leaf.lo:b - leaf.lo].float()
                    shapes[name] = s.shape
    return {n: t.view(shapes[n]) for n, t in out.items()}


def _resumed_as_deepspeed_held(root: str, states: list) -> None:
    """The states hold, bit for bit, the fp32 weights DeepSpeed's engine held (the master of a bf16
    run; its params rounded from it) and the full Adam moments it held, every one of them once."""
    expected = torch.load(os.path.join(root, "expected.pt"), weights_only=True)
    moments = torch.load(os.path.join(root, "moments.pt"), weights_only=True)
    assert {(int(s.step), int(s.opt_state.count)) for s in states} == {(2, 2)}
    fields = {"weights": "master" if states[0].master is not None else "params", "exp_avg": "exp_avg",
              "exp_avg_sq": "exp_avg_sq"}
    for what, field in fields.items():
        got = _by_saved_name(states, field)
        assert sorted(got) == sorted(moments), what
        for n, t in got.items():
            want = expected[n] if what == "weights" else moments[n][what]
            assert torch.equal(t, want), (what, n)
    if states[0].master is not None:
        params = _by_saved_name(states, "params")
        assert all(torch.equal(params[n], expected[n].to(torch.bfloat16).float()) for n in params)


D = 8  # the fixture script's width
_PIPE_LAYERS = [(D, D), None, (D, 5), (5, D)]  # the fixture's PipelineModule: Linear, ReLU, Linear, Linear


def _pipe_states(root: str, stages: int, dp: int, stage: int, bf16: bool) -> list:
    """`root` loaded into fnzero's PipelineModule of the fixture's layers: `stages` stages of `dp`
    simulated ranks each, at ZeRO `stage`; every rank's state."""
    import copy

    from fnzero.checkpoint import load
    from fnzero.testing._threads import simulated_world
    import fnzero

    # (built once, copied by each rank: the simulated ranks are threads sharing one RNG)
    layers = [torch.nn.Linear(*io) if io else torch.nn.ReLU() for io in _PIPE_LAYERS]
    cfg = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW"}, "zero_optimization": {"stage": stage},
           "pipeline": {"stages": stages}, **({"bf16": {"enabled": True}} if bf16 else {})}

    def fn(comm):
        pipe = fnzero.PipelineModule(copy.deepcopy(layers), torch.nn.functional.mse_loss)
        sm = fnzero.shard(pipe, config=fnzero.load_config(cfg, world_size=comm.world_size), comm=comm)
        state, client = load(root, like=sm.init_state())
        assert not client  # (DeepSpeed: {}, nothing passed to save_checkpoint; its conversion: None)
        return state

    return simulated_world(stages * dp).run(fn)


def _moe_states(root: str, stage: int, world: int, ep: int, bf16: bool) -> list:
    """`root` loaded into the fixture's model built with fnzero's MoE layer, on `world` simulated
    ranks at expert parallelism `ep` and ZeRO `stage`; every rank's state."""
    import copy

    from fnzero.checkpoint import load
    from fnzero.moe import MoE
    from fnzero.testing._threads import simulated_world
    import fnzero

    class Net(torch.nn.Module):  # the fixture's model, with fnzero's MoE layer
        def __init__(self):
            super().__init__()
            self.inp = torch.nn.Linear(D, D)
            self.moe = MoE(hidden_size=D, expert=torch.nn.Linear(D, D), num_experts=4, ep_size=ep, k=1,
                           use_residual=False, min_capacity=1)
            self.out = torch.nn.Linear(D, D)

    model = Net()
    cfg = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW"}, "zero_optimization": {"stage": stage},
           **({"bf16": {"enabled": True}} if bf16 else {})}

    def fn(comm):
        sm = fnzero.shard(copy.deepcopy(model), config=fnzero.load_config(cfg, world_size=world // ep), comm=comm,
                          mesh=fnzero.make_mesh(comm, ep=ep))
        state, client = load(root, like=sm.init_state())
        assert not client and (state.sharding.ep is not None) == (ep > 1)
        return state

    return simulated_world(world).run(fn)


@pytest.mark.parametrize("name,stages,dp,stage", [("pipe_fp32", 1, 1, 2), ("pipe_fp32", 2, 2, 1),
                                                  ("pipe_bf16", 1, 2, 3), ("pipe_bf16", 2, 1, 0)])
def test_load_resumes_a_pipeline_checkpoint(ds_checkpoints, name, stages, dp, stage):
    """DeepSpeed's two-stage PipelineModule (stage 0 in fp32: each stage's Adam state in its model
    file; BF16_Optimizer in bf16: each stage's optimizer files) resumes into fnzero's PipelineModule
    of the same layers, whose parameters carry the same names (`2.weight`), in one stage on `dp`
    ranks, or in two stages, each rank holding its stage's layers only."""
    root = os.path.join(ds_checkpoints, name)
    states = _pipe_states(root, stages, dp, stage, name.endswith("bf16"))
    _resumed_as_deepspeed_held(root, states)
    held = [sorted({s.name for u in st.sharding.plan.units for s in u.slots}) for st in states]
    assert held[0] == (["0.bias", "0.weight"] if stages == 2 else ["0.bias", "0.weight", "2.bias", "2.weight",
                                                                   "3.bias", "3.weight"])


@pytest.mark.parametrize("name,stage,world,ep", [("moe_fp32", 1, 1, 1), ("moe_fp32", 3, 2, 2), ("moe_bf16", 2, 4, 2),
                                                 ("moe_bf16", 0, 4, 4), ("moe0_fp32", 3, 2, 2), ("moe0_fp32", 1, 1, 1)])
def test_load_resumes_a_moe_checkpoint(ds_checkpoints, name, stage, world, ep):
    """DeepSpeed's MoE layer (4 experts over 2 expert-parallel ranks) at ZeRO-2, the expert group
    partitioned over the expert-data-parallel ranks and named locally in each rank's files, and at
    stage 0 in fp32, each expert-parallel rank's torch optimizer in its own `expp_rank_*` file,
    resumes into fnzero's own MoE layer without expert parallelism (every expert, by its global
    id) and with it (ep 2 and 4: each rank its experts), at any stage."""
    root = os.path.join(ds_checkpoints, name)
    _resumed_as_deepspeed_held(root, _moe_states(root, stage, world, ep, name.endswith("bf16")))


@pytest.mark.parametrize("name", ["pipe_fp32", "pipe_bf16", "moe_bf16", "moe0_fp32"])
def test_convert_to_fnzero_keeps_what_load_reads_of_pipelines_and_experts(ds_checkpoints, name, tmp_path):
    """`deepspeed_to_fnzero` of a pipeline (the stand-in names its layers' parameters by index) or a
    MoE checkpoint (its experts by global id) loads into a two-stage pipeline, or at ep 2, exactly
    as DeepSpeed's own files load: every rank's every leaf bit for bit."""
    import optree

    import fnzero

    root = os.path.join(ds_checkpoints, name)
    out = fnzero.deepspeed_to_fnzero(root, str(tmp_path / "fz"))
    bf16 = name.endswith("bf16")
    states = (lambda r: _pipe_states(r, 2, 1, 1, bf16)) if name.startswith("pipe") else \
        (lambda r: _moe_states(r, 2, 2, 2, bf16))
    for conv, direct in zip(states(out), states(root)):
        for a, b in zip(optree.tree_leaves(conv, none_is_leaf=True), optree.tree_leaves(direct, none_is_leaf=True)):
            assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b
        assert int(conv.step) == int(direct.step) == 2


@pytest.mark.parametrize("name,world", [("s3_fp32", 4), ("s3_bf16", 2)])
def test_each_rank_reads_only_its_shard_of_a_zero3_checkpoint(ds_checkpoints, name, world, monkeypatch):
    """Resumed at ZeRO-3 on `world` simulated ranks, each rank opens exactly the optimizer files that hold
    slices of its shard (DeepSpeed's rank r holds slice r of each parameter padded to 2 x ceil(n/2)),
    copies exactly its share of the fp32 weights and both moments out of them, and what it holds is
    what DeepSpeed's engine held. (At world 2 each rank's shard overlaps both files; at 4 a rank's
    quarter of a unit mostly lies in one.) The frozen layer likewise: its share only, from the model
    files (the fragments DeepSpeed's rank r holds)."""
    import copy
    import threading

    from test_checkpoint_ds_shard import record_reads

    from fnzero.checkpoint import load
    from fnzero.testing._threads import simulated_world
    import fnzero

    root = os.path.join(ds_checkpoints, name)
    expected = torch.load(os.path.join(root, "expected.pt"), weights_only=True)
    cfg = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW"},
           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
    if name.endswith("bf16"):
        cfg["bf16"] = {"enabled": True}
    model, opened_by, skipped = _fixture_model(), {}, 0
    opened, copied = record_reads(monkeypatch)

    def fn(comm):
        opened_by[comm.rank] = threading.get_ident()
        sm = fnzero.shard(copy.deepcopy(model), config=fnzero.load_config(cfg, world_size=world), comm=comm)
        return load(root, like=sm.init_state())[0]

    states = simulated_world(world).run(fn)
    plan, prefix = states[0].sharding.plan, "bf16_" if name.endswith("bf16") else ""
    for u in plan.units:
        full = torch.cat([(s.master if s.master is not None else s.params)[u.name] for s in states])
        for s in u.slots:
            assert torch.equal(full[s.offset:s.offset + s.numel].view(s.shape), expected[s.name]), s.name
    for u in plan.frozen_units:
        full = torch.cat([s.frozen[u.name] for s in states])
        for s in u.slots:
            assert torch.equal(full[s.offset:s.offset + s.numel].view(s.shape), expected[s.name].to(full.dtype)), s.name
    assert plan.frozen_units
    for rank, ident in opened_by.items():
        mine, want = 0, set()  # (its share of elements, the DeepSpeed ranks holding them)
        frozen = sum(max(0, min(hi, s.offset + s.numel) - max(lo, s.offset)) for u in plan.frozen_units
                     for lo, hi in [u.real_range(rank)] for s in u.slots)
        for u in plan.units:
            lo, hi = u.real_range(rank)
            for s in u.slots:
                a, b = max(lo, s.offset) - s.offset, min(hi, s.offset + s.numel) - s.offset
                ps = -(-s.numel // 2)
                want |= set(range(a // ps, (b - 1) // ps + 1)) if a < b else set()
                mine += max(0, b - a)
        assert sorted(set(opened[ident])) == [f"{prefix}zero_pp_rank_{r}_mp_rank_00_optim_states.pt"
                                              for r in sorted(want)], rank
        # The fp32 weights and two moments of its share, and its share of the frozen layer (from the
        # model files' frozen_param_fragments), nothing more.
        assert frozen > 0 and copied[ident] == 3 * mine + frozen, rank
        skipped += len(want) < 2
    assert (skipped > 0) == (world == 4)


@pytest.mark.parametrize("name,stage", [("s0_fp32", 3), ("s0_bf16", 2), ("s1_bf16", 3), ("s2_fp16", 2),
                                        ("s3_fp32", 1), ("s3_bf16", 3)])
def test_convert_to_fnzero_keeps_what_load_reads(ds_checkpoints, name, stage, tmp_path):
    """`fnzero.deepspeed_to_fnzero` (without the model: names, shapes, the tied head, the frozen
    layer and the buffers from DeepSpeed's files) writes a checkpoint that loads into the model at
    another stage exactly as DeepSpeed's own files load: every leaf bit for bit, and the step."""
    import optree

    import fnzero
    from fnzero.checkpoint import load

    root = os.path.join(ds_checkpoints, name)
    out = fnzero.deepspeed_to_fnzero(root, str(tmp_path / "fz"))
    cfg = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW"}, "zero_optimization": {"stage": stage}}
    if name.endswith(("bf16", "fp16")):
        cfg[name[-4:]] = {"enabled": True, **({"loss_scale_window": 2} if name.endswith("fp16") else {})}
    like = fnzero.shard(_fixture_model(), config=fnzero.load_config(cfg)).init_state()
    (conv, _), (direct, _) = load(out, like=like), load(root, like=like)
    for a, b in zip(optree.tree_leaves(conv, none_is_leaf=True), optree.tree_leaves(direct, none_is_leaf=True)):
        assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b
    assert int(conv.step) == int(direct.step) > 0
