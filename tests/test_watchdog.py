"""The collective watchdog's judgement (specs/collectives.md §Watchdog), on an in-memory store:
which rank is named, by whom, and when. The end-to-end runs are in test_launch_faults.py."""

from __future__ import annotations

import time

from fnzero.sharding._watchdog import Watchdog


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
def _world(n=2, timeout=0.5):
    store, ended = _Store(), []
    dogs = [Watchdog(store, r, n, timeout, poll_s=0.25, exit_fn=lambda code, r=r: ended.append(r)) for r in range(n)]
    for d in dogs:
        d.step = 3
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
    dogs[0].issue("all_gather", "blocks.2")
    with dogs[0].waiting(13, "all_gather", "blocks.2"):
        _tick(dogs)
        assert ended == []  # not yet: within the timeout
        time.sleep(0.9)
        _tick(dogs)
    assert ended == [1]  # the late rank, first (the waiting one gives it a grace)
    verdict = dogs[0].verdict()
    assert verdict.startswith("fnzero watchdog: rank 1 did not reach collective #13 (all_gather of unit 'blocks.2') "
                              "at step 3 within 0.5s: rank(s) [0] reached it"), verdict


def test_a_silent_stuck_rank_is_named_by_the_ranks_that_wait():
    # Its main thread holds the GIL, so its own watchdog never runs: the others name it after a grace.
    store, dogs, ended = _world(3)
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
    assert ended[:1] == [0] and "rank(s) [2] did not reach collective #6 (all_gather of unit 'layers.1')" in dogs[0].verdict()


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
