"""fnzero.testing's worlds (specs/testing.md §Worlds): user code that calls `init_distributed()` and
`shard(model)` without `comm=` runs unchanged on a simulated world and on real gloo processes, and
gives the same numbers on both."""

from __future__ import annotations

import time

import pytest
import torch

import fnzero
import fnzero.testing as ft
from fnzero.sharding.comm._collectives import LocalCollectives, default_collectives


def train_fn():
    """Launcher-style user code: no comm, no rank passed in. Module-level: spawned ranks import it."""
    info = fnzero.init_distributed()
    cfg = fnzero.load_config(
        {"train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 2, "gradient_clipping": 0.5,
         "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}},
         "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}},
        world_size=info.world_size,
    )
    with ft.seeded(0):
        model = ft.MLP([5, 7, 3]).double()
    sm = fnzero.shard(model, config=cfg)
    state = sm.init_state()
    step = fnzero.train_step(ft.step_loss(sm, lambda apply, b: torch.nn.functional.mse_loss(apply(b[0]), b[1])), cfg)
    g = torch.Generator().manual_seed(7)
    rows = 3 * 2  # micro x gas: this rank's rows per step
    x = torch.randn(rows * info.world_size, 5, generator=g, dtype=torch.float64)
    y = torch.randn(rows * info.world_size, 3, generator=g, dtype=torch.float64)
    mine = (x[info.rank * rows : (info.rank + 1) * rows], y[info.rank * rows : (info.rank + 1) * rows])
    losses = []
    for _ in range(3):
        state, m = step(state, mine)
        losses.append(torch.tensor(m["loss"], dtype=torch.float64))
    return {"backend": info.backend, "rank": info.rank, "world": info.world_size, "losses": losses,
            "params": sm.gather(state)}


def test_user_code_sees_its_thread_rank_without_comm():
    out = ft.simulated_world(3).run(train_fn)
    assert [(o["backend"], o["rank"], o["world"]) for o in out] == [("simulated", r, 3) for r in range(3)]
    for o in out[1:]:
        ft.assert_trees_equal(o["params"], out[0]["params"], what=f"rank {o['rank']} vs rank 0")


def test_run_accepts_fn_with_or_without_the_comm():
    world = ft.simulated_world(2)
    assert world.run(lambda comm: (comm.rank, comm.world_size)) == [(0, 2), (1, 2)]
    assert world.run(lambda: default_collectives().rank) == [0, 1]
    assert world.run(lambda scale=10: scale) == [10, 10]  # a defaulted parameter is not the comm


def test_the_rank_does_not_leak_out_of_run():
    ft.simulated_world(2).run(lambda: None)
    assert isinstance(default_collectives(), LocalCollectives)
    assert fnzero.init_distributed().backend is None


def test_startup_is_well_under_a_second():
    world = ft.simulated_world(8)
    t0 = time.perf_counter()
    for _ in range(5):
        assert world.run(lambda comm: comm.all_reduce(torch.ones(1)).item()) == [8.0] * 8
    assert (time.perf_counter() - t0) / 5 < 0.25


def test_seeded_gives_every_rank_the_same_weights():
    def build():
        with ft.seeded(3):
            return torch.nn.Linear(16, 16).weight.detach().clone()

    ws = ft.simulated_world(6).run(build)
    assert all(torch.equal(w, ws[0]) for w in ws)
    assert ft.simulated_world(2).init_lock is ft.simulated_world(5).init_lock  # one generator, one lock


def test_a_failing_rank_is_named():
    def fn(comm):
        if comm.rank == 2:
            raise RuntimeError("boom on two")
        comm.barrier()

    with pytest.raises(fnzero.DistributedError, match=r"(?s)rank 2 .*boom on two"):
        ft.simulated_world(4, timeout=20).run(fn)


def _ranks(comm):
    return comm.rank, comm.world_size


def test_spawned_world_calls_fn_like_the_simulated_one(monkeypatch):
    """`SpawnedWorld.run` hands `fn` to `run_world` through a wrapper that passes the process
    group's collectives only when `fn` takes an argument (checked without spawning here; the gloo
    test below spawns for real)."""
    from fnzero.testing import _spawn

    calls = []
    monkeypatch.setattr(_spawn, "run_world", lambda f, n, fn, **kw: calls.append((f, n, fn, kw)) or ["ok"] * n)
    assert ft.spawned_world(3, timeout=9).run(_ranks) == ["ok"] * 3
    f, n, fn, kw = calls[0]
    assert (f, n, fn, kw["timeout"], kw["backend"]) == (_spawn._call_in_rank, 3, _ranks, 9, "gloo")
    assert _spawn._call_in_rank(lambda: "bare") == "bare"


def test_wrap_comm_wraps_every_rank():
    seen = ft.simulated_world(3, wrap_comm=fnzero.RecordingCollectives).run(
        lambda: (type(default_collectives()).__name__, default_collectives().all_gather(torch.ones(2)).numel())
    )
    assert seen == [("RecordingCollectives", 6)] * 3


@pytest.mark.multiprocess
def test_simulated_world_equals_real_gloo_processes():
    """Two ranks, float64: bit-for-bit equal. With two ranks every reduction is one addition, and
    a + b == b + a in IEEE arithmetic, so summation order cannot differ from gloo's. (With more
    ranks the simulated world sums in rank order and gloo's ring may not: expect ~1e-16 relative.)"""
    sim = ft.simulated_world(2).run(train_fn)
    real = ft.spawned_world(2, timeout=120).run(train_fn)
    assert [(r["backend"], r["rank"], r["world"]) for r in real] == [("gloo", 0, 2), ("gloo", 1, 2)]
    for r in range(2):
        ft.assert_trees_equal(
            {k: real[r][k] for k in ("losses", "params")},
            {k: sim[r][k] for k in ("losses", "params")},
            what=f"gloo vs simulated, rank {r}",
        )
