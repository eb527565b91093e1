"""MiCS (`zero_optimization.mics_shard_size`, `specs/mesh.md §MiCS`) and ZeRO++'s hpZ
(`zero_hpz_partition_size`, `specs/mesh.md §hpZ`) on simulated worlds of 4 ranks: equal to plain
torch in float64, their collectives counted per group, their memory exact, bad sizes refused.

The reference is plain torch on one process: the global batch of every rank's micro-batches,
each chunk weighted 1 / (ranks x accumulation) as DDP weighs it, AdamW, clip_grad_norm_.
"""

from __future__ import annotations

import collections

import pytest
import torch
import torch.nn.functional as F

import fnzero
from fnzero import ConfigError
from fnzero.testing import GPT, seeded, simulated_world

# MiCS's keys load with a ConfigWarning that DeepSpeed 0.19.8 removed them (tested in test_mics_config_keys).
pytestmark = pytest.mark.filterwarnings("ignore:.*DeepSpeed 0.19.8 refuses this key:fnzero.config.ConfigWarning")

WORLD, VOCAB, SEQ, HIDDEN, ACCUM, STEPS, LR, CLIP, MICRO = 4, 64, 8, 16, 2, 3, 1e-2, 0.5, 2


def _model(dtype=torch.float64) -> GPT:
    with seeded(0):
        return GPT(vocab_size=VOCAB, seq_len=SEQ, d_model=HIDDEN, n_layer=2, n_head=2).to(dtype)


def _loss(apply, batch):
    logits = apply(batch[:, :-1])
    return F.cross_entropy(logits.flatten(0, 1).double(), batch[:, 1:].flatten())


def _chunk(step: int, i: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (MICRO, SEQ + 1), generator=torch.Generator().manual_seed(1000 * step + i))


def _config(stage: int, **zero):
    return fnzero.load_config({
        "train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": ACCUM, "gradient_clipping": CLIP,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "betas": [0.9, 0.95], "weight_decay": 0.1}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0, **zero},
    }, world_size=WORLD)


def _reference() -> dict[str, torch.Tensor]:
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    for s in range(STEPS):
        opt.zero_grad()
        for i in range(WORLD * ACCUM):
            (_loss(model, _chunk(s, i)) / (WORLD * ACCUM)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _train(stage: int, **zero):
    cfg = _config(stage, **zero)

    def rank(comm):
        sm = fnzero.shard(_model(), config=cfg, comm=comm)
        state = sm.init_state()
        step = fnzero.train_step(lambda p, b: _loss(lambda x: sm.apply(p, x), b), cfg)
        for s in range(STEPS):
            state, metrics = step(state, [_chunk(s, comm.rank * ACCUM + i) for i in range(ACCUM)])
        return sm.gather(state)

    return simulated_world(WORLD).run(rank)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_mics_equals_plain_torch(stage):
    want = _reference()
    for got in _train(stage, mics_shard_size=2):
        for name in want:
            torch.testing.assert_close(got[name], want[name], rtol=1e-9, atol=1e-12, msg=name)
