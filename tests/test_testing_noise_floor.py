"""`assert_stage_equivalent` judges a sharded run against the model's own noise floor
(specs/testing.md §Noise floor): transformers' Llama and GPT-2 compute parts in float32 inside a
float64 model (RMSNorm, rotary embeddings, the causal-LM loss), so splitting the batch differently
moves even the unsharded step by ~1e-8 relative. That is not a sharding error and must pass (with a
NoiseFloorWarning naming where the model narrows); a true sharding bug must still fail.

Models: `_worlds.hf_model` (built from config classes, float64, nothing downloaded), one layer to
keep each hypothesis example cheap (a fraction of a second)."""

from __future__ import annotations

import functools
import warnings

import pytest
import torch
import transformers
from hypothesis import example, given, settings
from hypothesis import strategies as st

import fnzero
import fnzero.testing as ft
from fnzero.sharding import CollectivesBase

import _worlds as W

transformers.logging.set_verbosity_error()

KINDS = ("llama", "gpt2")
MODELS = {kind: functools.partial(W.hf_model, kind, layers=1) for kind in KINDS}
VOCAB, SEQ = 51, 6  # hf_model's vocabulary; a short sequence keeps each step cheap


def lm_loss(apply, batch):
    """transformers' own causal-LM loss (a mean over tokens; it upcasts the logits to float32)."""
    return apply(input_ids=batch["x"], labels=batch["x"]).loss


def tokens(rows: int, seed: int) -> dict[str, torch.Tensor]:
    return {"x": torch.randint(0, VOCAB, (rows, SEQ), generator=torch.Generator().manual_seed(seed))}


def config(stage: int, k: int = 1) -> fnzero.Config:
    return fnzero.load_config({
        "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": k, "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
    })


def test_the_reported_llama_case_passes_against_its_floor_and_says_why():
    """The report: stage 0, 3 simulated ranks, 4 rows extended to 6. At the float64 tolerance alone
    it fails on the gradient norm (~1e-8 relative); against the floor it passes, and the warning
    names the float32 inside the model. (The warning is given only when the stated tolerance was
    missed, so it also proves the floor was needed.)"""
    with pytest.raises(AssertionError, match=r"metrics\['grad_norm'\]: got"):
        ft.assert_stage_equivalent(MODELS["llama"], lm_loss, config(0), tokens(4, 0), world_size=3, steps=1,
                                   noise_floor=False)
    with pytest.warns(ft.NoiseFloorWarning) as record:
        ft.assert_stage_equivalent(MODELS["llama"], lm_loss, config(0), tokens(4, 0), world_size=3, steps=1)
    msg = str(record[0].message)
    assert "the float64 model computes in float32 inside LlamaRMSNorm" in msg, msg
    assert "the sharded run's 3 micro-batches" in msg and "at most 1 x its floor" in msg, msg


# Two of the four derandomized draws split into rows that reproduce exactly (1- and 2-row chunks of
# one matmul); the example is a Llama whose 6 micro-batches do not, at stage 3 with accumulation.
@settings(max_examples=4, deadline=None)
@given(kind=st.sampled_from(KINDS), stage=st.integers(0, 3), world=st.integers(2, 3), k=st.integers(1, 2),
       rows=st.integers(1, 4), seed=st.integers(0, 99))
@example(kind="llama", stage=3, world=3, k=2, rows=4, seed=5)
def test_hf_models_shard_within_their_own_noise_floor(kind, stage, world, k, rows, seed):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ft.assert_stage_equivalent(MODELS[kind], lm_loss, config(stage, k), tokens(rows, seed), world_size=world,
                                   steps=2)
    for w in caught:  # the only warning allowed is the floor's, and it says what narrows inside
        assert issubclass(w.category, ft.NoiseFloorWarning) and "computes in float32 inside" in str(w.message), w


class GradientBug(CollectivesBase):
    """Collectives with a classic sharding bug in every gradient reduction (the step's [norm², loss]
    all-reduce and non-float traffic are left alone):

    * "dropped rank": rank 1's contribution is zeroed (a shard's gradient got lost);
    * "double scale": the reduced gradient is divided by the world size once more;
    * "dropped unit": the first gradient reduction of every step, on every rank, is zeroed (one
      unit's gradient, or its first micro-batch's share, never arrives).
    """

    def __init__(self, inner, bug: str):
        self.inner, self.rank, self.world_size, self.bug = inner, inner.rank, inner.world_size, bug
        self.first_of_step = True

    def _reduce(self, reduce, t, **kw):
        if not t.is_floating_point():
            return reduce(t, **kw)
        if t.dim() == 1 and t.numel() in (2, 3) and t.dtype == torch.float64:  # [norm², loss]: a step ends
            self.first_of_step = True
            return reduce(t, **kw)
        if (self.bug == "dropped rank" and self.rank == 1) or (self.bug == "dropped unit" and self.first_of_step):
            t = torch.zeros_like(t)
        self.first_of_step = False
        out = reduce(t, **kw)
        return out / self.world_size if self.bug == "double scale" else out

    def reduce_scatter(self, full, donate=False):
        return self._reduce(self.inner.reduce_scatter, full)

    def all_reduce(self, t, op="sum"):
        return self._reduce(self.inner.all_reduce, t, op=op)

    def __getattr__(self, name):
        return getattr(self.inner, name)


@settings(max_examples=4, deadline=None)
@given(kind=st.sampled_from(KINDS), stage=st.integers(0, 3), world=st.integers(2, 3),
       bug=st.sampled_from(["dropped rank", "double scale", "dropped unit"]), seed=st.integers(0, 99))
@example(kind="llama", stage=2, world=3, bug="dropped unit", seed=3)  # the draws give Llama one bug only
def test_a_sharding_bug_still_fails_above_the_floor(kind, stage, world, bug, seed):
    with pytest.raises(AssertionError) as e:
        ft.assert_stage_equivalent(MODELS[kind], lm_loss, config(stage), tokens(world, seed), world_size=world,
                                   steps=1, wrap_comm=lambda comm: GradientBug(comm, bug))
    msg = str(e.value)
    assert f"ZeRO stage {stage} on {world} simulated ranks diverged" in msg and "at step 0 of 1" in msg, msg
    assert "judged against the model's own noise floor" in msg and "a sharding error, not rounding" in msg, msg


class BatchCentred(torch.nn.Module):
    """A model whose output depends on how the batch is split (it centres over the rows it sees)."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(3, 2)

    def forward(self, x):
        h = self.lin(x)
        return h - h.mean(0, keepdim=True)


def test_a_split_dependent_model_is_not_excused_by_its_floor():
    mlp = ft.ModelFactory("mlp", sizes=(3, 2))
    with pytest.raises(AssertionError, match=r"noise floor was not used: .* above 0\.001, which rounding does not"):
        ft.assert_stage_equivalent(BatchCentred, mlp.loss, config(1), mlp.batch(4), world_size=2, steps=1)
