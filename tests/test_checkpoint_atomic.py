"""Crash safety: kill -9 a saving process at random moments; the previous checkpoint stays
loadable and `latest` points at a complete one."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import fnzero
from fnzero.checkpoint import list_tags, load, save
from _ckpt_helpers import setup


def test_kill_9_during_save_never_breaks_latest(tmp_path):
    here = os.path.dirname(__file__)
    proc = subprocess.run(
        [sys.executable, os.path.join(here, "_ckpt_killer.py"), str(tmp_path / "ck"), "20", "7"],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rep = json.loads(proc.stdout.strip().splitlines()[-1])
    assert rep["kills"] == 20
    # Some kills landed before the first commit of a round (no advance), some after (advance): the
    # test exercised both sides of the rename.
    assert rep["last"] > 0, rep
    leftovers = [n for n in os.listdir(tmp_path / "ck") if n.startswith(".")]
    # Killed saves may leave staging dirs behind; the next save cleans them up.
    _, _, like, _ = setup("mlp:3,2", 0, fnzero.LocalCollectives())
    save(tmp_path / "ck2", like, tag="x")
    assert list_tags(tmp_path / "ck2") == ["x"]
    del leftovers


def test_interrupted_replace_of_a_tag_falls_back_to_the_old_copy(tmp_path):
    """A save that replaces tag T moves the old T aside first; dying right then leaves `.T.*.old`,
    which load still finds, and the next save cleans up."""
    _, _, like, _ = setup("mlp:3,2", 0, fnzero.LocalCollectives())
    save(tmp_path, like, tag="T", client_state={"v": 1})
    os.rename(tmp_path / "T", tmp_path / ".T.00000000000000ab.old")
    _, cs = load(tmp_path, like=like)
    assert cs == {"v": 1}
    save(tmp_path, like, tag="T", client_state={"v": 2})
    assert load(tmp_path, like=like)[1] == {"v": 2}
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".") and n.endswith(".old")]
