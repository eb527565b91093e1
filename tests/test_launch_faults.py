"""Launching and failing (specs/collectives.md §Faults): a rank that raises makes the whole job
exit non-zero with that rank's error shown, never a hang; two launcher agents (--nnodes 2) on
loopback train together; the spawn harness reports dead and late ranks."""

import os
import re
import subprocess
import sys
import time

import pytest

from fnzero.testing import WorldError, free_port, run_world

pytestmark = pytest.mark.multiprocess
HERE = os.path.dirname(__file__)
FNZERO = [sys.executable, "-m", "fnzero.cli"]


def _env():
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


# specs/collectives.md §Blame: rank 1 misbehaves inside its third step at ZeRO-3, four ways; in
# each, torchrun's summary ("Root Cause") and `fnzero launch`'s last line name rank 1.
MODES = {
    "raise": ("raise", "default", "default"),  # a RuntimeError in the loss function
    "kill": ("die", "default", "default"),  # SIGKILL
    "hang": ("hang", "default", "4"),  # the watchdog's own timeout (default 300 s) judges
    # init_distributed(timeout_s=16) and no watchdog key: the watchdog's 300 s is held to 8 s, so it
    # judges before gloo's timeout fails rank 0 (which would then be blamed).
    "hang_short_timeout": ("hang", "16", "default"),
}


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """The four jobs, started together (each mostly waits, so they share one wall time);
    `launched(name)` -> (exit status, output, seconds)."""
    folder = tmp_path_factory.mktemp("launch_faults")
    script = os.path.join(HERE, "scripts", "misbehave_on_rank1.py")
    t0 = time.monotonic()
    procs = {}
    for name, argv in MODES.items():
        with open(folder / f"{name}.txt", "w") as out:  # a file, not a pipe: nothing waits on a reader
            procs[name] = subprocess.Popen([*FNZERO, "launch", "--nproc-per-node", "2", script, *argv],
                                           stdout=out, stderr=subprocess.STDOUT, env=_env())
    done = {}

    def result(name):
        if name not in done:
            procs[name].wait(timeout=180)
            done[name] = (procs[name].returncode, (folder / f"{name}.txt").read_text(), time.monotonic() - t0)
        return done[name]

    yield result
    for p in procs.values():  # never leave a job behind for the next test
        if p.poll() is None:
            p.kill()
            p.wait()


def _blames_rank_1(name, launched):
    rc, out, _ = launched(name)
    assert rc != 0 and "unreachable" not in out, out
    root = out.split("Root Cause (first observed failure):\n[0]:\n")[1].split("=====")[0]
    assert "rank      : 1 (local_rank: 1)" in root, out  # torchrun's summary
    last = out.strip().splitlines()[-1]
    assert last.startswith("fnzero launch: root cause: rank 1 ("), out  # and the launcher's last line
    return out, root, last


def test_a_rank_that_raises_is_blamed(launched):
    out, root, last = _blames_rank_1("raise", launched)
    assert "RuntimeError: injected failure on rank 1" in root, out  # its error file: the message, not a SIGTERM
    assert "rank 0 caught DistributedError: collective #" in out and "rank 1 raised RuntimeError: injected" in out, out
    assert last == "fnzero launch: root cause: rank 1 (exit status 1): RuntimeError: injected failure on rank 1", out


def test_a_killed_rank_is_blamed(launched):
    out, root, last = _blames_rank_1("kill", launched)
    assert "Signal 9 (SIGKILL)" in root, out
    assert last.startswith("fnzero launch: root cause: rank 1 (ended by SIGKILL)"), out
    if "torchrun's first observed failure" not in last:
        # Seen by rank 0's collective, or by its watchdog first (a dead peer on this machine is seen at once).
        assert "rank 0 caught DistributedError: collective #" in out, out
        assert last.startswith("fnzero launch: root cause: rank 1 (ended by SIGKILL), as rank 0 saw it: "), out
        assert "rank(s) [1] stopped (killed, out of memory, or crashed)" in last, out
    else:
        # torchrun's monitor (1 s ticks) stopped rank 0 before it left its record of what it saw
        # (before it printed it, or between the print and the record, which its exit writes): seen
        # on loaded 2-core CI runs. The blame is still rank 1's, from torchrun's own record.
        assert "closing signal SIGTERM" in out, out


def test_a_hung_rank_is_named_by_the_watchdog_and_blamed(launched):
    out, root, last = _blames_rank_1("hang", launched)
    verdict = "rank 1 did not reach collective #"
    assert f"[rank 1] fnzero.DistributedError: {verdict}" in out, out  # the stuck rank's own report
    assert f"[rank 0] fnzero.DistributedError: {verdict}" in out, out  # and rank 0's, from its watchdog
    assert "at step 3" in out and "time.sleep(3600)" in out, out  # the step, and where it was stuck
    assert re.search(r"rank 1 did not reach collective #\d+ \(all_gather of unit 'layers\.\d'\)", out), out  # the unit
    # Rank 0's error is a DistributedError carrying the verdict, not a raw gloo error alone.
    assert "rank 0 caught DistributedError: collective #" in out and verdict in out.split("rank 0 caught")[1], out
    assert f"fnzero watchdog: {verdict}" in root, out  # the verdict is rank 1's error in torchrun's summary
    assert last.startswith(f"fnzero launch: root cause: rank 1 (exit status 1): fnzero watchdog: {verdict}"), out


def test_a_hung_rank_is_blamed_before_a_short_process_group_timeout(launched):
    out, root, last = _blames_rank_1("hang_short_timeout", launched)
    assert "within 8s: rank(s) [0] reached it" in last, out  # half of init_distributed's timeout_s=16
    assert "Timed out" not in out, out  # gloo's timeout never fired


# Slow and, under load, occasionally stuck in torchrun's own agent shutdown (seen once in CI after
# both ranks had trained and printed their result): run with `pytest -m slow`.
@pytest.mark.slow
def test_two_launcher_agents_train_together():
    port = str(free_port())
    script = os.path.join(HERE, "scripts", "train_two_nodes.py")
    procs = [
        subprocess.Popen(
            [*FNZERO, "launch", "--nnodes", "2", "--node-rank", str(r), "--nproc-per-node", "1",
             "--master-addr", "127.0.0.1", "--master-port", port, script],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_env(),
        )
        for r in range(2)
    ]
    outs = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=180)
            outs.append(out)
            assert p.returncode == 0, out
    finally:
        for p in procs:  # never leave agents (and their pipes) behind for the next test
            if p.poll() is None:
                p.kill()
                p.communicate()
    lines = sorted(l for o in outs for l in o.splitlines() if l.startswith("RESULT"))
    assert [l.split()[1:3] for l in lines] == [["rank=0", "world=2"], ["rank=1", "world=2"]]
    assert len({l.split()[3] for l in lines}) == 1  # the mean loss is agreed across ranks
    # Each rank's process group is destroyed at exit, before interpreter teardown (`_dist.py`).
    assert [l for o in outs for l in o.splitlines() if l.startswith("EXIT")] == ["EXIT group destroyed=True"] * 2


def _raise_on_rank_1():
    import torch.distributed as dist

    if dist.get_rank() == 1:
        raise ValueError("boom from rank 1")
    dist.barrier()  # rank 0 would wait here forever without the harness


def _hang():
    import time as _t

    _t.sleep(60)


def test_harness_names_the_failing_rank():
    with pytest.raises(WorldError, match=r"rank 1 raised:(.|\n)*boom from rank 1"):
        run_world(_raise_on_rank_1, 2, timeout=60)


def test_harness_times_out_instead_of_hanging():
    t0 = time.monotonic()
    with pytest.raises(WorldError, match="did not finish within 5s"):
        run_world(_hang, 2, timeout=5)
    assert time.monotonic() - t0 < 30
