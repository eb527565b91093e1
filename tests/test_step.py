"""The pure training step on one process (specs/sharding.md §Step): purity, determinism,
accumulation equivalence, donation, fp16 loss scaling and mixed precision, clear errors."""

import math

import optree
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import fnzero
from fnzero.testing import MLP


def _cfg(k=1, micro=4, clip=0.0, precision="fp32", stage=0, scheduler=None, **extra):
    c = {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": k,
        "gradient_clipping": clip,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
        "zero_optimization": {"stage": stage},
    }
    if precision == "fp16":
        c["fp16"] = {"enabled": True, "initial_scale_power": 4, "hysteresis": 1, "loss_scale_window": 2}
    if precision == "bf16":
        c["bf16"] = {"enabled": True}
    if scheduler:
        c["scheduler"] = scheduler
    c.update(extra)
    return fnzero.load_config(c, world_size=1)


def _setup(cfg, sizes=(3, 5, 2), dtype=torch.float64, seed=0):
    torch.manual_seed(seed)
    sm = fnzero.shard(MLP(list(sizes)).to(dtype), config=cfg)
    state = sm.init_state()

    def loss_fn(params, batch):
        x, y = batch
        return F.mse_loss(sm.apply(params, x).to(y.dtype), y)

    return sm, state, loss_fn


def _batch(n, din=3, dout=2, dtype=torch.float64, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, din, generator=g, dtype=dtype), torch.randn(n, dout, generator=g, dtype=dtype)


def _snapshot(tree):
    return optree.tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, tree, none_is_leaf=True)


def _equal_trees(a, b):
    la, sa = optree.tree_flatten(a, none_is_leaf=True)
    lb, sb = optree.tree_flatten(b, none_is_leaf=True)
    return sa == sb and all(
        torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y for x, y in zip(la, lb)
    )


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_step_is_pure_and_deterministic(stage, precision):
    cfg = _cfg(k=2, clip=1.0, precision=precision, stage=stage)
    dtype = torch.float64 if precision == "fp32" else torch.float32
    _, state, loss_fn = _setup(cfg, dtype=dtype)
    step = fnzero.train_step(loss_fn, cfg)
    batch = _batch(8, dtype=dtype)
    before = _snapshot(state)
    s1, m1 = step(state, batch)
    assert _equal_trees(state, before), "the step modified its input state"
    s2, m2 = step(state, batch)
    assert _equal_trees(s1, s2) and m1 == m2
    assert int(s1.step) == 1 and not m1["skipped"]


@given(k=st.integers(1, 4), b=st.integers(1, 3), sizes=st.lists(st.integers(1, 6), min_size=2, max_size=3))
@settings(max_examples=20)
def test_k_micro_batches_equal_one_batch_of_k_times_b(k, b, sizes):
    """Mean loss: k micro-batches of b rows == one batch of k*b rows (float64, 1e-12)."""
    sizes = [3, *sizes[1:-1], 2]
    x, y = _batch(k * b)
    results = []
    for kk, micro in ((k, b), (1, k * b)):
        cfg = _cfg(k=kk, micro=micro, clip=0.5)
        sm, state, loss_fn = _setup(cfg, sizes)
        step = fnzero.train_step(loss_fn, cfg)
        for _ in range(3):
            state, m = step(state, (x, y))
        results.append((sm.gather(state), m["loss"]))
    (pa, la), (pb, lb) = results
    assert la == pytest.approx(lb, rel=1e-12)
    for n in pa:
        torch.testing.assert_close(pa[n], pb[n], rtol=1e-12, atol=1e-14)


def test_micro_batches_may_be_given_as_a_list():
    cfg = _cfg(k=2, micro=2)
    _, state, loss_fn = _setup(cfg)
    step = fnzero.train_step(loss_fn, cfg)
    x, y = _batch(4)
    a, _ = step(state, (x, y))
    b, _ = step(state, [(x[:2], y[:2]), (x[2:], y[2:])])
    assert _equal_trees(a.params, b.params)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_donated_step_equals_pure_step(stage):
    cfg = _cfg(k=1, clip=1.0, stage=stage)
    _, state, loss_fn = _setup(cfg)
    pure = fnzero.train_step(loss_fn, cfg)
    donated = fnzero.train_step(loss_fn, cfg, donate=True)
    batch = _batch(4)
    s_pure, s_don = state, fnzero.tree_clone(state)
    for _ in range(3):
        s_pure, _ = pure(s_pure, batch)
        s_don, _ = donated(s_don, batch)
    assert _equal_trees(s_pure.params, s_don.params)
    assert _equal_trees(s_pure.opt_state, s_don.opt_state)


def test_fp16_overflow_skips_the_step_and_cuts_the_scale():
    cfg = _cfg(precision="fp16")
    sm, state, loss_fn = _setup(cfg, dtype=torch.float32)
    blow_up = {"on": True}

    def maybe_inf(params, batch):
        loss = loss_fn(params, batch)
        return loss * float("inf") if blow_up["on"] else loss

    step = fnzero.train_step(maybe_inf, cfg)
    batch = _batch(4, dtype=torch.float32)
    s1, m1 = step(state, batch)
    assert m1["skipped"] and m1["loss_scale"] == 16.0
    assert float(s1.loss_scale.scale) == 8.0  # hysteresis 1: halved at once
    assert int(s1.step) == 0 and _equal_trees(s1.params, state.params)
    blow_up["on"] = False
    s2, m2 = step(s1, batch)
    s3, m3 = step(s2, batch)
    assert not m2["skipped"] and int(s3.step) == 2
    assert float(s3.loss_scale.scale) == 8.0  # DeepSpeed 0.19.8: the first clean step after it counts for nothing
    s4, _ = step(s3, batch)
    assert float(s4.loss_scale.scale) == 16.0  # window 2: two clean steps before this one double it


def test_skipped_steps_do_not_advance_the_schedule():
    sched = {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-2, "warmup_num_steps": 4, "warmup_type": "linear"}}
    cfg = _cfg(precision="fp16", scheduler=sched)
    _, state, loss_fn = _setup(cfg, dtype=torch.float32)
    schedule = fnzero.schedules.from_config(cfg)
    flags = iter([False, True, False, False])

    def loss(params, batch):
        v = loss_fn(params, batch)
        return v * float("inf") if next(flags) else v

    step = fnzero.train_step(loss, cfg)
    lrs = []
    for _ in range(4):
        state, m = step(state, _batch(4, dtype=torch.float32))
        if not m["skipped"]:
            lrs.append(m["lr"])
    assert lrs == [schedule(0), schedule(1), schedule(2)]


def test_bf16_keeps_fp32_master_weights():
    cfg = _cfg(precision="bf16", stage=2)
    sm, state, loss_fn = _setup(cfg, dtype=torch.float32)
    assert all(t.dtype == torch.bfloat16 for t in state.params.values())
    assert all(t.dtype == torch.float32 for t in state.master.values())
    step = fnzero.train_step(loss_fn, cfg)
    s, m = step(state, _batch(4, dtype=torch.float32))
    assert math.isfinite(m["loss"])
    for u in state.params:  # the 16-bit params are the rounded master weights
        torch.testing.assert_close(s.params[u], s.master[u].to(torch.bfloat16), rtol=0, atol=0)


def test_clipping_reports_the_unclipped_global_norm():
    cfg = _cfg(clip=1e-3)
    sm, state, loss_fn = _setup(cfg)
    batch = _batch(4)
    leaves = {k: v.detach().requires_grad_() for k, v in state.params.items()}
    loss_fn(leaves, batch).backward()
    want = torch.sqrt(sum(v.grad.pow(2).sum() for v in leaves.values())).item()
    _, m = fnzero.train_step(loss_fn, cfg)(state, batch)
    assert m["grad_norm"] == pytest.approx(want, rel=1e-12)


def test_loss_must_be_a_scalar():
    cfg = _cfg()
    sm, state, _ = _setup(cfg)
    step = fnzero.train_step(lambda p, b: sm.apply(p, b[0]), cfg)
    with pytest.raises(fnzero.ShardingError, match="scalar"):
        step(state, _batch(4))


def test_batch_that_does_not_split_names_the_leaf():
    cfg = _cfg(k=3, micro=1)
    _, state, loss_fn = _setup(cfg)
    with pytest.raises(fnzero.ShardingError, match=r"4 rows; .*\(1\) x gradient_accumulation_steps \(3\) = 3 rows"):
        fnzero.train_step(loss_fn, cfg)(state, _batch(4))


def test_has_aux_returns_the_aux_value():
    cfg = _cfg()
    sm, state, loss_fn = _setup(cfg)
    step = fnzero.train_step(lambda p, b: (loss_fn(p, b), {"n": b[0].shape[0]}), cfg, has_aux=True)
    _, m = step(state, _batch(4))
    assert m["aux"] == {"n": 4}


def test_init_state_hands_over_once():
    cfg = _cfg()
    sm, state, _ = _setup(cfg)
    with pytest.raises(fnzero.ShardingError, match="once"):
        sm.init_state()


def test_wall_clock_breakdown_adds_timings():
    cfg = _cfg(k=2, wall_clock_breakdown=True)
    _, state, loss_fn = _setup(cfg)
    _, m = fnzero.train_step(loss_fn, cfg)(state, _batch(8))
    assert set(m["timings"]) == {"forward", "backward", "comm", "optimizer"}
    assert all(v >= 0 for v in m["timings"].values()) and m["timings"]["forward"] > 0
    _, plain = fnzero.train_step(loss_fn, _cfg(k=2))(state, _batch(8))
    assert "timings" not in plain
