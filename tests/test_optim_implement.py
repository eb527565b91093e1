"""The one lookup from a chain to what runs it (`fnzero.optim.implementation`): the implementations
a chain declares as data (`Implementations`), the config's chain declaring DeepSpeed's fused
kernels, and the capabilities the step asks an implementation for (specs/optim.md §One protocol)."""

import pytest
import torch

import fnzero
from fnzero import optim


def _cfg(kind, **params):
    return fnzero.load_config({"train_batch_size": 1, "optimizer": {"type": kind, "params": params}})


def _step(opt, steps=3):
    params = {"w": torch.linspace(-1, 1, 7, dtype=torch.float32)}
    grads = {"w": torch.linspace(0.3, -0.2, 7, dtype=torch.float32)}
    state = opt.init(params)
    for _ in range(steps):
        params, state = opt.update(grads, state, params, 1e-2)
    return params["w"]


def test_the_config_chain_declares_the_fused_kernels_on_the_device_and_the_c_kernels_on_the_host():
    """`chain_from_config` is the config's optimizer: it runs the kernels the config ran before the
    chain was the one protocol, bit for bit (torch's fused AdamW; fnzero's C AdamW on the host)."""
    cfg = _cfg("AdamW", lr=1e-2, weight_decay=0.1)
    tx = optim.chain_from_config(cfg)
    device, host = optim.implementation(tx), optim.implementation(tx, on_host=True)
    assert device.transform is None and host.transform is None  # fused, not the chain's arithmetic
    assert torch.equal(_step(device), _step(optim.adamw(lr=1e-2, weight_decay=0.1)))
    assert torch.equal(_step(host), _step(optim.host_optimizer("AdamW", lr=1e-2, weight_decay=0.1)))
    block = optim.config_optimizer(cfg, model=None)
    assert torch.equal(_step(optim.implementation(block.chain())), _step(device))
    with pytest.raises(fnzero.ConfigError, match="Adam, AdamW, Adagrad and Lion"):  # no host kernel for SGD
        optim.implementation(optim.chain_from_config(_cfg("SGD", lr=0.1)), on_host=True)


@pytest.mark.parametrize("on_host", [False, True])
def test_a_users_chain_declares_nothing_and_runs_its_own_arithmetic(on_host):
    """`adamw_chain(...)` called directly is a user's chain: never replaced by a fused kernel."""
    tx = optim.adamw_chain(lr=1e-2, weight_decay=0.1)
    run = optim.implementation(tx, on_host=on_host)
    assert tx.implementations is None and run.transform is tx and run.traceable
    assert torch.equal(_step(run), _step(optim.as_optimizer(tx)))
    fused = optim.adamw(lr=1e-2)
    assert optim.implementation(fused, on_host=on_host) is fused  # an Optimizer runs as it is
    with pytest.raises(TypeError, match="no implementation of a str"):
        optim.implementation("adamw")


@pytest.mark.parametrize("kind, factory, params", [
    ("Adam", optim.adam, {"lr": 1e-2, "weight_decay": 0.1, "adam_w_mode": False}),
    ("Lamb", optim.lamb, {"lr": 1e-2, "weight_decay": 0.1}),
    ("Lion", optim.lion, {"lr": 1e-3}),
    ("OneBitAdam", optim.onebit_adam, {"lr": 1e-2, "freeze_step": 10}),
    ("ZeroOneAdam", optim.zero_one_adam, {"lr": 1e-2}),
    ("OneBitLamb", optim.onebit_lamb, {"lr": 1e-2, "freeze_step": 10}),
])
def test_every_config_type_is_a_chain_whose_implementation_is_its_fused_optimizer(kind, factory, params):
    """The 1-bit types too: their chains declare their fused step and that they exchange their own
    gradients (one rank, before the freeze: no exchange needed)."""
    tx = optim.chain_from_config(_cfg(kind, **params))
    run, fused = optim.implementation(tx), factory(**params)
    caps = lambda o: (o.elementwise, o.exchanges_gradients)  # noqa: E731
    assert caps(run) == caps(fused) == caps(tx) and run.traceable == fused.traceable
    assert torch.equal(_step(run, 4), _step(fused, 4))


def test_a_onebit_chain_composes_and_keeps_its_capabilities():
    """A 1-bit chain's own update is its step as updates; in a chain it still says when it wants
    this rank's own gradients, and its own arithmetic cannot be traced."""
    tx = optim.onebit_adam_chain(lr=1e-2, freeze_step=2)
    assert tx.name == "onebit_adam_chain(lr=0.01, freeze_step=2)" and optim.not_elementwise(tx) == [tx.name]
    run = optim.as_optimizer(optim.chain(optim.scale(1.0), tx))
    assert run.exchanges_gradients and not run.traceable
    params = {"w": torch.linspace(-1, 1, 7)}
    state = run.init(params)
    for _ in range(2):  # step 1 initialises, step 2 averaged: then it compresses (count 2 = freeze_step)
        assert not run.local_gradients(state)
        params, state = run.update({"w": torch.full((7,), 0.3)}, state, params)
    assert run.local_gradients(state)
    want = _step(optim.onebit_adam(lr=1e-2, freeze_step=2), 2)
    torch.testing.assert_close(_step(run, 2), want, rtol=0, atol=1e-7)  # new - old + old: float32 rounding


def test_capabilities_are_declared_on_the_implementation():
    assert optim.adam().traceable and optim.adam().elementwise and not optim.adam().exchanges_gradients
    assert not optim.lamb().traceable and not optim.lamb().elementwise
    assert optim.onebit_adam().exchanges_gradients
    assert optim.muon().transform is not None and not optim.muon().elementwise
