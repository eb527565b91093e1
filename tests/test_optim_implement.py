"""The one lookup from an optimizer to what runs it (`fnzero.optim.implementation`), and the
capabilities the step asks an implementation for (specs/optim.md §One protocol)."""

import torch

import fnzero
from fnzero import optim


def _cfg(kind, **params):
    return fnzero.load_config({"train_batch_size": 1, "optimizer": {"type": kind, "params": params}})


def _step(opt):
    params = {"w": torch.linspace(-1, 1, 7, dtype=torch.float32)}
    grads = {"w": torch.linspace(0.3, -0.2, 7, dtype=torch.float32)}
    state = opt.init(params)
    for _ in range(3):
        params, state = opt.update(grads, state, params, 1e-2)
    return params["w"]


def test_the_config_block_runs_its_fused_kernels_and_a_chain_its_own_arithmetic():
    cfg = _cfg("AdamW", lr=1e-2, weight_decay=0.1)
    block = optim.config_optimizer(cfg, model=None)
    # The same kernels as before the lookup existed: bit for bit, on the device and on the host.
    assert torch.equal(_step(optim.implementation(block)), _step(optim.from_config(cfg)))
    assert torch.equal(_step(optim.implementation(block, on_host=True)), _step(optim.host_from_config(cfg)))
    tx = optim.chain_from_config(cfg)
    run = optim.implementation(tx)
    assert run.transform is tx and run.traceable  # never replaced by the fused kernel
    fused = optim.adamw(lr=1e-2)
    assert optim.implementation(fused) is fused


def test_capabilities_are_declared_on_the_implementation():
    assert optim.adam().traceable and optim.adam().elementwise and not optim.adam().exchanges_gradients
    assert not optim.lamb().traceable and not optim.lamb().elementwise
    assert optim.onebit_adam().exchanges_gradients
    assert optim.muon().transform is not None and not optim.muon().elementwise
