"""N -> M resharding round trips over world sizes 1-4, stages 0-3 and model shapes (hypothesis)."""

from __future__ import annotations

import shutil
import tempfile

import torch
from _ckpt_helpers import full_buffers, setup
from hypothesis import given, settings
from hypothesis import strategies as st

import fnzero
from fnzero.checkpoint import load, save
from fnzero.testing._threads import simulated_world


def _perturbed(state, seed):
    """Give every tensor distinct values (moments included), consistently across ranks: element i of
    a unit's logical buffer gets a value that depends on (seed, field, unit, i) only."""
    plan, rank = state.sharding.plan, state.sharding.rank

    def fill(field_no, u, t):
        lo = 0 if t.numel() == u.padded_numel else rank * u.shard_numel
        idx = torch.arange(lo, lo + t.numel(), dtype=torch.float64)
        v = torch.sin(idx * (0.37 + field_no) + seed + len(u.name)) + field_no
        v[idx >= u.numel] = 0
        return v.to(t.dtype)

    params = {u.name: fill(0, u, state.params[u.name]) for u in plan.units}
    m = {u.name: fill(1, u, state.opt_state.exp_avg[u.name]) for u in plan.units}
    v = {u.name: fill(2, u, state.opt_state.exp_avg_sq[u.name]).abs() for u in plan.units}
    opt = state.opt_state._replace(exp_avg=m, exp_avg_sq=v, count=torch.tensor(seed % 50))
    return state.replace(params=params, opt_state=opt, step=torch.tensor(seed % 50))


@settings(max_examples=40)
@given(
    n=st.integers(1, 4), s=st.integers(0, 3), m=st.integers(1, 4), t=st.integers(0, 3),
    sizes=st.lists(st.integers(1, 9), min_size=2, max_size=4), seed=st.integers(0, 1000),
)
def test_reshard_round_trip(n, s, m, t, sizes, seed):
    kind = "mlp:" + ",".join(map(str, sizes))
    d = tempfile.mkdtemp(prefix="fnzero-reshard-")

    def saver(comm):
        _, _, state, _ = setup(kind, s, comm)
        state = _perturbed(state, seed)
        save(d, state, tag="x")
        return state

    def loader(comm):
        _, _, like, _ = setup(kind, t, comm)
        return load(d, like=like)[0]

    try:
        before = simulated_world(n).run(saver)
        after = simulated_world(m).run(loader)
    finally:
        shutil.rmtree(d, ignore_errors=True)
    for field in ("params", "exp_avg", "exp_avg_sq"):
        a, b = full_buffers(before, field), full_buffers(after, field)
        assert a.keys() == b.keys()
        for name in a:
            assert torch.equal(a[name], b[name]), (field, name)
    for st_ in after:  # padding is zero and every rank got the same replicated values
        plan = st_.sharding.plan
        assert int(st_.step) == seed % 50 and int(st_.opt_state.count) == seed % 50
        for u in plan.units:
            full = st_.params[u.name]
            if full.numel() == u.padded_numel:
                assert not full[u.numel:].any()


def test_lamb_per_parameter_state_reshards(tmp_path):
    """Lamb at stage 0 keeps per-parameter state (views of unit slots): stored in unit coordinates."""
    opt = {"type": "Lamb", "params": {"lr": 1e-2}}

    def saver(comm):
        _, _, state, step = setup("mlp:4,5,3", 0, comm, optimizer=opt)
        from _ckpt_helpers import run_steps

        state, _ = run_steps("mlp:4,5,3", step, state, comm, 0, 2)
        save(tmp_path, state)
        return state

    def loader(comm):
        _, _, like, _ = setup("mlp:4,5,3", 0, comm, optimizer=opt)
        return load(tmp_path, like=like)[0]

    a = simulated_world(2).run(saver)[0]
    b = simulated_world(1).run(loader)[0]
    fa, fb = fnzero.tree_clone(a.opt_state), b.opt_state
    import optree

    la, lb = optree.tree_leaves(fa), optree.tree_leaves(fb)
    assert len(la) == len(lb) and all(torch.equal(x, y) for x, y in zip(la, lb))
