"""fnzero.testing's hypothesis strategies draw what they promise (specs/testing.md §Strategies),
and assert_trees_close agrees with them: a tree is close to its snapshot, and a change to any one
leaf is reported at that leaf's path."""

from __future__ import annotations

import optree
import pytest
import torch
from hypothesis import find, given, settings
from hypothesis import strategies as st

import fnzero
import fnzero.testing as ft


def test_tensors_reach_the_awkward_shapes():
    assert find(ft.tensors(), lambda t: t.dim() == 0).shape == ()
    assert find(ft.tensors(), lambda t: t.numel() == 0).numel() == 0
    odd = find(ft.tensors(min_side=1), lambda t: 1 < t.numel() < 8 and t.numel() % 2 == 1)
    assert odd.numel() in (3, 5, 7)
    assert {find(ft.tensors(), lambda t, d=d: t.dtype == d).dtype for d in (torch.float32, torch.float64)} == {
        torch.float32, torch.float64}


@settings(max_examples=40)
@given(tree=ft.pytrees(allow_none=True), data=st.data())
def test_a_changed_leaf_is_named_by_its_path(tree, data):
    ft.assert_trees_close(ft.tree_snapshot(tree), tree, rtol=0)
    paths, leaves, spec = ft._trees.leaf_paths(tree, "tree")
    candidates = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor) and x.numel()]
    if not candidates:
        return
    i = data.draw(st.sampled_from(candidates))
    changed = list(leaves)
    changed[i] = leaves[i] + 1
    with pytest.raises(AssertionError) as e:
        ft.assert_trees_close(optree.tree_unflatten(spec, changed), tree, rtol=1e-6, root="tree")
    assert str(e.value).startswith(f"{paths[i]}: {leaves[i].numel()} of {leaves[i].numel()} elements differ; max abs diff 1")


def test_pytrees_include_empty_trees():
    assert find(ft.pytrees(), lambda t: optree.tree_leaves(t, none_is_leaf=True) == [] and isinstance(t, dict)) == {}


@settings(max_examples=20)
@given(cfg=ft.configs(precisions=["fp32", "fp16", "bf16"], optimizers=["AdamW", "Adam", "SGD"], persistence=[0, 50]))
def test_configs_are_valid_and_reload_for_any_world(cfg):
    assert isinstance(cfg, fnzero.Config) and cfg.zero_optimization.stage in (0, 1, 2, 3)
    assert cfg.gradient_accumulation_steps in (1, 2, 3) and cfg.gradient_clipping in (0.0, 0.05, 1.0)
    for world in (1, 3, 8):
        again = ft._runs.derive_config(cfg, None, world, 2)
        assert again.train_batch_size == 2 * cfg.gradient_accumulation_steps * world


@settings(max_examples=15)
@given(model=ft.models(), rows=st.integers(1, 5))
def test_model_factories_rebuild_the_same_model_on_every_rank(model, rows):
    def build():
        m = model()
        return {k: v.detach().clone() for k, v in m.state_dict().items()}, m(model.batch(rows)["x"]).shape

    first, *others = ft.simulated_world(3).run(build)  # concurrent builds, no seeding by the caller
    for sd, _ in others:
        ft.assert_trees_equal(sd, first[0])
    frozen = [n for n, p in model().named_parameters() if not p.requires_grad]
    assert frozen == list(model.frozen)
    assert model.loss(model(), model.batch(rows)).dim() == 0  # the loss convention: loss(apply, batch)


def test_models_draw_tied_and_frozen_gpts():
    tied = find(ft.models(tied=True, frozen=True), lambda m: True)
    net = tied()
    assert tied.kind == "gpt" and net.head.weight is net.wte.weight and len(tied.frozen) == 1


@settings(max_examples=10)
@given(tok=ft.batches(vocab=37, seq=5), text=ft.batches(seq=6, text=True, rows=3),
       feats=ft.batches(features=4, targets=2, rows=st.integers(2, 3)))
def test_batches(tok, text, feats):
    assert tok["x"].shape[1] == 5 and 1 <= tok["x"].shape[0] <= 4 and int(tok["x"].max()) < 37
    assert torch.equal(tok["x"][:, 1:], tok["y"][:, :-1])
    assert text["x"].shape == (3, 6) and text["x"].dtype == torch.int64
    assert feats["x"].shape[1] == 4 and feats["y"].shape[1] == 2 and feats["x"].dtype == torch.float64


def test_world_sizes_and_bad_arguments():
    assert find(ft.world_sizes(2, 5), lambda n: True) == 2
    with pytest.raises(ValueError):
        ft.world_sizes(0, 3)
    with pytest.raises(ValueError, match="unknown precisions"):
        ft.configs(precisions=["fp8"])
    with pytest.raises(ValueError, match="seq="):
        ft.batches(vocab=3)
