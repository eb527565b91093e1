"""Damaged, hostile and mismatched checkpoints: each fails with one clear CheckpointError."""

from __future__ import annotations

import copy
import os
import re

import msgpack
import pytest
import torch
from torch import nn
from _ckpt_helpers import setup
from hypothesis import given, settings
from hypothesis import strategies as st

import fnzero
from fnzero import CheckpointError
from fnzero.checkpoint import _format as F
from fnzero.checkpoint import info, load, save
from fnzero.testing import seeded
from fnzero.testing._threads import simulated_world


def _saved(tmp_path, world=2, kind="mlp:5,7,3", stage=1):
    d = str(tmp_path / "ck")

    def fn(comm):
        _, _, state, _ = setup(kind, stage, comm)
        save(d, state, tag="t", client_state={"epoch": 1})
        return state

    simulated_world(world).run(fn)
    _, _, like, _ = setup(kind, 0, fnzero.LocalCollectives())
    return d, os.path.join(d, "t"), like


def _index(ck):
    with open(os.path.join(ck, F.INDEX_NAME), "rb") as f:
        return msgpack.unpackb(f.read(), raw=False)


def _write_index(ck, ix, raw=None):
    """An index edited field by field, sealed again (its metadata checksum recomputed, as a careful
    forger would), so each test reaches the check it is about; `raw` writes bytes as given."""
    with open(os.path.join(ck, F.INDEX_NAME), "wb") as f:
        f.write(raw if raw is not None else F.seal(ix))


def test_a_healthy_checkpoint_loads(tmp_path):
    d, _, like = _saved(tmp_path)
    state, cs = load(d, like=like)
    assert cs == {"epoch": 1}


def test_flipped_byte_in_data_is_caught_by_the_checksum(tmp_path):
    d, ck, like = _saved(tmp_path)
    p = os.path.join(ck, "rank00001.bin")
    with open(p, "r+b") as f:
        f.seek(0)
        b = f.read(1)
        f.seek(0)
        f.write(bytes([b[0] ^ 0x40]))
    with pytest.raises(CheckpointError, match="checksum mismatch.*rank00001.bin"):
        load(d, like=like)
    load(d, like=like, verify=False)  # the damage is only in values: without verification it loads
    rep = info(d, verify=True)
    assert rep["checkpoints"][0]["health"].startswith("BROKEN: ") and "checksum" in rep["checkpoints"][0]["health"]
    assert info(d)["checkpoints"][0]["health"] == "ok"  # sizes alone cannot see a flipped bit


def test_truncated_data_file(tmp_path):
    d, ck, like = _saved(tmp_path)
    p = os.path.join(ck, "rank00000.bin")
    os.truncate(p, os.path.getsize(p) - 1)
    with pytest.raises(CheckpointError, match="rank00000.bin is .* bytes, the index says .*truncated"):
        load(d, like=like)


def test_missing_rank_file(tmp_path):
    d, ck, like = _saved(tmp_path)
    os.remove(os.path.join(ck, "rank00001.bin"))
    with pytest.raises(CheckpointError, match="rank00001.bin of rank 1 is missing"):
        load(d, like=like)


def test_missing_index_and_missing_tag(tmp_path):
    d, ck, like = _saved(tmp_path)
    with pytest.raises(CheckpointError, match="checkpoint 'nope' not found.*tags here: \\['t'\\]"):
        load(d, like=like, tag="nope")
    os.remove(os.path.join(ck, F.INDEX_NAME))
    with pytest.raises(CheckpointError):
        load(d, like=like)
    with pytest.raises(CheckpointError, match="no checkpoint directory"):
        load(tmp_path / "absent", like=like)


def test_version_from_the_future(tmp_path):
    d, ck, like = _saved(tmp_path)
    ix = _index(ck)
    ix["version"] = F.VERSION + 1
    _write_index(ck, ix)
    with pytest.raises(CheckpointError, match=f"version {F.VERSION + 1} is newer than this fnzero understands"):
        load(d, like=like)


@pytest.mark.parametrize("kind,want", [  # saved: mlp:5,7,3
    ("mlp:5,8,3", "3 differ in shape: 'layers.0.weight' is [8, 5] in the model, [7, 5] in the checkpoint; "
                  "'layers.0.bias' is [8] in the model, [7] in the checkpoint; 'layers.1.weight' is [3, 8] in the "
                  "model, [3, 7] in the checkpoint$"),
    ("mlp:5,7,3,2", ": the model you are loading into has 2 tensor(s) the checkpoint does not: 'layers.2.weight', "
                    "'layers.2.bias'$"),
    ("mlp:5,7", ": the checkpoint has 2 the model does not: 'layers.1.weight', 'layers.1.bias'$"),
])
def test_checkpoint_of_another_model_names_what_differs_in_the_users_words(tmp_path, kind, want):
    d, _, _ = _saved(tmp_path)
    _, _, other, _ = setup(kind, 0, fnzero.LocalCollectives())
    with pytest.raises(CheckpointError, match="^the checkpoint is of another model: ") as e:
        load(d, like=other)
    msg, whole = str(e.value), want.endswith("$")
    assert (msg.endswith(want[:-1]) if whole else want in msg), msg
    assert "like=" not in msg


def test_a_model_named_otherwise_lists_a_few_names_of_each_side_with_counts(tmp_path):
    from fnzero.testing import GPT, gpt_layers

    with fnzero.testing.seeded(0):
        model = GPT(vocab_size=37, seq_len=8, d_model=12, n_layer=3, n_head=3)
    layers = nn.Sequential(*gpt_layers(model=copy.deepcopy(model)))  # the same weights, named '0.wte.weight', ...
    cfg = fnzero.load_config({"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW"}})
    d = str(tmp_path / "gpt")
    save(d, fnzero.shard(model, config=cfg).init_state())
    by_index = fnzero.shard(layers, config=cfg).init_state()
    with pytest.raises(CheckpointError) as e:
        load(d, like=by_index)
    msg = str(e.value)
    assert re.search(r"the model you are loading into has 41 tensor\(s\) the checkpoint does not: '0\.wte\.weight', "
                     r"'0\.wpe\.weight', '1\.ln1\.weight', '1\.ln1\.bias' and 37 more; the checkpoint has 41 the model "
                     r"does not: 'wte\.weight', 'wpe\.weight', 'blocks\.0\.ln1\.weight', 'blocks\.0\.ln1\.bias' and "
                     r"37 more \(the same model named otherwise\?", msg), msg


def test_another_optimizer_is_named(tmp_path):
    d, _, _ = _saved(tmp_path)
    _, _, sgd, _ = setup("mlp:5,7,3", 0, fnzero.LocalCollectives(), optimizer={"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}})
    with pytest.raises(CheckpointError, match="no 'opt_state/momentum_buffer/layers.0'.*AdamState.*SGDState"):
        load(d, like=sgd)


@pytest.mark.parametrize("raw", [b"", b"\xc1\xc1garbage", b"\x92\x01", msgpack.packb([1, 2, 3]), b"\xd4\x05\x00"])
def test_garbage_index(tmp_path, raw):
    d, ck, like = _saved(tmp_path)
    _write_index(ck, None, raw)
    with pytest.raises(CheckpointError):
        load(d, like=like)


def _mutations():
    def seg(ix, f):
        t = ix["tensors"]["params/layers.0"]
        f(t["segments"][0])

    return {
        "world_size as str": lambda ix: ix.__setitem__("world_size", "2"),
        "tensors as list": lambda ix: ix.__setitem__("tensors", []),
        "huge unit numel": lambda ix: ix["units"][0].__setitem__("numel", 1 << 60),
        "huge shape": lambda ix: ix["units"][0]["slots"][0].__setitem__("shape", [1 << 40, 1 << 40]),
        "offset past EOF": lambda ix: seg(ix, lambda s: s.__setitem__(1, 1 << 40)),
        "negative offset": lambda ix: seg(ix, lambda s: s.__setitem__(1, -4096)),
        "misaligned offset": lambda ix: seg(ix, lambda s: s.__setitem__(1, s[1] + 1)),
        "range past numel": lambda ix: seg(ix, lambda s: s.__setitem__(3, 1 << 50)),
        "gap in coverage": lambda ix: ix["tensors"]["params/layers.0"]["segments"].pop(0),
        "rank outside world": lambda ix: seg(ix, lambda s: s.__setitem__(0, 99)),
        "float in segment": lambda ix: seg(ix, lambda s: s.__setitem__(2, 0.5)),
        "unknown dtype": lambda ix: ix["tensors"]["params/layers.0"].__setitem__("dtype", "object"),
        "dtype as dunder": lambda ix: ix["tensors"]["params/layers.0"].__setitem__("dtype", "__class__"),
        "files too short": lambda ix: ix.__setitem__("files", [1]),
        "rng not bytes": lambda ix: ix["rng"][0].__setitem__("cpu", "x"),
        "bad rng bytes": lambda ix: ix["rng"][0].__setitem__("cpu", b"\x00" * 3),
        "wrong format": lambda ix: ix.__setitem__("format", "pickle"),
        "index is a list": None,
    }


@pytest.mark.parametrize("name", sorted(_mutations()))
def test_crafted_index_fails_cleanly(tmp_path, name):
    d, ck, like = _saved(tmp_path)
    ix = _index(ck)
    f = _mutations()[name]
    if f is None:
        ix = [ix]
    else:
        f(ix)
    _write_index(ck, ix)
    with pytest.raises(CheckpointError):
        load(d, like=like)


@settings(max_examples=60)
@given(data=st.data())
def test_random_index_corruption_never_escapes_as_another_error(tmp_path_factory, data):
    tmp = tmp_path_factory.mktemp("fuzz")
    d, ck, like = _saved(tmp, world=1)
    with open(os.path.join(ck, F.INDEX_NAME), "rb") as f:
        raw = bytearray(f.read())
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, len(raw) - 1))
        raw[i] = data.draw(st.integers(0, 255))
    if data.draw(st.booleans()):
        raw = raw[: data.draw(st.integers(0, len(raw)))]
    _write_index(ck, None, bytes(raw))
    try:
        load(d, like=like)
    except CheckpointError:
        pass


@pytest.mark.parametrize("tag", ["../evil", "/etc", "..", ".hidden", "a/b", "", "x" * 300, "a\x00b"])
def test_path_traversal_in_tags_is_refused(tmp_path, tag):
    d, _, like = _saved(tmp_path)
    with pytest.raises(CheckpointError, match="not a valid checkpoint tag"):
        load(d, like=like, tag=tag)
    with open(os.path.join(d, "latest"), "w") as f:
        f.write(tag)
    with pytest.raises(CheckpointError, match="not a valid checkpoint tag|does not hold a checkpoint tag") as e:
        load(d, like=like)
    assert tag.strip() == "" or tag not in str(e.value).replace(d, "")  # the file's contents are not quoted
    with pytest.raises(CheckpointError, match="not a valid checkpoint tag"):
        save(d, like, tag=tag)


def test_client_state_must_be_plain_data(tmp_path):
    _, _, like, _ = setup("mlp:3,2", 0, fnzero.LocalCollectives())
    with pytest.raises(CheckpointError, match=r"client_state\['sched'\]\[1\]: a torch.Tensor cannot be stored"):
        save(tmp_path, like, client_state={"ok": 1, "sched": [2, torch.ones(1)]})
    with pytest.raises(CheckpointError, match=r"client_state: key 3 is a int"):
        save(tmp_path, like, client_state={3: "x"})
    with pytest.raises(CheckpointError, match="a builtins.object cannot be stored"):
        save(tmp_path, like, client_state=object())
    assert not os.path.exists(tmp_path / "latest")  # nothing was written


def test_broken_latest_is_reported_by_info_and_cli(tmp_path, capsys):
    from fnzero.cli._main import main

    d, ck, like = _saved(tmp_path)
    assert main(["checkpoint", "info", d]) == 0
    os.remove(os.path.join(ck, "rank00001.bin"))
    assert main(["checkpoint", "info", d]) == 1
    out = capsys.readouterr().out
    assert "BROKEN" in out and "rank00001.bin" in out
    assert main(["export", d, str(tmp_path / "o")]) == 1
    assert "rank00001.bin of rank 1 is missing" in capsys.readouterr().err


def test_info_on_an_older_committed_step_is_healthy(tmp_path, capsys):
    # `latest` names the newest step; an older one beside it is a healthy checkpoint, not BROKEN.
    from fnzero.cli._main import main

    d = str(tmp_path / "ck")
    _, _, state, _ = setup("mlp:3,2", 0, fnzero.LocalCollectives())
    save(d, state, tag="step_200")
    save(d, state, tag="step_400")
    assert main(["checkpoint", "info", os.path.join(d, "step_200")]) == 0
    out = capsys.readouterr().out
    assert "step_200: step 0" in out and "BROKEN" not in out and "(latest: step_400)" in out
    with open(os.path.join(d, "latest"), "w") as f:
        f.write("step_999")  # a `latest` naming nothing is still reported, from any entry point
    assert main(["checkpoint", "info", os.path.join(d, "step_200")]) == 1
    assert "'latest' names 'step_999'" in capsys.readouterr().out


def test_checksum_thread_works_in_a_forked_child(tmp_path):
    # The checksum helper thread is per process: a child forked after a save must not wait on the
    # parent's (gone) thread.
    import os
    import time

    import torch

    from fnzero.checkpoint._io import AlignedWriter, read_into

    big = torch.arange(10 << 20, dtype=torch.float32)  # 40 MiB: checksummed on the thread both ways
    w = AlignedWriter(str(tmp_path / "a.bin"))
    off, crc = w.write(big)
    w.close()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child's exit code is the assertion
        ok = False
        try:
            fd = os.open(str(tmp_path / "a.bin"), os.O_RDONLY)
            out = torch.empty_like(big)
            ok = read_into(fd, off, out, "child", checksum=True) == crc and torch.equal(out, big)
        finally:
            os._exit(0 if ok else 1)
    deadline = time.monotonic() + 60
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            raise AssertionError("the forked child hung on the checksum thread")
        time.sleep(0.05)
    assert os.waitstatus_to_exitcode(status) == 0


def test_a_merged_index_that_would_not_validate_fails_on_every_rank_without_waiting(tmp_path, monkeypatch):
    """If the committing rank's merge made an index no loader would accept, the commit fails before
    anything is renamed into place, and every other rank hears it from the failure marker at once
    (it used to read the committed index as "not committed yet" until the save timeout)."""
    from fnzero.checkpoint import _commit

    real = _commit.commit

    def broken(root, tag, staging, index, nonce, update_latest):
        return real(root, tag, staging, {**index, "world_size": -1}, nonce, update_latest)

    monkeypatch.setattr(_commit, "commit", broken)
    monkeypatch.setattr("fnzero.checkpoint._protocol.commit", broken)

    def rank(comm):
        with seeded(0):
            model = nn.Linear(4, 4)
        sm = fnzero.shard(model, stage=1, comm=comm,
                          config=fnzero.load_config({"train_batch_size": 2, "optimizer": {"type": "SGD"}},
                                                    world_size=2))
        with pytest.raises(CheckpointError) as e:
            save(tmp_path, sm.init_state(), tag="t", timeout=60)
        return str(e.value)

    messages = simulated_world(2).run(rank)
    assert "world_size" in messages[0] and "rank 0 failed to commit" in messages[1]
    assert not (tmp_path / "t").exists()
