"""Checkpoint directories that are not what they claim (specs/checkpoint-format.md §Reading a
directory nobody vouches for): links in every position, FIFOs, sockets, devices, directories where
files belong, huge files, forged metadata. Each is one CheckpointError within a second, no file
outside the checkpoint directory is opened (a link to a FIFO outside would block forever if it
were), and no message quotes what a file holds."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import time

import msgpack
import pytest
from _ckpt_helpers import setup

import fnzero
from fnzero import CheckpointError
from fnzero.checkpoint import _format as F
from fnzero.checkpoint import info, load, save

SECRET = b"SECRET-CONTENT-root:x:0:0"


@pytest.fixture()
def saved(tmp_path):
    """(checkpoint root, the tag's directory, like, a directory outside holding a secret file and a FIFO)."""
    _, _, state, _ = setup("mlp:5,7,3", 0, fnzero.LocalCollectives())
    root = str(tmp_path / "ck")
    save(root, state, tag="t")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret").write_bytes(SECRET)
    os.mkfifo(outside / "fifo")
    return root, os.path.join(root, "t"), state, str(outside)


@contextlib.contextmanager
def _within(seconds: float):
    """Fail (instead of hanging) if the block takes longer: SIGALRM interrupts a blocking open."""
    def timeout(*_):
        raise TimeoutError(f"took more than {seconds}s: something blocked or read far too much")

    old = signal.signal(signal.SIGALRM, timeout)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    t0 = time.perf_counter()
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    assert time.perf_counter() - t0 < 1.0


def _refused(root, like, match=None):
    with _within(3.0), pytest.raises(CheckpointError, match=match) as e:
        load(root, like)
    assert b"SECRET" not in str(e.value).encode()
    # `fnzero checkpoint info` reports it too, without hanging or quoting.
    with _within(3.0):
        rep = info(root)
    assert b"SECRET" not in repr(rep).encode()
    return str(e.value)


def _replace(path, make):
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    elif os.path.lexists(path):
        os.remove(path)
    make(path)


def _unix_socket(path):
    s = socket.socket(socket.AF_UNIX)
    s.bind(path)
    s.close()


def _char_device(path):
    try:
        os.mknod(path, 0o600 | 0o020000, os.makedev(1, 5))  # /dev/zero's numbers
    except PermissionError:
        pytest.skip("creating a device node needs privileges this machine lacks")


KINDS = {
    "link to a secret outside": lambda outside: lambda p: os.symlink(os.path.join(outside, "secret"), p),
    "link to a FIFO outside": lambda outside: lambda p: os.symlink(os.path.join(outside, "fifo"), p),
    "link to /dev/zero": lambda outside: lambda p: os.symlink("/dev/zero", p),
    "link to /dev/urandom": lambda outside: lambda p: os.symlink("/dev/urandom", p),
    "FIFO": lambda outside: os.mkfifo,
    "socket": lambda outside: _unix_socket,
    "character device": lambda outside: _char_device,
    "directory": lambda outside: os.mkdir,
}


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("position", ["latest", "index.msgpack", "rank00000.bin"])
def test_a_file_that_is_not_a_regular_file_is_refused(saved, kind, position):
    root, ck, like, outside = saved
    where = os.path.join(root if position == "latest" else ck, position)
    if position == "rank00000.bin" and kind.startswith("link to a secret"):
        shutil.copy(where, os.path.join(outside, "secret"))  # the right bytes, through a link: still refused
    _replace(where, KINDS[kind](outside))
    message = _refused(root, like)
    assert position in message and ("link" in message or "not a regular file" in message or "is a" in message)


@pytest.mark.parametrize("position", ["tag directory", "old fallback", "root index"])
def test_a_linked_directory_is_refused(saved, position):
    root, ck, like, outside = saved
    moved = os.path.join(outside, "t")
    shutil.move(ck, moved)
    if position == "tag directory":
        os.symlink(moved, ck)
    elif position == "old fallback":  # a save that died mid-replace leaves `.t.<nonce>.old`
        os.symlink(moved, os.path.join(root, ".t.0000000000000001.old"))
    else:  # the tag's index is a link to another checkpoint's index
        os.mkdir(ck)
        os.symlink(os.path.join(moved, F.INDEX_NAME), os.path.join(ck, F.INDEX_NAME))
    _refused(root, like, "symbolic link|not found")


def test_huge_files_are_refused_before_they_are_read(saved):
    root, ck, like, _ = saved
    with open(os.path.join(root, "latest"), "wb") as f:  # sparse: big on paper, nothing on disk
        f.truncate(10 << 30)
    assert "at most 1024" in _refused(root, like)
    with open(os.path.join(root, "latest"), "w") as f:
        f.write("t")
    with open(os.path.join(ck, F.INDEX_NAME), "wb") as f:
        f.truncate(F.MAX_INDEX_BYTES + 1)
    _refused(root, like, "a file there is at most")


def _forge(ck, change):
    p = os.path.join(ck, F.INDEX_NAME)
    with open(p, "rb") as f:
        ix = msgpack.unpackb(f.read(), raw=False)
    change(ix)
    with open(p, "wb") as f:  # written back without recomputing the seal, as any edit would be
        f.write(msgpack.packb(ix, use_bin_type=True))


def _first_tensor(ix):
    return next(iter(ix["tensors"].values()))


FORGERIES = {
    "dtype float64 -> int64 (same size)": lambda ix: _first_tensor(ix).update(dtype="int64"),
    "a segment's offset": lambda ix: _first_tensor(ix)["segments"][0].__setitem__(1, 4096),
    "a segment's crc": lambda ix: _first_tensor(ix)["segments"][0].__setitem__(4, 1),
    "a slot's shape": lambda ix: ix["units"][0]["slots"][0].update(shape=list(reversed(ix["units"][0]["slots"][0]["shape"]))),
    "the step": lambda ix: ix.update(step=10**6),
    "the world size": lambda ix: ix.update(world_size=2),
    "the client state": lambda ix: ix.update(client_state={"epoch": 99}),
    "the seal removed": lambda ix: ix.pop("index_crc32"),
}


@pytest.mark.parametrize("field", list(FORGERIES))
def test_forged_metadata_is_detected(saved, field):
    root, ck, like, _ = saved
    _forge(ck, FORGERIES[field])
    _refused(root, like, "metadata checksum")


def test_a_version_1_index_without_a_seal_still_loads(saved):
    # Checkpoints written before the seal existed load as before.
    root, ck, like, _ = saved
    _forge(ck, lambda ix: (ix.pop("index_crc32"), ix.update(version=1)))
    state, _ = load(root, like)
    fnzero.testing.assert_trees_equal(state.params, like.params)
