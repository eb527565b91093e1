"""Gradient transformations (specs/optim.md §Chains): every DeepSpeed optimizer name is a chain, and
its fused implementation computes the chain's step (one property test over all of them, float64,
moving lr and momentum, drawn hyper-parameters and shapes); a user's own chain runs in the sharded
step and equals the unsharded run."""

from __future__ import annotations

from types import SimpleNamespace as NS

import optree
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fnzero
from fnzero import optim
from fnzero.testing import MLP, simulated_world

shape_st = st.one_of(st.just(()), st.just((0,)), st.lists(st.integers(1, 6), min_size=1, max_size=2).map(tuple))

HYPER = {
    "adam": st.fixed_dictionaries({"weight_decay": st.sampled_from([0.0, 0.1]), "adam_w_mode": st.booleans(),
                                   "bias_correction": st.booleans(), "eps": st.sampled_from([1e-8, 1e-3])}),
    "adamw": st.fixed_dictionaries({"weight_decay": st.sampled_from([0.0, 0.1]), "bias_correction": st.booleans()}),
    "sgd": st.one_of(
        st.fixed_dictionaries({"momentum": st.sampled_from([0.0, 0.9]), "dampening": st.sampled_from([0.0, 0.3]),
                               "weight_decay": st.sampled_from([0.0, 0.05])}),
        st.fixed_dictionaries({"momentum": st.just(0.9), "nesterov": st.just(True)})),
    "adagrad": st.fixed_dictionaries({"weight_decay": st.sampled_from([0.0, 0.1]), "lr_decay": st.sampled_from([0.0, 0.2]),
                                      "initial_accumulator_value": st.sampled_from([0.0, 0.5])}),
    "lamb": st.fixed_dictionaries({"weight_decay": st.sampled_from([0.0, 0.1]), "bias_correction": st.booleans(),
                                   "eps_inside_sqrt": st.booleans(), "max_coeff": st.sampled_from([10.0, 0.5])}),
    "lion": st.fixed_dictionaries({"weight_decay": st.sampled_from([0.0, 0.1])}),
}
CYCLES_MOMENTUM = {"adam", "adamw", "lamb", "lion", "sgd"}


@settings(max_examples=60, deadline=None, derandomize=True)
@given(name=st.sampled_from(sorted(HYPER)), data=st.data(),  # Muon has no fused form: its optimizer is its chain
       shapes=st.lists(shape_st, min_size=1, max_size=3), momentum=st.booleans())
def test_every_fused_optimizer_computes_its_chain(name, data, shapes, momentum):
    hyper = data.draw(HYPER[name])
    cfg = NS(optimizer=NS(type=name, params={"lr": 1e-2, **hyper}))
    fused, tx = optim.from_config(cfg), optim.chain_from_config(cfg)
    chained = optim.as_optimizer(tx)
    assert fused.elementwise == tx.elementwise
    gen = torch.Generator().manual_seed(len(shapes))
    params = {f"p{i}": torch.randn(s, generator=gen, dtype=torch.float64) for i, s in enumerate(shapes)}
    moving = momentum and name in CYCLES_MOMENTUM and (name != "sgd" or hyper.get("momentum", 0.0) > 0)
    want, got = params, params
    s_want, s_got = fused.init(params), chained.init(params)
    for t in range(5):
        grads = {k: torch.randn(v.shape, generator=gen, dtype=torch.float64) for k, v in params.items()}
        lr, mom = 1e-2 * (1 + t) / 3, (0.85 + 0.02 * t if moving else None)
        want, s_want = fused.update(grads, s_want, want, lr, momentum=mom)
        got, s_got = chained.update(grads, s_got, got, lr, momentum=mom)
        for k in params:
            torch.testing.assert_close(got[k], want[k], rtol=1e-12, atol=1e-14, msg=lambda m: f"{name} {hyper} step {t} {k}: {m}")


def test_a_chain_is_pure_and_its_in_place_form_writes_the_given_buffers():
    opt = optim.as_optimizer(optim.adamw_chain(lr=0.1, weight_decay=0.1))
    params = {"w": torch.ones(3, dtype=torch.float64)}
    state = opt.init(params)
    before = optree.tree_map(torch.clone, (params, state))
    new, _ = opt.update({"w": torch.ones(3, dtype=torch.float64)}, state, params)
    assert all(torch.equal(a, b) for a, b in zip(optree.tree_leaves((params, state)), optree.tree_leaves(before)))
    same, _ = opt.update_({"w": torch.ones(3, dtype=torch.float64)}, state, params)
    assert same is params and torch.equal(params["w"], new["w"])


def test_clip_by_global_norm_reads_the_norm_it_is_given():
    """A shard cannot see the global norm; the step passes it, and the chain uses it as given."""
    tx = optim.clip_by_global_norm(1.0)
    g = {"w": torch.full((4,), 3.0, dtype=torch.float64)}  # its own norm is 6
    own, _ = tx.update(g, tx.init(g))
    given_, _ = tx.update(g, tx.init(g), global_norm=60.0)
    assert torch.allclose(own["w"], g["w"] / (6.0 + 1e-6)) and torch.allclose(given_["w"], g["w"] / (60.0 + 1e-6))
    unclipped, _ = tx.update(g, tx.init(g), global_norm=0.5)
    assert unclipped["w"] is g["w"]


def _cfg(stage):
    return fnzero.load_config({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
                               "gradient_clipping": 0.0, "zero_optimization": {"stage": stage}}, world_size=2)


def _user_chain():
    # A user's own optimizer: clipped by the step's global norm, then Adam's direction halved.
    return optim.chain(optim.clip_by_global_norm(0.5), optim.scale_by_adam(b1=0.8), optim.scale(0.5),
                       optim.add_decayed_weights(0.01), optim.scale_by_learning_rate(3e-2))


def _loss(model, params, batch):
    x, y = batch
    return torch.nn.functional.mse_loss(torch.func.functional_call(model, params, (x,)), y)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_a_users_chain_in_the_sharded_step_equals_the_unsharded_run(stage):
    """Sharded = unsharded in float64 for a chain the step knows nothing about: its lr, momentum
    and global norm arrive as the chain's extras, and the config's optimizer is not used."""
    torch.manual_seed(0)
    model = MLP([5, 7, 3]).double()
    x, y = torch.randn(8, 5, dtype=torch.float64), torch.randn(8, 3, dtype=torch.float64)
    ref = {n: p.detach().clone() for n, p in model.named_parameters()}
    tx = _user_chain()
    state = tx.init(ref)
    for _ in range(3):
        p = {n: t.clone().requires_grad_(True) for n, t in ref.items()}
        grads = dict(zip(p, torch.autograd.grad(_loss(model, p, (x, y)), list(p.values()))))
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads.values()]))
        upd, state = tx.update(grads, state, ref, global_norm=float(norm))
        ref = optim.apply_updates(ref, upd)

    def rank(comm):
        m = MLP([5, 7, 3]).double()
        m.load_state_dict(model.state_dict())
        sm = fnzero.shard(m, config=_cfg(stage), comm=comm)
        opt = optim.as_optimizer(_user_chain())
        st_ = sm.init_state(optimizer=opt)
        step = fnzero.train_step(lambda params, b: torch.nn.functional.mse_loss(sm.apply(params, b[0]), b[1]),
                                 _cfg(stage), optimizer=opt)
        rows = slice(4 * comm.rank, 4 * comm.rank + 4)
        for _ in range(3):
            st_, _ = step(st_, (x[rows], y[rows]))
        return sm.gather(st_)

    for got in simulated_world(2).run(rank):
        for n, want in ref.items():
            torch.testing.assert_close(got[n], want, rtol=1e-9, atol=1e-12)


HOST = {
    "adam": st.fixed_dictionaries({"weight_decay": st.sampled_from([0.0, 0.1]), "adam_w_mode": st.booleans(),
                                   "bias_correction": st.booleans()}),
    "adamw": st.fixed_dictionaries({"weight_decay": st.sampled_from([0.0, 0.1])}),
    "adagrad": st.fixed_dictionaries({"weight_decay": st.sampled_from([0.0, 0.1]), "lr_decay": st.sampled_from([0.0, 0.2])}),
    "lion": st.fixed_dictionaries({"weight_decay": st.sampled_from([0.0, 0.1])}),
}


@settings(max_examples=30, deadline=None, derandomize=True)
@given(name=st.sampled_from(sorted(HOST)), data=st.data(), sizes=st.lists(st.integers(1, 300), min_size=1, max_size=3))
def test_the_host_kernels_compute_the_chain(name, data, sizes):
    """ZeRO-Offload's host step (fnzero's C kernels; their torch fallback gives the same numbers,
    tests/test_cext_kernels.py) is a fused implementation of the same chain, with the same calling
    convention: flat fp32 shards, gradients scaled by the step first, a moving lr; fp32, so
    compared at fp32 precision."""
    hyper = data.draw(HOST[name])
    typ = {"adam": "Adam", "adamw": "AdamW", "adagrad": "Adagrad", "lion": "Lion"}[name]
    cfg = fnzero.load_config({"train_batch_size": 1, "optimizer": {"type": typ, "params": {"lr": 1e-2, **hyper}}})
    host, tx = optim.host_from_config(cfg), optim.chain_from_config(cfg)
    gen = torch.Generator().manual_seed(sum(sizes))
    master = {f"u{i}": torch.randn(n, generator=gen) for i, n in enumerate(sizes)}
    want, s_want = dict(master), tx.init(master)
    got, s_got = dict(master), host.init(master)
    assert optree.tree_structure(s_got) == optree.tree_structure(optim.from_config(cfg).init(master))
    for t in range(4):
        grads = {k: torch.randn(v.shape, generator=gen) for k, v in master.items()}
        lr, scale = 1e-2 * (1 + t) / 2, 0.5
        scaled = {k: g * scale for k, g in grads.items()}
        upd, s_want = tx.update(scaled, s_want, want, lr=lr)
        want = optim.apply_updates(want, upd)
        got, s_got = host.update(scaled, s_got, got, lr, global_norm=1.0)  # (extras are accepted and unused)
        for k in master:
            torch.testing.assert_close(got[k], want[k], rtol=2e-5, atol=2e-6,
                                       msg=lambda m: f"{name} {hyper} step {t} {k}: {m}")


def test_the_optim_docstring_examples_run():
    import doctest
    import importlib

    for name in ("", "._adam", "._sgd", "._adagrad", "._lamb", "._lion", "._transform", "._config", "._host"):
        module = importlib.import_module(f"fnzero.optim{name}")
        result = doctest.testmod(module)
        assert result.attempted and not result.failed, module.__name__
