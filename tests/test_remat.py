"""Activation checkpointing (fnzero.remat) gives the same gradients with and without it, at every
stage, including stage 3 where the recomputation re-gathers parameters."""

import pytest
import torch
import torch.nn.functional as F

import fnzero
from fnzero.testing import GPT
from fnzero.testing._threads import simulated_world


def _train(stage, use_remat, world=2, steps=3, cpu_offload=False):
    def rank_fn(comm):
        with _LOCK:
            torch.manual_seed(0)
            model = GPT(vocab_size=31, seq_len=8, d_model=12, n_layer=2, n_head=2).double()
        if use_remat:
            for block in model.blocks:
                block.forward = fnzero.remat(block.forward, cpu_offload=cpu_offload)
        cfg = fnzero.load_config({"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 1.0,
                                  "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
                                  "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}},
                                 world_size=world)
        sm = fnzero.shard(model, config=cfg, comm=comm)
        state = sm.init_state()
        step = fnzero.train_step(lambda p, b: F.cross_entropy(sm.apply(p, b).flatten(0, 1), b.flatten()), cfg)
        g = torch.Generator().manual_seed(comm.rank)
        for _ in range(steps):
            state, m = step(state, torch.randint(0, 31, (2, 8), generator=g))
        return sm.gather(state)

    return simulated_world(world).run(rank_fn)[0]


import threading  # noqa: E402

_LOCK = threading.Lock()


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_remat_changes_nothing_but_memory(stage):
    plain = _train(stage, use_remat=False)
    remat = _train(stage, use_remat=True)
    for name in plain:
        torch.testing.assert_close(remat[name], plain[name], rtol=1e-12, atol=1e-14)


def test_cpu_checkpointing_flag_from_config():
    cfg = fnzero.load_config({"train_micro_batch_size_per_gpu": 1, "activation_checkpointing": {"cpu_checkpointing": True}})
    f = fnzero.remat(lambda x: (x * x).sum(), config=cfg)
    x = torch.ones(3, requires_grad=True)
    f(x).backward()
    assert torch.equal(x.grad, 2 * torch.ones(3))
    plain = _train(3, use_remat=False)
    offl = _train(3, use_remat=True, cpu_offload=True)
    for name in plain:
        torch.testing.assert_close(offl[name], plain[name], rtol=1e-12, atol=1e-14)
