"""DeepSpeed universal checkpoints read by fnzero (`specs/checkpoint-format.md` §DeepSpeed, "Universal
(read)"), without DeepSpeed (these run in CI): an fnzero checkpoint written by `to_deepspeed_universal`
and rewritten into the two layouts DeepSpeed 0.19.8's `ds_to_universal` writes (ZeRO-1/2: `{'param',
'cat_dim'}` files and a `step.pt` per parameter; ZeRO-3: bare flat tensors, the step in
`optimizer_state.pt`) resumes at another world size and stage bit for bit, each rank opening only
the parameters its shard overlaps; `info` and `export` read it; damaged or hostile files are one
`CheckpointError` naming the file. DeepSpeed's own converter: `test_checkpoint_ds_universal_oracle.py`.
"""

from __future__ import annotations

import copy
import os
import shutil
import sys
import threading
import types

import pytest
import torch
from _ds_universal_runner import build_model
from safetensors.torch import load_file
from test_checkpoint_ds_universal import _by_name, _config, _model_with_buffer_and_frozen, _saved

import fnzero
from fnzero import CheckpointError
from fnzero.checkpoint import _ds_universal_read, export, info, load, to_deepspeed_universal
from fnzero.cli._main import main
from fnzero.testing._threads import simulated_world

TAG = "global_step3"
FIELDS = ("fp32", "exp_avg", "exp_avg_sq")


def _universal(tmp_path, stage=3, world=2, base=None, **extra):
    """An fnzero run saved at `stage` on `world` ranks and converted: (universal root, its states)."""
    _, states = _saved(str(tmp_path / "fz"), base or _model_with_buffer_and_frozen(), stage, world, **extra)
    to_deepspeed_universal(tmp_path / "fz", tmp_path / "ds")
    return tmp_path / "ds", states


def _load(root, stage: int, world: int, base, config=None, state_dict=False, **extra):
    """Every rank's state of `root` loaded at `stage` on `world` simulated ranks (and with
    `state_dict`, rank 0's `sm.state_dict` of it)."""
    def fn(comm):
        cfg = fnzero.load_config(_config(stage, world, **extra), world_size=world)
        sm = fnzero.shard(copy.deepcopy(base), config=cfg, comm=comm)
        state = load(root, like=sm.init_state(), config=config)[0]
        return (state, sm.state_dict(state)) if state_dict else state  # (a collective at stage 3)

    got = simulated_world(world).run(fn)
    return ([s for s, _ in got], got[0][1]) if state_dict else got


def _like_model(base):
    """`base` with another buffer value (restored from the checkpoint) and another frozen bias (kept)."""
    m = copy.deepcopy(base)
    with torch.no_grad():
        m.seen.fill_(-1.0)
        m[0].bias.fill_(5.0)
    return m


def _assert_same(got, want, fields=("params", "exp_avg", "exp_avg_sq")):
    for f in fields:
        a, b = _by_name(want, f), _by_name(got, f)
        assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a), f
    assert (int(got[0].step), int(got[0].opt_state.count)) == (int(want[0].step), int(want[0].opt_state.count))


@pytest.mark.parametrize("saved,loaded,bf16", [((3, 2), (1, 1), False), ((1, 2), (3, 4), False),
                                               ((2, 1), (2, 3), False), ((2, 2), (3, 2), True)])
def test_a_universal_checkpoint_resumes_the_state_it_was_written_from(tmp_path, saved, loaded, bf16):
    """fnzero -> to_deepspeed_universal -> load at another stage and world size: the fp32 weights (a
    bf16 run's master, and its params rounded from it), both moments, Adam's count and the step bit
    for bit; the buffer from the model-states `module`; the frozen bias `like`'s own (a universal
    checkpoint does not hold it: DeepSpeed takes it from the model)."""
    # ~0.5 s each.
    extra = {"bf16": {"enabled": True}} if bf16 else {}
    base = _model_with_buffer_and_frozen()
    root, states = _universal(tmp_path, *saved, base=base, **extra)
    got, sd = _load(root, *loaded, _like_model(base), state_dict=True, **extra)
    _assert_same(got, states, ("params", "exp_avg", "exp_avg_sq") + (("master",) if bf16 else ()))
    assert int(got[0].step) == 3
    assert torch.equal(sd["seen"], torch.arange(3.0)) and torch.equal(sd["0.bias"].float(), torch.full((6,), 5.0))
    [c] = info(root)["checkpoints"]
    assert (c["param_dtype"], c["master_dtype"]) == (("bfloat16", "float32") if bf16 else ("float32", None))


def _as_deepspeed_writes(root, layout: str) -> None:
    """Rewrite fnzero's universal tag directory into the layout DeepSpeed's `ds_to_universal` writes.
    "zero12": its optimizer_state.pt without `optimizer_state_dict` (the step is each parameter's
    step.pt), one `mp_rank_00` model file whose module holds every parameter whole, and a zero/
    directory (fp32.pt only) for the frozen parameters and buffers too; "zero3": bare flat tensors,
    no step.pt, every rank's `zero_pp_rank_R` model file."""
    d = os.path.join(root, TAG)
    zero = os.path.join(d, "zero")
    opt = torch.load(os.path.join(zero, "optimizer_state.pt"))
    ms = torch.load(os.path.join(d, "mp_rank_00_model_states.pt"))
    os.remove(os.path.join(d, "mp_rank_00_model_states.pt"))
    os.remove(os.path.join(d, "zero_pp_rank_0_mp_rank_00_model_states.pt"))
    names = [n for n in os.listdir(zero) if n != "optimizer_state.pt"]
    if layout == "zero12":
        del opt["optimizer_state_dict"]
        opt.update(zero_stage=2, partition_count=[2], group_paddings=[0])
        for n in names:
            ms["module"][n] = torch.load(os.path.join(zero, n, "fp32.pt"))["param"]
        ms["module"]["0.bias"] = torch.full((6,), 7.0)  # the frozen bias, whole
        for extra in ("0.bias", "seen"):
            os.mkdir(os.path.join(zero, extra))
            torch.save({"param": ms["module"][extra].float()}, os.path.join(zero, extra, "fp32.pt"))
        torch.save(ms, os.path.join(d, "mp_rank_00_model_states.pt"))
    else:
        for n in names:
            for f in FIELDS:
                p = os.path.join(zero, n, f"{f}.pt")
                torch.save(torch.load(p)["param"].reshape(-1).clone(), p)
            os.remove(os.path.join(zero, n, "step.pt"))
        for r in range(2):
            torch.save(ms, os.path.join(d, f"zero_pp_rank_{r}_mp_rank_00_model_states.pt"))
    torch.save(opt, os.path.join(zero, "optimizer_state.pt"))


@pytest.mark.parametrize("layout", ["zero12", "zero3"])
def test_deepspeeds_converter_layouts_resume_alike(tmp_path, layout):
    """The same checkpoint in either layout of DeepSpeed's converter resumes to the same state;
    the ZeRO-1/2 one's `module` holds the frozen bias whole, which `export` writes."""
    # ~0.6 s each.
    base = _model_with_buffer_and_frozen()
    root, states = _universal(tmp_path, 3, 2, base=base)
    _as_deepspeed_writes(root, layout)
    _assert_same(_load(root, 2, 2, _like_model(base)), states)
    if layout == "zero12":
        [out] = export(root, str(tmp_path / "out"), progress=False)
        got, want = load_file(out), _by_name(states, "params")
        assert sorted(got) == ["0.bias", "0.weight", "2.bias", "2.weight", "seen"]
        assert torch.equal(got["0.bias"], torch.full((6,), 7.0)) and all(torch.equal(got[n], want[n]) for n in want)
    [c] = info(root, verify=True)["checkpoints"]
    assert (c["stage"], c["world_size"], c["num_params"], c["deepspeed"]["universal"]) == (3, 2, 82, True)
    assert c["health"] == "ok (every tensor read and checked)"


def test_each_rank_opens_only_the_parameters_its_shard_overlaps(tmp_path, monkeypatch):
    """Resumed at ZeRO-3 on 4 simulated ranks, a rank opens the directories of exactly the
    parameters whose elements its shard holds, and copies 3 x its share (weights, two moments)."""
    # ~0.6 s.
    base = build_model()
    root, _ = _universal(tmp_path, 1, 1, base=base)
    opened, copied, read = {}, {}, _ds_universal_read.UniversalRead.read

    def recording(self):
        read(self)
        opened[threading.get_ident()] = sorted(os.path.basename(p) for p in self.opened)
        copied[threading.get_ident()] = self.elements

    monkeypatch.setattr(_ds_universal_read.UniversalRead, "read", recording)
    idents = {}

    def fn(comm):
        idents[comm.rank] = threading.get_ident()
        cfg = fnzero.load_config(_config(3, 4), world_size=4)
        sm = fnzero.shard(copy.deepcopy(base), config=cfg, comm=comm)
        return load(root, like=sm.init_state())[0]

    plan = simulated_world(4).run(fn)[0].sharding.plan
    skipped = 0
    for rank, ident in idents.items():
        want, share = set(), 0
        for u in plan.units:
            lo, hi = u.real_range(rank)
            for s in u.slots:
                n = min(hi, s.offset + s.numel) - max(lo, s.offset)
                if n > 0:
                    want.add(s.name)
                    share += n
        assert opened[ident] == sorted(want) and copied[ident] == 3 * share, rank
        skipped += len(want) < 4
    assert skipped > 0  # some rank left a parameter's files unopened


class _Evil:
    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.fixture(scope="module")
def universal(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("universal")
    return _universal(tmp, 1, 1, base=build_model())[0]


def _damage(d: str, case: str, marker: str) -> str:
    """Damage tag directory `d` as `case` says; the file or words the refusal must name."""
    zero = os.path.join(d, "zero")
    if case == "os.system":
        torch.save({"param": _Evil(marker), "cat_dim": 0}, os.path.join(zero, "2.weight", "fp32.pt"))
        return r"zero/2\.weight/fp32\.pt: refuses to load the global '(posix|os)\.system'"
    if case == "missing moment":
        os.remove(os.path.join(zero, "0.bias", "exp_avg.pt"))
        return r"zero/0\.bias/exp_avg\.pt: missing"
    if case == "shape":
        p = os.path.join(zero, "2.weight", "exp_avg_sq.pt")
        torch.save({"param": torch.zeros(6, 4), "cat_dim": 0}, p)
        return r"zero/2\.weight/exp_avg_sq\.pt: holds a tensor of shape \(6, 4\), the parameter's shape is \(4, 6\)"
    if case == "step":
        torch.save(torch.tensor(2.0), os.path.join(zero, "2.bias", "step.pt"))
        return r"zero/2\.bias/step\.pt: Adam's step 2, the checkpoint's is 3"
    if case == "link":
        shutil.move(os.path.join(zero, "0.weight"), os.path.join(d, "elsewhere"))
        os.symlink(os.path.join(d, "elsewhere"), os.path.join(zero, "0.weight"))
        return r"zero/0\.weight is a symbolic link"
    if case == "optimizer state":
        os.remove(os.path.join(zero, "optimizer_state.pt"))
        return r"zero/optimizer_state\.pt: missing"
    assert case == "name"
    for f in ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_model_states.pt"):
        ms = torch.load(os.path.join(d, f))
        ms["param_shapes"][0]["../escape"] = ms["param_shapes"][0].pop("2.bias")
        torch.save(ms, os.path.join(d, f))
    return r"parameter name '\.\./escape' cannot name a directory"


@pytest.mark.parametrize("case", ["os.system", "missing moment", "shape", "step", "link", "optimizer state", "name"])
def test_damaged_or_hostile_files_are_refused_naming_the_file(universal, tmp_path, case):
    """Each is one CheckpointError naming the file, from `load` (and `info(verify=True)` says
    BROKEN); the pickle that would run os.system runs nothing."""
    # ~0.2 s each.
    root = tmp_path / "ds"
    shutil.copytree(universal, root, symlinks=True)
    marker = str(tmp_path / "ran")
    words = _damage(str(root / TAG), case, marker)
    like = fnzero.shard(build_model(), config=fnzero.load_config(_config(2, 1))).init_state()
    with pytest.raises(CheckpointError, match=words):
        load(root, like=like)
    [c] = info(root, verify=True)["checkpoints"]
    assert c["health"].startswith("BROKEN")
    assert not os.path.exists(marker)


def test_info_export_and_the_commands_read_a_universal_checkpoint(tmp_path, capsys):
    """`info` says universal and where `latest_universal` points; `export` writes the trainable
    weights and buffers, and refuses the frozen parameters fnzero's universal checkpoint does not
    hold unless they are excluded; the commands do the same."""
    # ~0.5 s.
    root, states = _universal(tmp_path, 2, 2)
    rep = info(root)
    [c] = rep["checkpoints"]
    assert (rep["latest"], rep["latest_universal"], c["tag"], c["step"], c["master_dtype"]) == (None, TAG, TAG, 3, None)
    assert c["deepspeed"]["universal"] and c["num_params"] == 82 and c["health"] == "ok"
    with pytest.raises(CheckpointError, match=r"does not hold the frozen parameters \['0\.bias'\]"):
        export(root, str(tmp_path / "out"), progress=False)
    [out] = export(root, str(tmp_path / "out"), exclude_frozen=True, progress=False)
    got, want = load_file(out), _by_name(states, "params")
    assert sorted(got) == ["0.weight", "2.bias", "2.weight", "seen"] and all(torch.equal(got[n], want[n]) for n in want)
    assert main(["checkpoint", "info", str(root)]) == 0
    said = capsys.readouterr().out
    assert f"latest_universal: {TAG}" in said and "universal" in said.splitlines()[1] and "*" in said
    assert main(["export", str(root), str(tmp_path / "cli"), "--exclude-frozen", "-q"]) == 0
    assert main(["export", str(root), str(tmp_path / "cli2"), "-q"]) == 1
    assert "--exclude-frozen" in capsys.readouterr().err


def test_latest_or_latest_universal_as_the_config_says(tmp_path):
    """A save directory with both files: `latest`'s tag, or with `checkpoint.load_universal` (as
    DeepSpeed's engine reads it) the one `latest_universal` names."""
    # ~0.6 s.
    base = build_model()
    _saved(str(tmp_path / "fz"), base, 1, 1)
    to_deepspeed_universal(tmp_path / "fz", tmp_path / "ds", ds_tag="three")
    other_run = copy.deepcopy(base)
    with torch.no_grad():
        for p in other_run.parameters():
            p.mul_(2.0)
    _saved(str(tmp_path / "fz1"), other_run, 1, 1)  # another run: other values
    to_deepspeed_universal(tmp_path / "fz1", tmp_path / "ds", ds_tag="other")
    (tmp_path / "ds" / "latest").write_text("three")
    first = _load(tmp_path / "ds", 1, 1, base)[0]
    cfg = fnzero.load_config(_config(1, 1, checkpoint={"load_universal": True}))
    other = _load(tmp_path / "ds", 1, 1, base, config=cfg)[0]
    assert (tmp_path / "ds" / "latest_universal").read_text() == "other"
    want = load(tmp_path / "fz1", like=fnzero.shard(copy.deepcopy(base), config=cfg).init_state())[0]
    assert all(torch.equal(other.params[k], want.params[k]) for k in want.params)
    assert any(not torch.equal(other.params[k], first.params[k]) for k in want.params)


def _subparam_shape(monkeypatch, **attrs):
    """An object pickled as DeepSpeed's `SubparamShape` (importable under that name while saving)."""
    module = "deepspeed.checkpoint.universal_checkpoint"
    fake = types.ModuleType(module)
    cls = type("SubparamShape", (), {"__module__": module, "__qualname__": "SubparamShape"})
    fake.SubparamShape = cls
    parts = module.split(".")
    for i in range(1, len(parts)):
        monkeypatch.setitem(sys.modules, ".".join(parts[:i]), types.ModuleType(".".join(parts[:i])))
    monkeypatch.setitem(sys.modules, module, fake)
    obj = cls()
    obj.__dict__.update(attrs)
    return obj


def test_a_tensor_parallel_state_resumes_from_a_universal_checkpoint(tmp_path, monkeypatch):
    """A universal checkpoint holds whole tensors, so a tensor-parallel `like` reads each split
    parameter whole and keeps its slice, as fnzero's own tensor-parallel load does: a GPT trained at
    ZeRO-2 on 2 ranks, converted, loads at dp 2 x tp 2 (ZeRO-3) equal, consolidated over the mesh,
    to the saving state bit for bit; and the same files labelled as a tensor-parallel run's
    (tp_degree 2, `param_shapes` each rank's slices; the files' own shapes are the whole ones; a fused
    parameter's `sub_param_shape`, a pickled DeepSpeed SubparamShape) load into one rank alike."""
    # ~1.5 s.
    import _worlds as W

    from fnzero.checkpoint._tp import consolidated

    def train(comm):
        out = W.train_fnzero("gpt_tp", 2, 1, comm, dtype=torch.float32, return_state=True)
        fnzero.checkpoint.save(tmp_path / "fz", out["state"], config=W.config(2, micro=2, world=2))
        return out["state"]

    saved = simulated_world(2).run(train)
    d = to_deepspeed_universal(tmp_path / "fz", tmp_path / "ds")

    def resume(comm, world, tp, stage):
        cfg = W.config(stage, micro=2, world=world, extra={"tensor_parallel": {"autotp_size": tp}})
        sm = fnzero.shard(W.make_model("gpt_tp", torch.float32), config=cfg, comm=comm)
        state = load(tmp_path / "ds", like=sm.init_state())[0]
        return consolidated(state) if tp > 1 else state

    got = simulated_world(4).run(lambda comm: resume(comm, 4, 2, 3))
    _assert_same(got[::2], saved)  # (ranks 2r and 2r + 1: data-parallel rank r)
    ms = torch.load(os.path.join(d, "mp_rank_00_model_states.pt"))
    ms.update(mp_world_size=2, checkpoint_parallel_dimensions={"pp_degree": 1, "tp_degree": 2})
    ms["param_shapes"] = [{n: torch.Size([-(-s[0] // 2), *s[1:]]) for n, s in ms["param_shapes"][0].items()}]
    for f in ("mp_rank_00_model_states.pt", "mp_rank_01_model_states.pt", "zero_pp_rank_0_mp_rank_00_model_states.pt"):
        torch.save(ms, os.path.join(d, f))
    fused = next(n for n in ms["param_shapes"][0] if n.endswith("qkv.weight"))
    for f in FIELDS:  # as ds_to_universal writes a fused parameter of a tensor-parallel run
        p = os.path.join(d, "zero", fused, f"{f}.pt")
        shape = _subparam_shape(monkeypatch, patterns=[r".*qkv\.weight$"], shape=(3, -1), partition_dim=0)
        torch.save({**torch.load(p), "sub_param_shape": shape, "param_n_sub_params": 3}, p)
    _assert_same(simulated_world(1).run(lambda comm: resume(comm, 1, 1, 1)), saved)
