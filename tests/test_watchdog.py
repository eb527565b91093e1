"""The collective watchdog's judgement (specs/collectives.md §Watchdog, §Blame), on an in-memory
store: which rank is named, by whom, and when. The end-to-end runs are in test_launch_faults.py."""

from __future__ import annotations

import json
import os
import time

import fnzero
from fnzero.sharding.comm._failure import explain_failure, root_cause
from fnzero.sharding.comm._watchdog import Watchdog


class _Store:
    """The four TCPStore calls the watchdog makes, in memory (shared by the ranks of a test)."""

    def __init__(self):
        self.kv: dict[str, bytes] = {}

    def set(self, k, v):
        self.kv[k] = v.encode() if isinstance(v, str) else v

    def get(self, k):
        return self.kv[k]

    def check(self, keys):
        return all(k in self.kv for k in keys)

    def compare_set(self, k, expected, desired):
        if self.kv.get(k, b"").decode() == expected:
            self.set(k, desired)
        return self.kv[k]


# Timeout 0.5 s, heartbeat 0.25 s: the waiting ranks' grace is 0.5 + 2 x 0.25 + 0.5 = 1.5 s. The
# sleeps below sit well inside each window, so a loaded machine's delays do not change the verdict.
# The ranks are threads of this process: their beats carry its pid, so `kill_fn` only records.
def _world(n=2, timeout=0.5, killed=None):
    store, ended = _Store(), []
    killed = [] if killed is None else killed
    dogs = [Watchdog(store, r, n, timeout, poll_s=0.25, exit_fn=lambda code, r=r: ended.append(r),
                     kill_fn=killed.append) for r in range(n)]
    for d in dogs:
        d.at_step(3)
    return store, dogs, ended


def _tick(dogs, only=None):
    for d in dogs if only is None else [dogs[i] for i in only]:
        d._publish()
    for d in dogs if only is None else [dogs[i] for i in only]:
        d._judge(d.beats())


def test_the_rank_that_does_not_come_names_itself_and_the_collective():
    store, dogs, ended = _world()
    for d in dogs:
        for _ in range(12):
            d.issue("all_reduce")
    dogs[1].at_step(2)  # stuck between steps 2 and 3: the collective is named at the waiting rank's step
    dogs[0].issue("all_gather", "blocks.2")
    with dogs[0].waiting(13, "all_gather", "blocks.2"):
        _tick(dogs)
        assert ended == []  # not yet: within the timeout
        time.sleep(0.9)
        _tick(dogs)
    assert ended == [1]  # the late rank, first (the waiting one gives it a grace)
    verdict = dogs[0].verdict()
    assert verdict.startswith("fnzero watchdog: rank 1 did not reach collective #13 (all_gather of unit 'blocks.2') "
                              "at step 3 within 0.5s: rank(s) [0] reached it. This rank's last collective was #12 "
                              "(all_reduce) at step 2."), verdict


def test_a_silent_stuck_rank_is_named_and_ended_by_the_ranks_that_wait():
    # Its main thread holds the GIL, so its own watchdog never runs: the others name it after a
    # grace and, as it runs on their machine, end its process (the launcher then sees it fail
    # first and stops them), rather than their own.
    killed = []
    store, dogs, ended = _world(3, killed=killed)
    for d in dogs:
        for _ in range(5):
            d.issue("reduce_scatter", "layers.0")
    _tick(dogs)
    for d in dogs[:2]:
        d.issue("all_gather", "layers.1")
    with dogs[0].waiting(6, "all_gather", "layers.1"), dogs[1].waiting(6, "all_gather", "layers.1"):
        _tick(dogs, only=[0, 1])
        time.sleep(0.8)
        _tick(dogs, only=[0, 1])
        assert ended == []  # past the timeout, within the grace: rank 2 could still speak
        time.sleep(1.0)
        _tick(dogs, only=[0, 1])
    assert "rank(s) [2] did not reach collective #6 (all_gather of unit 'layers.1')" in dogs[0].verdict()
    assert dogs[0].verdict_ranks()[1] == [2]
    assert ended == [] and killed[:1] == [os.getpid()]  # rank 2's process (its beat's pid) ended, not rank 0's


def test_ranks_in_step_and_a_finished_rank_are_left_alone():
    store, dogs, ended = _world()
    for d in dogs:
        d.issue("all_reduce")
    _tick(dogs)
    time.sleep(0.6)
    _tick(dogs)
    assert ended == []  # equal counts: nobody waits for anybody
    dogs[1].finish()  # its process ends normally, and says so
    dogs[0].issue("barrier")  # ... but rank 0 goes on to a collective rank 1 will never reach
    _tick(dogs, only=[0])
    time.sleep(1.6)
    _tick(dogs, only=[0])
    assert ended == [0] and "rank(s) [1] did not reach" in dogs[0].verdict()
    assert "(it finished and exited)" in dogs[0].verdict()


def test_the_watchdog_judges_within_half_the_process_group_timeout():
    # A gloo timeout that fires first fails a waiting rank, which would be blamed instead.
    store, dogs, ended = _world()
    wd = Watchdog(store, 0, 2, timeout_s=300, limit_s=15)
    assert wd.timeout_s == 15
    wd.set_timeout(4)  # a config's watchdog.timeout_seconds
    assert wd.timeout_s == 4
    wd.set_timeout(600)
    assert wd.timeout_s == 15
    wd.set_timeout(0)  # off stays off
    assert wd.timeout_s == 0


def test_a_rank_that_raised_is_named_by_the_collective_that_broke():
    store, dogs, ended = _world()
    for d in dogs:
        d.issue("all_gather", "layers.0")
        d._publish()
    dogs[1].finish(RuntimeError("injected failure on rank 1\nmore"))  # its atexit
    message, ranks = explain_failure(dogs[0], 2, "all_gather", RuntimeError("[x/pair.cc:553] Connection closed by peer. GLHF"),
                                     "layers.1")
    assert ranks == [1], message
    assert message == ("collective #2 (all_gather of unit 'layers.1') at step 3 failed: rank 1 raised "
                       "RuntimeError: injected failure on rank 1"), message
    assert ended == []
    # A DistributedError that names others is not this rank's own failure (it lingers at exit).
    assert fnzero.DistributedError(message, ranks=ranks).ranks == (1,)


def test_the_launcher_blames_the_first_own_error_or_verdict_before_what_others_saw(tmp_path):
    def leave(name, rank, ranks, kind, t, message):
        (tmp_path / name).write_text(json.dumps({"rank": rank, "ranks": ranks, "kind": kind, "t": t, "message": message}))

    assert root_cause(str(tmp_path)) is None
    leave("rank00000.consequence.json", 0, [1], "consequence", 1.0, "collective #3 failed: rank(s) [1] stopped\nmore")
    assert root_cause(str(tmp_path)) == ([1], "collective #3 failed: rank(s) [1] stopped", 0)  # a killed rank says nothing
    leave("rank00002.error.json", 2, [2], "error", 3.0, "ValueError: later")
    leave("rank00001.verdict.json", 1, [1], "verdict", 2.0, "fnzero watchdog: rank 1 did not reach #3\nWhere: ...")
    (tmp_path / "torchrun.error").write_text("{}")
    assert root_cause(str(tmp_path)) == ([1], "fnzero watchdog: rank 1 did not reach #3", None)
