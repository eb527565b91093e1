"""Checkpoint directories that are not shared by every rank (specs/checkpoint-format.md
§Directories that are not shared): a save finds out at once and refuses, naming the ranks that
see each other's files, with the previous checkpoint intact; a node-local save
(`checkpoint.use_node_local_storage`) commits a whole checkpoint per node, which loads back at the
saving layout and says what it needs to load another. Nodes are simulated by giving the ranks of
each "node" their own directory under the same call."""

from __future__ import annotations

import glob
import os
import shutil
import time

import pytest
from _ckpt_helpers import run_steps, setup

import fnzero
import fnzero.testing as ft
from fnzero import CheckpointError
from fnzero.checkpoint import load, save
from fnzero.testing._threads import simulated_world

KIND = "mlp:5,7,3"


def _node_dir(tmp_path, rank: int, ranks_per_node: int = 2) -> str:
    return str(tmp_path / f"node{rank // ranks_per_node}" / "ck")


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_a_node_local_save_loads_back_on_each_node(tmp_path, stage):
    def fn(comm):
        _, _, state, step = setup(KIND, stage, comm)
        state, _ = run_steps(KIND, step, state, comm, 0, 1)
        d = _node_dir(tmp_path, comm.rank)
        save(d, state, tag="t", node_local=True)
        back, _ = load(d, state)
        ft.assert_trees_equal(back, state)  # bit for bit, each rank from its own node's files
        return sorted(os.listdir(os.path.join(d, "t")))

    files = simulated_world(4).run(fn)
    # Each node's directory holds its own ranks' data and a complete index, nothing of the other's.
    assert files[0] == ["index.msgpack", "rank00000.bin", "rank00000.msgpack", "rank00001.bin", "rank00001.msgpack"]
    assert files[2] == ["index.msgpack", "rank00002.bin", "rank00002.msgpack", "rank00003.bin", "rank00003.msgpack"]


def test_a_directory_not_shared_by_every_rank_is_refused_at_once(tmp_path):
    def fn(comm):
        _, _, state, _ = setup(KIND, 2, comm)
        d = _node_dir(tmp_path, comm.rank)
        save(d, state, tag="before", node_local=True)
        t0 = time.monotonic()
        with pytest.raises(CheckpointError) as e:
            save(d, state, tag="after")
        took = time.monotonic() - t0
        back, _ = load(d, state)  # the previous checkpoint is intact
        ft.assert_trees_equal(back, state)
        return str(e.value), took, sorted(os.listdir(d))

    for message, took, names in simulated_world(4).run(fn):
        assert "is not shared by every rank: ranks [0, 1] see each other's files; ranks [2, 3] see" in message
        assert "use_node_local_storage" in message and "previous checkpoint is intact" in message
        assert took < 5 and names == ["before", "latest"]  # no `after`, no staging left behind


def test_another_layout_names_the_files_it_needs_and_loads_once_they_are_copied(tmp_path):
    def fn(comm):
        _, _, state, step = setup(KIND, 3, comm)
        state, _ = run_steps(KIND, step, state, comm, 0, 1)
        save(_node_dir(tmp_path, comm.rank), state, tag="t", node_local=True)
        return state

    states = simulated_world(4).run(fn)
    _, _, like, _ = setup(KIND, 0, fnzero.LocalCollectives())
    node0 = _node_dir(tmp_path, 0)
    rep = fnzero.checkpoint.info(node0, verify=True)  # healthy, as far as this node can tell
    assert rep["checkpoints"][0]["health"] == "ok (node-local: this node's files verified)", rep
    with pytest.raises(CheckpointError, match=r"rank00002.bin of rank 2 is not here: .*saved node-locally.*"
                                              r"ranks \[2, 3\].*copy every node's t/rank\*.bin"):
        load(node0, like)
    for f in glob.glob(os.path.join(_node_dir(tmp_path, 2), "t", "rank*.bin")):
        shutil.copy(f, os.path.join(node0, "t"))
    back, _ = load(node0, like)  # one process, stage 0: every rank's shards, from one directory
    want = fnzero.testing.consolidate(states)
    ft.assert_trees_equal(fnzero.testing.consolidate([back]), want)


def test_a_node_local_save_is_blocking(tmp_path):
    _, _, state, _ = setup(KIND, 0, fnzero.LocalCollectives())
    with pytest.raises(CheckpointError, match="node-local save .* is blocking"):
        save(str(tmp_path / "ck"), state, node_local=True, blocking=False)


def test_the_config_turns_node_local_saving_on(tmp_path):
    cfg = fnzero.load_config({"train_batch_size": 2, "checkpoint": {"use_node_local_storage": True}})

    def fn(comm):
        _, _, state, _ = setup(KIND, 1, comm)
        save(_node_dir(tmp_path, comm.rank, 1), state, tag="t", config=cfg)

    simulated_world(2).run(fn)
    assert all(os.path.exists(_node_dir(tmp_path, r, 1) + "/t/index.msgpack") for r in range(2))
