"""Testing your own model's sharded training with fnzero.testing.

    python -m pytest examples/test_my_model.py        (from the repo root; ~10-20 s on 2 CPU cores)

`TinyLM` stands for your model and `lm_loss` for your loss. The tests check that every ZeRO stage,
on 1-8 simulated ranks, trains exactly like one process on the whole batch; that the training step
is pure; that checkpoints reshard; and how many bytes a step sends. Nothing here needs a launcher,
a port or a GPU: the ranks are threads of this process (`ft.simulated_world`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import fnzero
import fnzero.testing as ft

torch.set_num_threads(1)  # the simulated ranks are threads already; intra-op threads only contend


# -- the code under test ------------------------------------------------------------------------------
class TinyLM(nn.Module):
    """Your model. Any nn.Module works; build it with plain torch, no fnzero imports."""

    def __init__(self, vocab=64, d=16):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.mix = nn.Sequential(nn.Linear(d, 3 * d), nn.GELU(), nn.Linear(3 * d, d))
        self.norm = nn.LayerNorm(d)
        self.out = nn.Linear(d, vocab, bias=False)
        self.out.weight = self.emb.weight  # tied, as many LMs are

    def forward(self, idx):
        h = self.emb(idx)
        return self.out(self.norm(h + self.mix(h)))


def lm_loss(apply, batch):
    """Your loss, written against `apply(*inputs)`: it runs on a plain model (`lm_loss(model, b)`)
    and, through `ft.step_loss(sm, lm_loss)`, inside fnzero.train_step. A mean over rows."""
    logits = apply(batch["x"])
    return F.cross_entropy(logits.flatten(0, -2), batch["y"].flatten())


def train(steps=3, stage=3):
    """Your training script as you would launch it with `fnzero launch`: no rank, no comm."""
    info = fnzero.init_distributed()
    cfg = fnzero.load_config(
        {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
         "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}},
        world_size=info.world_size,  # pass it: load_config cannot see a simulated world's size
    )
    with ft.seeded(0):  # identical weights on every rank (simulated ranks share torch's RNG)
        model = TinyLM().double()
    sm = fnzero.shard(model, config=cfg)
    state = sm.init_state()
    step = fnzero.train_step(ft.step_loss(sm, lm_loss), cfg)
    b = next(ft.token_batches(2, 12, seed=info.rank))  # each rank its own rows of real text
    batch = {"x": b["x"] % 64, "y": b["y"] % 64}
    losses = []
    for _ in range(steps):
        state, metrics = step(state, batch)
        losses.append(metrics["loss"])
    return losses


# -- the tests ----------------------------------------------------------------------------------------
# Hypothesis settings for a fast suite: a handful of drawn cases per test, no per-example deadline
# (a simulated world of 8 threads on a shared CI core can take a second).
FAST = settings(max_examples=8, deadline=None)


@FAST
@given(cfg=ft.configs(stages=[0, 1, 2, 3], accumulation=[1, 2]), world=ft.world_sizes(1, 8),
       batch=ft.batches(vocab=64, seq=12, rows=st.integers(1, 6)))
def test_my_model_shards_cleanly(cfg, world, batch):
    """Every stage on `world` ranks == one process on the whole batch (float64, 1e-9)."""
    ft.assert_stage_equivalent(TinyLM, lm_loss, cfg, batch, world_size=world, steps=3)


@FAST
@given(cfg=ft.configs(stages=[1, 3], precisions=["bf16"]), world=ft.world_sizes(2, 4),
       batch=ft.batches(vocab=64, seq=12, rows=4))
def test_my_model_in_bf16(cfg, world, batch):
    """16-bit training: losses within bf16 rounding of the one-process run."""
    ft.assert_stage_equivalent(TinyLM, lm_loss, cfg, batch, world_size=world, steps=2)


def test_my_training_script_runs_on_four_ranks():
    """The launcher-style script, unchanged, on 4 ranks: every rank reports the same global loss,
    and it falls (the same batch every step)."""
    with ft.simulated_world(4) as world:
        losses = world.run(lambda: train(steps=5))
    assert all(rank_losses == losses[0] for rank_losses in losses)
    assert losses[0][-1] < losses[0][0]


@FAST
@given(save=ft.world_sizes(1, 4), load=ft.world_sizes(1, 4), stages=st.tuples(st.integers(0, 3), st.integers(0, 3)))
def test_my_checkpoints_reshard(save, load, stages):
    cfg = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW"},
           "zero_optimization": {"stage": stages[0], "stage3_param_persistence_threshold": 0}}
    batch = {"x": torch.randint(0, 64, (4, 12)), "y": torch.randint(0, 64, (4, 12))}
    ft.assert_reshard_roundtrip(TinyLM, cfg, save, load, load_stage=stages[1], loss_fn=lm_loss, batch=batch)


def _batch(rows=2):
    """Token rows from a generator of their own: simulated ranks are threads sharing torch's global
    RNG, and a draw from it here could land between another rank's draws inside `ft.seeded` while
    that rank is still building its model (which then differs)."""
    g = torch.Generator().manual_seed(1)
    return {"x": torch.randint(0, 64, (rows, 12), generator=g), "y": torch.randint(0, 64, (rows, 12), generator=g)}


def test_my_step_is_pure_on_every_rank():
    def check():
        cfg = fnzero.load_config({"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW"},
                                  "zero_optimization": {"stage": 2}}, world_size=2)
        with ft.seeded(0):
            sm = fnzero.shard(TinyLM().double(), config=cfg)
        step = fnzero.train_step(ft.step_loss(sm, lm_loss), cfg)
        batch = _batch()
        ft.assert_pure(step, sm.init_state(), batch)

    ft.simulated_world(2).run(check)


def test_my_stage_2_sends_what_ddp_sends():
    """specs/collectives.md: stage 2 sends DDP's all-reduce bytes (as a reduce-scatter + all-gather)."""

    def bytes_sent():
        cfg = fnzero.load_config({"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW"},
                                  "zero_optimization": {"stage": 2}}, world_size=4)
        with ft.seeded(0):
            sm = fnzero.shard(TinyLM(), config=cfg)
        state = sm.init_state()
        step = fnzero.train_step(ft.step_loss(sm, lm_loss), cfg)
        batch = _batch()
        with ft.count_collectives(sm) as c:
            step(state, batch)
        grads = sum(u.padded_numel for u in sm.plan.units) * 4  # fp32 gradient bytes
        return c.ring_bytes("reduce_scatter") + c.ring_bytes("all_gather"), grads

    sent, grads = ft.simulated_world(4).run(bytes_sent)[0]
    assert sent == grads * 2 * 3 / 4  # a ring all-reduce of the gradients
