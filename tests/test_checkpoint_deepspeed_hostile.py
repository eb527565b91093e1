"""DeepSpeed-shaped checkpoint directories built here without DeepSpeed (specs/checkpoint-format.md
§DeepSpeed): a well-formed ZeRO-2 layout exports exactly the weights it was cut from, and hostile
or inconsistent files (a pickle that would run `os.system`, a global outside the allowlist, a
truncated file, a missing rank, `param_shapes` that disagree with the partitions, layouts not read
yet) are each one CheckpointError naming the file, with nothing from the file run."""

from __future__ import annotations

import fractions
import math
import os
from collections import OrderedDict

import pytest
import torch
from safetensors.torch import load_file

from fnzero import CheckpointError
from fnzero.checkpoint import export, info

SHAPES = {"a.weight": (3, 5), "a.bias": (3,), "b.weight": (2, 4)}  # 26 elements: padded to 28 at W=2
TAG = "global_step5"


def _model_states(shapes=SHAPES, world=2, **extra) -> dict:
    module = OrderedDict((n, torch.zeros(s, dtype=torch.bfloat16)) for n, s in shapes.items())
    module["buf"] = torch.arange(3.0)
    return {"module": module, "buffer_names": ["buf"], "optimizer": None,
            "param_shapes": [OrderedDict((n, torch.Size(s)) for n, s in shapes.items())],
            "frozen_param_shapes": None, "shared_params": {}, "lr_scheduler": {"last_batch_iteration": 4},
            "skipped_steps": 0, "global_steps": 5, "global_samples": 10, "dp_world_size": world,
            "mp_world_size": 1, "ds_config": {"zero_optimization": {"stage": 2}, "bf16": {"enabled": True}},
            "ds_version": "0.19.8", **extra}


def _zero2(root: str, world: int = 2) -> dict[str, torch.Tensor]:
    """A ZeRO-2 bf16 checkpoint laid out as DeepSpeed lays it out; the fp32 weights it holds."""
    g = torch.Generator().manual_seed(1)
    full = {n: torch.randn(s, generator=g) for n, s in SHAPES.items()}
    flat = torch.cat([t.reshape(-1) for t in full.values()])
    total = flat.numel()
    padded_len = math.ceil(total / (2 * world)) * 2 * world  # alignment 2 x world (stage_1_and_2.py)
    part = padded_len // world
    padded = torch.cat([flat, torch.zeros(padded_len - total)])
    d = os.path.join(root, TAG)
    os.makedirs(d)
    for r in range(world):
        pad = max(0, min(part, (r + 1) * part - total))
        osd = {"zero_stage": 2, "single_partition_of_fp32_groups": [padded[r * part: (r + 1) * part - pad].clone()],
               "group_paddings": [pad], "partition_count": [world], "param_alignment_paddings": [[0] * len(SHAPES)]}
        torch.save({"optimizer_state_dict": osd, "ds_version": "0.19.8"},
                   os.path.join(d, f"bf16_zero_pp_rank_{r}_mp_rank_00_optim_states.pt"))
    torch.save(_model_states(world=world), os.path.join(d, "mp_rank_00_model_states.pt"))
    with open(os.path.join(root, "latest"), "w") as f:
        f.write(TAG)
    return {**full, "buf": torch.arange(3.0)}


@pytest.fixture()
def ds(tmp_path):
    root = str(tmp_path / "ds")
    return root, _zero2(root)


def test_a_zero2_layout_exports_the_weights_it_was_cut_from(ds, tmp_path):
    root, full = ds
    [out] = export(root, str(tmp_path / "out"), progress=False)
    got = load_file(out)
    assert set(got) == set(full) and all(torch.equal(got[n], full[n]) for n in full)
    rep = info(root)
    [c] = rep["checkpoints"]
    assert (rep["format"], c["tag"], c["stage"], c["world_size"], c["step"], c["param_dtype"], c["health"]) == (
        "deepspeed", TAG, 2, 2, 5, "bfloat16", "ok")
    assert c["num_params"] == 26 and c["deepspeed"]["lr_scheduler"] == {"last_batch_iteration": 4}


def _rewrite(path: str, obj) -> None:
    os.remove(path)
    torch.save(obj, path)


class _Evil:
    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_pickle_that_would_call_os_system_is_refused_and_not_run(ds, tmp_path):
    root, _ = ds
    marker = str(tmp_path / "ran")
    victim = os.path.join(root, TAG, "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt")
    _rewrite(victim, {"optimizer_state_dict": {"zero_stage": 2, "x": _Evil(marker)}})
    with pytest.raises(CheckpointError, match=r"bf16_zero_pp_rank_1_mp_rank_00_optim_states\.pt: refuses to load "
                                              r"the global '(posix|os)\.system'"):
        export(root, str(tmp_path / "out"), progress=False)
    assert not os.path.exists(marker)
    [c] = info(root, verify=True)["checkpoints"]
    assert c["health"].startswith("BROKEN") and "system" in c["health"] and not os.path.exists(marker)


def test_a_global_outside_the_allowlist_is_named(ds, tmp_path):
    root, _ = ds
    victim = os.path.join(root, TAG, "mp_rank_00_model_states.pt")
    _rewrite(victim, _model_states(lr_scheduler=fractions.Fraction(1, 3)))
    with pytest.raises(CheckpointError, match=r"mp_rank_00_model_states\.pt: refuses to load the global "
                                              r"'fractions\.Fraction'"):
        export(root, str(tmp_path / "out"), progress=False)


@pytest.mark.parametrize("keep", [0.5, 0.0])
def test_a_truncated_file_is_named(ds, tmp_path, keep):
    root, _ = ds
    victim = os.path.join(root, TAG, "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt")
    size = os.path.getsize(victim)
    with open(victim, "r+b") as f:
        f.truncate(int(size * keep))
    with pytest.raises(CheckpointError, match=r"bf16_zero_pp_rank_0_mp_rank_00_optim_states\.pt: .*(truncated|damaged)"):
        export(root, str(tmp_path / "out"), progress=False)


def test_param_shapes_that_disagree_with_the_partitions_are_named(ds, tmp_path):
    root, _ = ds
    bigger = {**SHAPES, "b.weight": (2, 5)}
    _rewrite(os.path.join(root, TAG, "mp_rank_00_model_states.pt"), _model_states(shapes=bigger))
    with pytest.raises(CheckpointError, match=r"param_shapes disagree with the partition sizes"):
        export(root, str(tmp_path / "out"), progress=False)
    [c] = info(root, verify=True)["checkpoints"]
    assert "param_shapes disagree" in c["health"]


def test_a_missing_rank_file_is_named(ds, tmp_path):
    root, _ = ds
    os.remove(os.path.join(root, TAG, "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"))
    with pytest.raises(CheckpointError, match=r"optimizer-states file of data-parallel rank 1, model-parallel rank 0 "
                                              r"is missing"):
        export(root, str(tmp_path / "out"), progress=False)


def test_layouts_not_read_yet_are_refused_by_name(ds, tmp_path):
    root, _ = ds
    d = os.path.join(root, TAG)
    expert = os.path.join(d, "layer_0_expert_0_mp_rank_00_model_states.pt")
    torch.save({"a": torch.zeros(1)}, expert)
    with pytest.raises(CheckpointError, match=r"layer_0_expert_0_mp_rank_00_model_states\.pt: 'a' is not a "
                                              r"DeepSpeed expert's parameter"):
        export(root, str(tmp_path / "out"), progress=False)
    for r in range(2):  # the same files as a ZeRO-3 layout: MoE there is not read yet
        torch.save(_model_states(), os.path.join(d, f"zero_pp_rank_{r}_mp_rank_00_model_states.pt"))
    os.remove(os.path.join(d, "mp_rank_00_model_states.pt"))
    with pytest.raises(CheckpointError, match=r"MoE checkpoint .*layer_0_expert_0_mp_rank_00_model_states\.pt"):
        export(root, str(tmp_path / "out"), progress=False)
    os.remove(expert)
    for r in range(2):
        os.remove(os.path.join(d, f"zero_pp_rank_{r}_mp_rank_00_model_states.pt"))
    tp = _model_states(mp_world_size=2, checkpoint_parallel_dimensions={"pp_degree": 1, "tp_degree": 2})
    torch.save(tp, os.path.join(d, "mp_rank_00_model_states.pt"))
    torch.save(tp, os.path.join(d, "mp_rank_01_model_states.pt"))
    for r in range(2):
        torch.save({}, os.path.join(d, f"bf16_zero_pp_rank_{r}_mp_rank_01_optim_states.pt"))
    with pytest.raises(CheckpointError, match=r"tensor-parallel DeepSpeed checkpoint \(tp degree 2\)"):
        export(root, str(tmp_path / "out"), progress=False)
    os.mkdir(os.path.join(d, "zero"))  # a universal checkpoint (read: tests/test_checkpoint_ds_universal_read.py)
    with pytest.raises(CheckpointError, match=r"global_step5/zero/optimizer_state\.pt: missing"):
        export(root, str(tmp_path / "out"), progress=False)


def test_exclude_frozen_is_refused_where_the_files_do_not_say_what_was_frozen(tmp_path):
    d = tmp_path / "ds" / TAG
    d.mkdir(parents=True)
    state = _model_states()
    state.update(module=OrderedDict(w=torch.ones(2)), param_shapes=None, shared_params=None, buffer_names=[],
                 optimizer={"state": {}, "param_groups": []})
    torch.save(state, str(d / "mp_rank_00_model_states.pt"))
    [out] = export(str(d), str(tmp_path / "out"), progress=False)
    assert torch.equal(load_file(out)["w"], torch.ones(2))
    with pytest.raises(CheckpointError, match=r"does not record which parameters were frozen"):
        export(str(d), str(tmp_path / "out2"), exclude_frozen=True, progress=False)


MODEL_FIELDS = [("param_shapes", "x"), ("param_shapes", [{"a.weight": "abc"}]), ("param_shapes", [{"a.weight": [-3]}]),
                ("module", None), ("module", {"a.weight": 3}), ("buffer_names", 5), ("shared_params", {"x": 5}),
                ("shared_params", {"a.bias": "nope"}), ("dp_world_size", "2"), ("dp_world_size", 0),
                ("dp_world_size", 3), ("mp_world_size", None), ("checkpoint_parallel_dimensions", "x"),
                ("checkpoint_parallel_dimensions", {"tp_degree": "a"}), ("frozen_param_shapes", 5),
                ("ds_config", [1])]
OPTIM_FIELDS = [("group_paddings", ["x"]), ("group_paddings", [-5]), ("single_partition_of_fp32_groups", [None]),
                ("single_partition_of_fp32_groups", [torch.zeros(2, 2)]), ("param_alignment_paddings", "abc"),
                ("param_alignment_paddings", [[1, 1, 1]]), ("partition_count", [0]), ("partition_count", "x"),
                ("zero_stage", "two")]


@pytest.mark.parametrize("field,value", MODEL_FIELDS + OPTIM_FIELDS, ids=lambda v: str(v)[:20])
def test_fields_of_the_wrong_type_or_range_are_one_error(ds, tmp_path, field, value):
    root, _ = ds
    d = os.path.join(root, TAG)
    if (field, value) in MODEL_FIELDS:
        _rewrite(os.path.join(d, "mp_rank_00_model_states.pt"), _model_states(**{field: value}))
    else:
        victim = os.path.join(d, "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt")
        sd = torch.load(victim, weights_only=True)
        sd["optimizer_state_dict"][field] = value
        _rewrite(victim, sd)
    try:
        export(root, str(tmp_path / "out"), progress=False)
    except CheckpointError as e:
        assert TAG in str(e)
    [c] = info(root, verify=True)["checkpoints"]
    assert c["health"] == "ok (every tensor read and checked)" or c["health"].startswith("BROKEN")


def test_a_rank_file_that_is_a_link_is_refused(ds, tmp_path):
    root, _ = ds
    victim = os.path.join(root, TAG, "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt")
    outside = str(tmp_path / "elsewhere.pt")
    os.replace(victim, outside)
    os.symlink(outside, victim)
    with pytest.raises(CheckpointError, match=r"bf16_zero_pp_rank_1_mp_rank_00_optim_states\.pt is a symbolic link"):
        export(root, str(tmp_path / "out"), progress=False)


def test_ranks_that_are_threads_read_deepspeed_classes_at_the_same_time(tmp_path, monkeypatch):
    """torch's allowlist is one set for the process: one thread's load putting it back must not
    take DeepSpeed's names away from another thread still reading (simulated worlds)."""
    import sys
    import threading
    import types

    from fnzero.checkpoint._ds_pickle import LossScalerState, load_ds_file

    fake = types.ModuleType("deepspeed.runtime.fp16.loss_scaler")

    class LossScaler:  # pickled by this name, as DeepSpeed's own is
        pass

    LossScaler.__module__, LossScaler.__qualname__, fake.LossScaler = fake.__name__, "LossScaler", LossScaler
    parts = fake.__name__.split(".")
    with monkeypatch.context() as m:  # importable by its name (and its parents') while it is saved
        for i in range(1, len(parts)):
            m.setitem(sys.modules, ".".join(parts[:i]), types.ModuleType(".".join(parts[:i])))
        m.setitem(sys.modules, fake.__name__, fake)
        scaler = LossScaler()
        scaler.cur_scale = 2.0**16
        torch.save({"loss_scaler": scaler, "t": torch.ones(2)}, tmp_path / "f.pt")
    errors, barrier = [], threading.Barrier(4)

    def read():
        barrier.wait()
        try:
            for _ in range(40):
                got = load_ds_file(str(tmp_path), "f.pt")["loss_scaler"]
                assert isinstance(got, LossScalerState) and got.cur_scale == 2.0**16
        except Exception as e:  # noqa: BLE001  (collected, asserted below on the main thread)
            errors.append(e)

    threads = [threading.Thread(target=read) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]
