"""fnzero.optim: parity with torch.optim / DeepSpeed over 100 steps, purity, the in-place
path, shard (slice) invariance, hyper-parameter validation and from_config."""

from __future__ import annotations

import math
from types import SimpleNamespace as NS

import optree
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fnzero._errors import ConfigError
from fnzero import optim

SETTINGS = settings(max_examples=40, deadline=None, derandomize=True)

# -- problem generation ------------------------------------------------------------------

shape_st = st.one_of(
    st.just(()),
    st.just((0,)),
    st.lists(st.integers(0, 7), min_size=1, max_size=3).map(tuple),
)
shapes_st = st.lists(shape_st, min_size=0, max_size=4)
dtype_st = st.sampled_from([torch.float32, torch.float64])


def make_problem(shapes, dtype, steps, seed=0):
    """params as a dict of leaves, and a list of `steps` grad trees of the same structure."""
    gen = torch.Generator().manual_seed(seed)
    params = {f"p{i}": torch.randn(s, generator=gen, dtype=torch.float64).to(dtype) for i, s in enumerate(shapes)}
    grads = [
        {k: torch.randn(v.shape, generator=gen, dtype=torch.float64).to(dtype) for k, v in params.items()}
        for _ in range(steps)
    ]
    return params, grads


def lrs_for(base, steps):
    # A moving lr, as a schedule would give, so per-step lr plumbing is exercised too.
    return [base * (1.0 + 0.5 * math.sin(k)) for k in range(steps)]


def assert_trees_close(actual, expected, *, rtol=1e-6, atol=1e-6):
    a, ta = optree.tree_flatten(actual)
    e, te = optree.tree_flatten(expected)
    assert ta == te
    for x, y in zip(a, e):
        assert x.dtype == y.dtype and x.shape == y.shape
        torch.testing.assert_close(x, y, rtol=rtol, atol=atol * (1.0 + float(y.abs().max()) if y.numel() else 1.0))


def run_fnzero(opt, params, grads, lrs, moms=None, inplace=False):
    if inplace:
        params = snapshot(params)  # update_ writes into its arguments; keep the caller's copy
    state = opt.init(params)
    fn = opt.update_ if inplace else opt.update
    for k, g in enumerate(grads):
        params, state = fn(g, state, params, lrs[k], momentum=None if moms is None else moms[k])
    return params, state


# -- references ----------------------------------------------------------------------------


def run_torch(cls, kwargs, params, grads, lrs, moms=None, mom_key=None):
    """torch.optim over the leaves, stepped with the same lr (and momentum) sequence."""
    ps = {k: v.clone().requires_grad_(True) for k, v in params.items()}
    if not ps:
        return {}
    opt = cls(list(ps.values()), **kwargs)
    for k, g in enumerate(grads):
        group = opt.param_groups[0]
        group["lr"] = lrs[k]
        if moms is not None:
            if mom_key == "betas":
                group["betas"] = (moms[k], group["betas"][1])
            else:
                group[mom_key] = moms[k]
        for name, p in ps.items():
            p.grad = g[name].clone()
        opt.step()
    return {k: v.detach() for k, v in ps.items()}


def run_lion_reference(params, grads, lrs, betas, wd, moms=None):
    """Lion as in the paper / DeepSpeed FusedLion, one tensor at a time."""
    ps = {k: v.clone() for k, v in params.items()}
    ms = {k: torch.zeros_like(v) for k, v in params.items()}
    b2 = betas[1]
    for k, g in enumerate(grads):
        b1 = betas[0] if moms is None else moms[k]
        lr = lrs[k]
        for n in ps:
            c = ms[n].clone().mul_(b1).add(g[n], alpha=1 - b1).sign_()
            ps[n].mul_(1 - lr * wd)
            ps[n].add_(c, alpha=-lr)
            ms[n].mul_(b2).add_(g[n], alpha=1 - b2)
    return ps


def run_lamb_reference(params, grads, lrs, *, betas, eps, weight_decay, bias_correction, max_coeff, min_coeff, eps_inside_sqrt=False, moms=None):
    """DeepSpeed FusedLamb (csrc/lamb/fused_lamb_cuda_kernel.cu), one tensor at a time:
    uncorrected moments, eps outside the sqrt, trust ratio ||p||/||m/(sqrt(v)+eps) + wd p||
    clamped to [min_coeff, max_coeff] (1 if either norm is 0), and both bias corrections
    folded into the step size lr*sqrt(1-b2^t)/(1-b1^t)."""
    ps = {k: v.clone() for k, v in params.items()}
    ms = {k: torch.zeros_like(v) for k, v in params.items()}
    vs = {k: torch.zeros_like(v) for k, v in params.items()}
    b2 = betas[1]
    for t, g in enumerate(grads, start=1):
        b1 = betas[0] if moms is None else moms[t - 1]
        lr = lrs[t - 1]
        step_size = lr * math.sqrt(1 - b2**t) / (1 - b1**t) if bias_correction else lr
        for n in ps:
            p, m, v, gr = ps[n], ms[n], vs[n], g[n]
            m.copy_(b1 * m + (1 - b1) * gr)
            v.copy_(b2 * v + (1 - b2) * gr * gr)
            denom = torch.sqrt(v + eps) if eps_inside_sqrt else torch.sqrt(v) + eps
            update = m / denom + weight_decay * p
            w_norm = float(torch.sqrt((p * p).sum()))
            u_norm = float(torch.sqrt((update * update).sum()))
            coeff = 1.0
            if w_norm != 0 and u_norm != 0:
                coeff = min(max(w_norm / u_norm, min_coeff), max_coeff)
            p.copy_(p - step_size * coeff * update)
    return ps


# -- hyper-parameter strategies ---------------------------------------------------------------

beta_st = st.floats(0.0, 0.99)
adam_hp = st.fixed_dictionaries(
    {
        "lr": st.floats(1e-4, 1e-1),
        "betas": st.tuples(beta_st, st.floats(0.5, 0.999)),
        "eps": st.sampled_from([1e-8, 1e-6, 1e-3]),
        "weight_decay": st.sampled_from([0.0, 0.01, 0.3]),
    }
)


def maybe_moms(data, steps, lo=0.5, hi=0.95):
    if not data.draw(st.booleans(), label="momentum override"):
        return None
    return [lo + (hi - lo) * (0.5 + 0.5 * math.cos(0.1 * k)) for k in range(steps)]


STEPS = 100


@pytest.mark.parametrize("w_mode", [True, False], ids=["adamw", "adam_l2"])
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "foreach"])
@SETTINGS
@given(data=st.data(), shapes=shapes_st, dtype=dtype_st, hp=adam_hp)
def test_adam_matches_torch(w_mode, fused, data, shapes, dtype, hp):
    bias_correction = data.draw(st.booleans(), label="bias_correction") if not fused else True
    moms = maybe_moms(data, STEPS) if bias_correction else None
    params, grads = make_problem(shapes, dtype, STEPS)
    lrs = lrs_for(hp["lr"], STEPS)
    opt = optim.adam(**hp, adam_w_mode=w_mode, bias_correction=bias_correction, _allow_fused=fused)
    got, state = run_fnzero(opt, params, grads, lrs, moms, inplace=data.draw(st.booleans(), label="inplace"))
    assert int(state.count) == STEPS
    if bias_correction:
        cls = torch.optim.AdamW if w_mode else torch.optim.Adam
        want = run_torch(cls, dict(betas=hp["betas"], eps=hp["eps"], weight_decay=hp["weight_decay"]), params, grads, lrs, moms, "betas")
    else:
        want = adam_no_bias_correction_reference(params, grads, lrs, hp, w_mode)
    assert_trees_close(got, want)


def adam_no_bias_correction_reference(params, grads, lrs, hp, w_mode):
    b1, b2 = hp["betas"]
    ps = {k: v.clone() for k, v in params.items()}
    ms = {k: torch.zeros_like(v) for k, v in params.items()}
    vs = {k: torch.zeros_like(v) for k, v in params.items()}
    for k, g in enumerate(grads):
        for n in ps:
            gr = g[n] if w_mode else g[n] + hp["weight_decay"] * ps[n]
            if w_mode:
                ps[n] = ps[n] * (1 - lrs[k] * hp["weight_decay"])
            ms[n] = b1 * ms[n] + (1 - b1) * gr
            vs[n] = b2 * vs[n] + (1 - b2) * gr * gr
            ps[n] = ps[n] - lrs[k] * ms[n] / (vs[n].sqrt() + hp["eps"])
    return ps


@SETTINGS
@given(data=st.data(), shapes=shapes_st, dtype=dtype_st, lr=st.floats(1e-4, 1e-1),
       momentum=st.sampled_from([0.0, 0.5, 0.9]), dampening=st.sampled_from([0.0, 0.3]),
       weight_decay=st.sampled_from([0.0, 0.01]), nesterov=st.booleans())
def test_sgd_matches_torch(data, shapes, dtype, lr, momentum, dampening, weight_decay, nesterov):
    if nesterov and (momentum == 0.0 or dampening != 0.0):
        nesterov = False
    moms = maybe_moms(data, STEPS) if momentum > 0 else None
    params, grads = make_problem(shapes, dtype, STEPS)
    lrs = lrs_for(lr, STEPS)
    kw = dict(momentum=momentum, dampening=dampening, weight_decay=weight_decay, nesterov=nesterov)
    got, _ = run_fnzero(optim.sgd(lr=lr, **kw), params, grads, lrs, moms, inplace=data.draw(st.booleans()))
    want = run_torch(torch.optim.SGD, kw, params, grads, lrs, moms, "momentum")
    assert_trees_close(got, want)


@SETTINGS
@given(data=st.data(), shapes=shapes_st, dtype=dtype_st, lr=st.floats(1e-3, 1e-1),
       eps=st.sampled_from([1e-10, 1e-6]), weight_decay=st.sampled_from([0.0, 0.01]),
       lr_decay=st.sampled_from([0.0, 0.01]), init=st.sampled_from([0.0, 0.1]))
def test_adagrad_matches_torch(data, shapes, dtype, lr, eps, weight_decay, lr_decay, init):
    params, grads = make_problem(shapes, dtype, STEPS)
    lrs = lrs_for(lr, STEPS)
    kw = dict(eps=eps, weight_decay=weight_decay, lr_decay=lr_decay, initial_accumulator_value=init)
    got, _ = run_fnzero(optim.adagrad(lr=lr, **kw), params, grads, lrs, inplace=data.draw(st.booleans()))
    want = run_torch(torch.optim.Adagrad, kw, params, grads, lrs)
    assert_trees_close(got, want)


@SETTINGS
@given(data=st.data(), shapes=shapes_st, dtype=dtype_st, lr=st.floats(1e-4, 1e-2),
       betas=st.tuples(beta_st, beta_st), weight_decay=st.sampled_from([0.0, 0.1]))
def test_lion_matches_reference(data, shapes, dtype, lr, betas, weight_decay):
    moms = maybe_moms(data, STEPS)
    params, grads = make_problem(shapes, dtype, STEPS)
    lrs = lrs_for(lr, STEPS)
    got, _ = run_fnzero(optim.lion(lr=lr, betas=betas, weight_decay=weight_decay), params, grads, lrs, moms,
                        inplace=data.draw(st.booleans()))
    assert_trees_close(got, run_lion_reference(params, grads, lrs, betas, weight_decay, moms))


@SETTINGS
@given(data=st.data(), shapes=shapes_st, dtype=dtype_st, hp=adam_hp, bias_correction=st.booleans(),
       coeffs=st.sampled_from([(10.0, 0.01), (1.0, 0.5), (0.2, 0.0)]), eps_inside_sqrt=st.booleans())
def test_lamb_matches_deepspeed_reference(data, shapes, dtype, hp, bias_correction, coeffs, eps_inside_sqrt):
    moms = maybe_moms(data, STEPS)
    params, grads = make_problem(shapes, dtype, STEPS)
    lrs = lrs_for(hp["lr"], STEPS)
    kw = dict(betas=hp["betas"], eps=hp["eps"], weight_decay=hp["weight_decay"], bias_correction=bias_correction,
              max_coeff=coeffs[0], min_coeff=coeffs[1], eps_inside_sqrt=eps_inside_sqrt)
    opt = optim.lamb(lr=hp["lr"], **kw)
    assert opt.elementwise is False
    got, _ = run_fnzero(opt, params, grads, lrs, moms, inplace=data.draw(st.booleans()))
    assert_trees_close(got, run_lamb_reference(params, grads, lrs, moms=moms, **kw))


# -- purity, the in-place path, slicing ------------------------------------------------------

ALL = {
    "adamw": lambda: optim.adamw(lr=1e-2, weight_decay=0.1),
    "adam_l2": lambda: optim.adam(lr=1e-2, weight_decay=0.1, adam_w_mode=False),
    "adam_foreach": lambda: optim.adam(lr=1e-2, weight_decay=0.1, _allow_fused=False),
    "adam_nobc": lambda: optim.adam(lr=1e-2, bias_correction=False),
    "sgd": lambda: optim.sgd(lr=1e-2, momentum=0.9, weight_decay=0.1, nesterov=True),
    "sgd_plain": lambda: optim.sgd(lr=1e-2),
    "adagrad": lambda: optim.adagrad(lr=1e-2, weight_decay=0.1, lr_decay=0.1),
    "lamb": lambda: optim.lamb(lr=1e-2, weight_decay=0.1),
    "lion": lambda: optim.lion(lr=1e-2, weight_decay=0.1),
}
ELEMENTWISE = [k for k in ALL if k != "lamb"]


def snapshot(tree):
    return optree.tree_map(lambda t: t.clone(), tree)


def assert_trees_equal(a, b):
    la, ta = optree.tree_flatten(a)
    lb, tb = optree.tree_flatten(b)
    assert ta == tb
    for x, y in zip(la, lb):
        assert x.dtype == y.dtype and torch.equal(x, y)


@pytest.mark.parametrize("name", list(ALL))
@settings(max_examples=15, deadline=None, derandomize=True)
@given(shapes=shapes_st, dtype=dtype_st)
def test_update_is_pure_and_update_inplace_agrees(name, shapes, dtype):
    opt = ALL[name]()
    params, grads = make_problem(shapes, dtype, 3)
    state = opt.init(params)
    for g in grads[:2]:  # a non-trivial state first
        params, state = opt.update(g, state, params, None)
    g = grads[2]
    before = snapshot((params, state, g))
    out1 = opt.update(g, state, params, 0.02)
    assert_trees_equal((params, state, g), before)  # inputs untouched
    out2 = opt.update(g, state, params, 0.02)
    assert_trees_equal(out1, out2)  # deterministic
    # No output aliases an input.
    ins = {t.data_ptr() for t in optree.tree_leaves((params, state)) if t.numel()}
    assert not any(t.data_ptr() in ins for t in optree.tree_leaves(out1) if t.numel())
    # update_ writes into the buffers it was given and returns them; grads stay untouched.
    p_, s_ = snapshot((params, state))
    p_leaves = optree.tree_leaves(p_)
    new_p, new_s = opt.update_(g, s_, p_, 0.02)
    assert new_p is p_ and new_s is s_
    assert all(a is b for a, b in zip(optree.tree_leaves(new_p), p_leaves))
    assert_trees_equal(g, before[2])
    assert_trees_equal((new_p, new_s), out1)
    for p, leaf in zip(optree.tree_leaves(params), optree.tree_leaves(out1[0])):
        assert leaf.dtype == p.dtype
    assert out1[1].count.dtype == torch.int64 and out1[1].count.dim() == 0 and int(out1[1].count) == 3


ALL["sgd_damped"] = lambda: optim.sgd(lr=1e-2, momentum=0.8, dampening=0.3)
MOMENTUM = {"adamw", "adam_l2", "adam_foreach", "adam_nobc", "lion", "sgd", "sgd_damped"}  # take an override


def run_graph_update(opt, params, grads, lrs, moms=None):
    """`graph_update` driven as the whole-step graph drives it: 0-dim float64 scalars; it advances
    the count itself, as `update` does."""
    state = opt.init(params)
    f64 = lambda x: torch.tensor(float(x), dtype=torch.float64)  # noqa: E731
    for i, (g, lr) in enumerate(zip(grads, lrs)):
        mom = None if moms is None else f64(moms[i])
        params, state = opt.graph_update(g, state, params, f64(lr), momentum=mom)
    return params, state


@pytest.mark.parametrize("name", ELEMENTWISE + ["sgd_damped"])
@settings(max_examples=15, deadline=None, derandomize=True)
@given(shapes=shapes_st, dtype=dtype_st, with_momentum=st.booleans())
def test_graph_update_matches_update(name, shapes, dtype, with_momentum):
    """The traceable update (fnzero.jit scope="step") computes the same step as `update`: a
    moving lr, bias corrections from the tensor step number, and a OneCycle momentum."""
    opt = ALL[name]()
    assert opt.graph_update is not None
    params, grads = make_problem(shapes, dtype, 6)
    lrs = lrs_for(1e-2, 6)
    moms = [0.85 + 0.01 * i for i in range(6)] if with_momentum and name in MOMENTUM else None
    want, want_state = run_fnzero(opt, params, grads, lrs, moms)
    got, got_state = run_graph_update(opt, params, grads, lrs, moms)
    tol = 1e-12 if dtype == torch.float64 else 2e-6
    assert_trees_close(got, want, rtol=tol, atol=tol)
    assert_trees_close(got_state, want_state, rtol=tol, atol=tol)


def test_graph_update_compiles_once_for_every_lr():
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    opt = optim.adamw(lr=1e-2, weight_decay=0.1)
    params, grads = make_problem([(3, 4), (5,)], torch.float64, 4)
    torch._dynamo.reset()
    try:
        compiled = torch.compile(opt.graph_update, backend=backend, fullgraph=True)
        state = opt.init(params)
        for i, g in enumerate(grads):
            lr = torch.tensor(1e-2 * (i + 1), dtype=torch.float64)
            params, state = compiled(g, state, params, lr)
    finally:
        torch._dynamo.reset()
    assert len(graphs) == 1


def test_lamb_has_no_graph_update():
    # Its trust ratio is per tensor; the whole-step graph falls back to the compiled loss for it.
    assert optim.lamb().graph_update is None


@pytest.mark.parametrize("name", ELEMENTWISE)
@settings(max_examples=15, deadline=None, derandomize=True)
@given(shapes=st.lists(shape_st, min_size=1, max_size=4), dtype=dtype_st)
def test_elementwise_slicing_invariance(name, shapes, dtype):
    """Updating the flat concatenation equals updating the pieces: a ZeRO shard boundary may
    fall anywhere inside a flattened parameter."""
    opt = ALL[name]()
    assert opt.elementwise
    params, grads = make_problem(shapes, dtype, 10)
    flat = lambda tree: [torch.cat([t.reshape(-1) for t in tree.values()])]
    got_pieces, _ = run_fnzero(opt, params, grads, [0.01] * 10)
    got_flat, _ = run_fnzero(opt, flat(params), [flat(g) for g in grads], [0.01] * 10)
    assert_trees_close(flat(got_pieces), got_flat, rtol=1e-6, atol=1e-7)


def test_lamb_is_per_tensor():
    opt = optim.lamb(lr=0.1)
    params, grads = make_problem([(4,), (3,)], torch.float64, 2, seed=3)
    pieces, _ = run_fnzero(opt, params, grads, [0.1, 0.1])
    cat = lambda tree: [torch.cat([t.reshape(-1) for t in tree.values()])]
    whole, _ = run_fnzero(opt, cat(params), [cat(g) for g in grads], [0.1, 0.1])
    assert not torch.allclose(cat(pieces)[0], whole[0])


def test_fused_kernel_is_used_only_where_it_applies(monkeypatch):
    calls = []
    real = torch._fused_adamw_
    monkeypatch.setattr(torch, "_fused_adamw_", lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    params, grads = make_problem([(3, 4), (5,)], torch.float32, 1)
    optim.adamw().update(grads[0], optim.adamw().init(params), params, None)
    assert len(calls) == 1
    optim.adamw(bias_correction=False).update(grads[0], optim.adamw().init(params), params, None)
    optim.adamw(_allow_fused=False).update(grads[0], optim.adamw().init(params), params, None)
    strided = {"a": torch.randn(4, 6)[:, ::2]}
    # (update's private copy of a strided view is dense, so only update_ sees the view itself)
    optim.adamw().update_({"a": torch.randn(4, 3)}, optim.adamw().init(strided), strided, None)
    assert len(calls) == 1
    want, _ = optim.adamw(_allow_fused=False).update({"a": torch.ones(4, 3)}, optim.adamw().init(strided), strided, 0.1)
    view = strided["a"]
    got, _ = optim.adamw().update_({"a": torch.ones(4, 3)}, optim.adamw().init(strided), strided, 0.1)
    assert got["a"] is view and torch.equal(view, want["a"])


def test_empty_and_none_pytrees():
    for params in ({}, [], (), {"a": None, "b": []}):
        for name in ALL:
            opt = ALL[name]()
            state = opt.init(params)
            new_params, state = opt.update(params, state, params, None)
            assert optree.tree_structure(new_params) == optree.tree_structure(params)
            new_params, state = opt.update_(params, state, new_params, 0.1)
            assert int(state.count) == 2


def test_grads_of_another_dtype_and_params_requiring_grad():
    params = {"w": torch.randn(3, 2, requires_grad=True)}
    grads = {"w": torch.randn(3, 2).to(torch.bfloat16)}
    opt = optim.adamw(lr=0.1)
    new, _ = opt.update(grads, opt.init(params), params, None)
    ref, _ = opt.update({"w": grads["w"].float()}, opt.init(params), params, None)
    assert new["w"].dtype == torch.float32 and not new["w"].requires_grad
    assert torch.equal(new["w"], ref["w"])
    new, _ = opt.update_(grads, opt.init(params), params, None)  # in place on a leaf requiring grad
    assert new["w"] is params["w"]


def test_structure_mismatch_and_bad_overrides():
    opt = optim.adamw()
    params = {"a": torch.zeros(2)}
    with pytest.raises(ValueError, match="tree structure"):
        opt.update({"b": torch.zeros(2)}, opt.init(params), params, None)
    with pytest.raises(ValueError, match="shape"):
        opt.update({"a": torch.zeros(3)}, opt.init(params), params, None)
    with pytest.raises(ConfigError, match=r"adamw: momentum=1.5 must be in \[0, 1\)"):
        opt.update(params, opt.init(params), params, None, momentum=1.5)
    plain = optim.sgd()
    with pytest.raises(ValueError, match="momentum override"):
        plain.update(params, plain.init(params), params, None, momentum=0.9)
    plain.update(params, plain.init(params), params, None, momentum=0.0)
    ada = optim.adagrad()
    with pytest.raises(ValueError, match="no momentum"):
        ada.update(params, ada.init(params), params, None, momentum=0.9)


# -- validation and from_config ----------------------------------------------------------------


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: optim.adamw(betas=(0.9, 1.5)), r"^adamw: betas\[1\]=1.5 must be in \[0, 1\)$"),
        (lambda: optim.adam(betas=(-0.1, 0.9)), r"^adam: betas\[0\]=-0.1 must be in \[0, 1\)$"),
        (lambda: optim.adam(betas=(0.9,)), r"betas=\(0.9,\) must be a pair"),
        (lambda: optim.adam(lr=-1.0), r"^adam: lr=-1.0 must be >= 0$"),
        (lambda: optim.adam(lr=float("nan")), r"^adam: lr=nan must be >= 0$"),
        (lambda: optim.adam(eps="1e-8"), r"adam: eps='1e-8' must be a number"),
        (lambda: optim.adam(weight_decay=-0.1), r"weight_decay=-0.1"),
        (lambda: optim.adam(amsgrad=True), r"adam: amsgrad=True is not supported"),
        (lambda: optim.adam(wieght_decay=0.1), r"adam: unknown parameter 'wieght_decay'"),
        (lambda: optim.adam(bias_correction=1), r"bias_correction=1 must be true or false"),
        (lambda: optim.sgd(momentum=-0.5), r"^sgd: momentum=-0.5 must be >= 0$"),
        (lambda: optim.sgd(dampening=2.0), r"^sgd: dampening=2.0 must be in \[0, 1\]$"),
        (lambda: optim.sgd(nesterov=True), r"nesterov=True needs momentum > 0"),
        (lambda: optim.sgd(momentum=0.9, dampening=0.1, nesterov=True), r"nesterov=True needs"),
        (lambda: optim.adagrad(lr_decay=-1), r"adagrad: lr_decay=-1"),
        (lambda: optim.adagrad(initial_accumulator_value=-1), r"initial_accumulator_value=-1"),
        (lambda: optim.lamb(min_coeff=2.0, max_coeff=1.0), r"^lamb: min_coeff=2.0 must be in \[0, 1\]$"),
        (lambda: optim.lamb(max_grad_norm=1.0), r"gradient_clipping"),
        (lambda: optim.lion(betas=(1.0, 0.99)), r"^lion: betas\[0\]=1.0 must be in \[0, 1\)$"),
        (lambda: optim.lion(maximize=True), r"lion: maximize=True is not supported"),
    ],
)
def test_bad_hyper_parameters_are_named(make, message):
    with pytest.raises(ConfigError, match=message):
        make()


def test_deepspeed_implementation_flags_are_accepted():
    # Flags that choose DeepSpeed's implementation, not the arithmetic: accepted, same update.
    p = {"w": torch.linspace(-1, 1, 7, dtype=torch.float64)}
    g = {"w": torch.linspace(0.5, -0.3, 7, dtype=torch.float64)}

    def one_step(opt):
        return opt.update(g, opt.init(p), p, 1e-2)[0]["w"]

    pairs = [
        (optim.adam(torch_adam=True, fused=True, fp32_optimizer_states=True, amsgrad=False, set_grad_none=True),
         optim.adam()),
        (optim.adamw(adam_w_mode=False, weight_decay=0.1), optim.adamw(weight_decay=0.1)),  # decoupled regardless
        (optim.sgd(foreach=None, differentiable=False, maximize=False), optim.sgd()),
        (optim.lamb(amsgrad=False, max_grad_norm=0.0), optim.lamb()),
    ]
    for flagged, plain in pairs:
        assert torch.equal(one_step(flagged), one_step(plain))
    assert not torch.equal(one_step(optim.adam()), p["w"])  # the step does move the parameter


class _Params:
    """A stand-in for the config layer's pydantic params model."""

    def __init__(self, **kw):
        self._kw = kw

    def model_dump(self):
        return dict(self._kw)


@pytest.mark.parametrize("type_", ["Adam", "adamw", "SGD", "adagrad", "LAMB", "Lion"])
def test_from_config_builds_each_type(type_):
    params = {"lr": 0.05}
    cfg = NS(optimizer=NS(type=type_, params=_Params(**params, weight_decay=0.0)))
    opt = optim.from_config(cfg)
    assert opt.elementwise == (type_.lower() != "lamb")
    p = {"w": torch.ones(3)}
    new, _ = opt.update({"w": torch.ones(3)}, opt.init(p), p, None)  # factory lr from the config
    assert not torch.equal(new["w"], p["w"])


def test_from_config_passes_params_and_checks_them():
    cfg = NS(optimizer=NS(type="Adam", params=_Params(lr=0.1, betas=[0.8, 0.9], eps=1e-8, weight_decay=0.1,
                                                       adam_w_mode=False, bias_correction=True, amsgrad=False,
                                                       torch_adam=False, fp32_optimizer_states=True)))
    opt = optim.from_config(cfg)
    p, g = make_problem([(3,)], torch.float64, 5)
    got, _ = run_fnzero(opt, p, g, [0.1] * 5)
    want = run_torch(torch.optim.Adam, dict(betas=(0.8, 0.9), weight_decay=0.1), p, g, [0.1] * 5)
    assert_trees_close(got, want)
    with pytest.raises(ConfigError, match=r"betas\[1\]=1.5"):
        optim.from_config(NS(optimizer=NS(type="AdamW", params={"betas": (0.9, 1.5)})))
    with pytest.raises(ConfigError, match="no `optimizer` block"):
        optim.from_config(NS(optimizer=None))
    with pytest.raises(ConfigError, match="MuAdam.*not supported"):
        optim.from_config(NS(optimizer=NS(type="MuAdam", params={})))
