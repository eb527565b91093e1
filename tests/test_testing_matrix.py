"""The full ZeRO stage x world size matrix through the toolkit (specs/testing.md §Matrix): every
stage 0-3 at every world size 1-8, on hypothesis-drawn models (awkward MLPs, GPTs with tied and
frozen weights), configs (accumulation, clipping) and batches (any row count), on the simulated
world. A few examples per cell keep the whole matrix to seconds; HYPOTHESIS_PROFILE=thorough
draws ten times as many."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

import fnzero
import fnzero.testing as ft

_SCALE = 1 if os.environ.get("HYPOTHESIS_PROFILE", "default") == "default" else 10


@pytest.mark.parametrize("world", range(1, 9))
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@settings(max_examples=3 * _SCALE)
@given(model=ft.models(), data=st.data(), rows=st.integers(1, 7), seed=st.integers(0, 99))
def test_every_stage_and_world_matches_one_process(stage, world, model, data, rows, seed):
    config = data.draw(ft.configs(stages=[stage], persistence=[0, 40]))
    ft.assert_stage_equivalent(model, model.loss, config, model.batch(rows, seed), world_size=world, steps=2)


# frozen=False: fnzero keeps frozen parameters in the model's dtype instead of the 16-bit compute
# dtype, so a GPT with a frozen embedding mixes fp32 and fp16 inside LayerNorm (found by this file's
# first draft; reported, not fixed here).
def _fp16_stage0():
    return fnzero.load_config({
        "train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0.0, "fp16": {"enabled": True, "initial_scale_power": 8},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1}},
        "zero_optimization": {"stage": 0},
    })


# lr 1e-3, not the strategies' 1e-2: Adam turns 16-bit rounding differences in near-zero gradients
# into lr-sized steps, so after one step a tiny GPT's gradient norm measures that amplification.
# Found by this test: d_model 12, fp16, 3 ranks (the same at every stage, so not sharding): step 0
# within 2.5e-4 of one process, step 1 off by 1.4 % at lr 1e-2, within the fp16 tolerance at 1e-3.
@settings(max_examples=6 * _SCALE)
@given(model=ft.models(kinds=["gpt"], frozen=False), cfg=ft.configs(precisions=["fp16", "bf16"], lr=1e-3),
       world=ft.world_sizes(1, 4))
@example(
    model=ft.ModelFactory(kind="gpt", sizes=(), gpt=(("d_model", 12), ("mlp_ratio", 1), ("n_head", 3), ("n_layer", 2),
                          ("seq_len", 6), ("tied", True), ("vocab_size", 16)), frozen=(), dtype=torch.float64,
                          seed=1654301),
    cfg=_fp16_stage0(), world=3,
)
def test_16_bit_stages_match_one_process_within_rounding(model, cfg, world):
    ft.assert_stage_equivalent(model, model.loss, cfg, model.batch(4), world_size=world, steps=2)


@settings(max_examples=10 * _SCALE)
@given(
    model=ft.models(kinds=["mlp"]), save=ft.world_sizes(1, 4), load=ft.world_sizes(1, 4),
    stages=st.tuples(st.integers(0, 3), st.integers(0, 3)),
)
def test_drawn_checkpoints_reshard(model, save, load, stages):
    cfg = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
           "zero_optimization": {"stage": stages[0], "stage3_param_persistence_threshold": 0}}
    ft.assert_reshard_roundtrip(model, cfg, save, load, load_stage=stages[1], loss_fn=model.loss,
                                batch=model.batch(4))

