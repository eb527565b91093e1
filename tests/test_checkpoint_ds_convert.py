"""`fnzero checkpoint convert --to fnzero` and `fnzero.deepspeed_to_fnzero` (specs/checkpoint-format.md
§DeepSpeed, "Converting to fnzero"): a DeepSpeed checkpoint, built here without DeepSpeed, rewritten
as fnzero's without the model, loads into a state of another world size and stage exactly as the
DeepSpeed files themselves load; a DeepSpeed checkpoint converts to a universal one; what cannot be
converted is refused, named. (Against DeepSpeed's own files: tests/test_checkpoint_deepspeed.py.)"""

from __future__ import annotations

import os

import optree
import pytest
import torch
from test_checkpoint_ds_resume import SHAPES, Net, _zero2

import fnzero
from fnzero import CheckpointError
from fnzero.checkpoint import info, load
from fnzero.cli._main import main
from fnzero.testing._threads import simulated_world

DS_CONFIG = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 2},
             "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}


def _cfg(world: int, stage: int) -> fnzero.Config:
    return fnzero.load_config({**DS_CONFIG, "zero_optimization": {"stage": stage}}, world_size=world)


@pytest.fixture
def ds_dir(tmp_path):
    root = str(tmp_path / "ds")
    return root, _zero2(root, ds_config=DS_CONFIG)


def _leaves_equal(a, b) -> None:
    la, lb = optree.tree_leaves(a, none_is_leaf=True), optree.tree_leaves(b, none_is_leaf=True)
    assert len(la) == len(lb)
    for x, y in zip(la, lb):
        assert torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y


def test_a_converted_checkpoint_loads_as_the_deepspeed_one_does(ds_dir, tmp_path):
    """The fnzero checkpoint, written at world 1 from a world-2 ZeRO-2 run, loads into ZeRO-3 on
    2 ranks bit for bit as the DeepSpeed files do: weights, Adam's moments, step, client state."""
    root, _ = ds_dir
    out = fnzero.deepspeed_to_fnzero(root, str(tmp_path / "fz"))
    assert out == str(tmp_path / "fz" / "global_step5")
    entry = info(str(tmp_path / "fz"))["checkpoints"][0]
    assert (entry["step"], entry["world_size"], entry["optimizer"], entry["num_params"]) == (5, 1, "AdamState", 26)

    def rank():
        like = fnzero.shard(Net(), config=_cfg(2, 3)).init_state()
        return load(out, like=like), load(root, like=like)

    for (conv, conv_client), (ds, ds_client) in simulated_world(2).run(rank):
        _leaves_equal(conv, ds)
        assert conv_client == ds_client == {"epoch": 3}
        assert int(conv.step) == 5


def test_the_command_converts_to_fnzero_and_to_universal(ds_dir, tmp_path, capsys):
    """`--to fnzero` writes fnzero's checkpoint; `--to deepspeed-universal` of DeepSpeed's own files
    writes the universal layout (what DeepSpeed's ds_to_universal writes), whole tensors per
    parameter, with no temporary left behind; converting fnzero's own to fnzero is refused."""
    root, full = ds_dir
    fz, uni = str(tmp_path / "fz"), str(tmp_path / "uni")
    assert main(["checkpoint", "convert", root, fz, "--to", "fnzero", "--out-tag", "moved"]) == 0
    assert capsys.readouterr().out.strip() == os.path.join(fz, "moved")
    assert main(["checkpoint", "convert", root, uni, "--to", "deepspeed-universal"]) == 0
    assert sorted(os.listdir(uni)) == ["global_step5", "latest_universal"]
    for name in SHAPES:
        for field, key in (("fp32", "fp32"), ("exp_avg", "exp_avg"), ("exp_avg_sq", "exp_avg_sq")):
            saved = torch.load(os.path.join(uni, "global_step5", "zero", name, f"{key}.pt"), weights_only=True)
            assert torch.equal(saved["param"], full[field][name]), (name, field)
    assert main(["checkpoint", "convert", fz, str(tmp_path / "again"), "--to", "fnzero"]) == 1
    assert "is not a DeepSpeed checkpoint" in capsys.readouterr().err
    # And the universal checkpoint back to fnzero's: the same state as from DeepSpeed's own files.
    back = fnzero.deepspeed_to_fnzero(uni, str(tmp_path / "back"))
    like = fnzero.shard(Net(), config=_cfg(1, 2)).init_state()
    _leaves_equal(load(back, like=like)[0], load(root, like=like)[0])


def test_what_cannot_be_converted_is_refused_by_name(tmp_path):
    """A checkpoint without a config, or of an optimizer other than Adam, is one CheckpointError
    naming the directory; nothing is written."""
    bare = str(tmp_path / "bare")
    _zero2(bare, ds_config=None)
    with pytest.raises(CheckpointError, match="records no config"):
        fnzero.deepspeed_to_fnzero(bare, str(tmp_path / "out"))
    lion = str(tmp_path / "lion")
    _zero2(lion, ds_config={**DS_CONFIG, "optimizer": {"type": "Lion"}})
    with pytest.raises(CheckpointError, match="its optimizer is Lion"):
        fnzero.deepspeed_to_fnzero(lion, str(tmp_path / "out"))
    assert not os.path.exists(tmp_path / "out")


def test_a_buffer_registered_non_persistent_keeps_the_models_value(ds_dir, tmp_path):
    """DeepSpeed writes no persistent=False buffer (a Llama's rotary inv_freq), so the converted
    checkpoint holds none; loading it into the model keeps the model's own, as DeepSpeed's resume does."""
    root, _ = ds_dir

    class WithRotary(Net):
        def __init__(self):
            super().__init__()
            self.register_buffer("inv_freq", torch.arange(4.0) + 0.5, persistent=False)

    out = fnzero.deepspeed_to_fnzero(root, str(tmp_path / "fz"))
    state, _ = load(out, like=fnzero.shard(WithRotary(), config=_cfg(1, 3)).init_state())
    assert torch.equal(state.buffers["inv_freq"], torch.arange(4.0) + 0.5) and int(state.step) == 5
