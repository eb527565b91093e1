"""ShardPlan properties (specs/sharding.md §Plan): every parameter lives in exactly one unit, units
are padded to the world size, shards partition the padded buffer, and shard -> gather round-trips
for any shapes, including numel < world size, odd sizes and empty models."""

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from fnzero import ShardingError
from fnzero.sharding.construct._module import full_unit
from fnzero.sharding.zero._plan import ROOT_UNIT, make_plan
from fnzero.testing import GPT, MLP
from fnzero.testing._threads import simulated_world

shapes = st.lists(st.integers(0, 5), min_size=0, max_size=3).map(tuple)


class Bag(nn.Module):
    """Parameters of arbitrary shapes, some in child blocks, some directly on the root."""

    def __init__(self, root_shapes, child_shapes):
        super().__init__()
        self.root = nn.ParameterList(nn.Parameter(torch.randn(s)) for s in root_shapes)
        self.blocks = nn.ModuleList()
        for group in child_shapes:
            m = nn.Module()
            for i, s in enumerate(group):
                m.register_parameter(f"p{i}", nn.Parameter(torch.randn(s)))
            self.blocks.append(m)


@given(
    root=st.lists(shapes, max_size=3),
    children=st.lists(st.lists(shapes, min_size=1, max_size=3), max_size=4),
    world=st.integers(1, 8),
    stage=st.integers(0, 3),
)
def test_plan_partitions_every_parameter(root, children, world, stage):
    model = Bag(root, children)
    plan = make_plan(model, world, stage)
    seen = []
    for u in plan.units:
        assert u.padded_numel % world == 0 and u.padded_numel >= max(u.numel, world)
        assert u.shard_numel * world == u.padded_numel
        assert u.padded_numel - u.numel < world or u.numel == 0
        offset = 0
        for s in u.slots:
            assert s.offset == offset
            offset += s.numel
            seen.append(s.name)
        assert offset == u.numel
    names = [n for n, _ in model.named_parameters()]
    assert sorted(seen) == sorted(names)
    assert plan.num_params == sum(p.numel() for p in model.parameters())


def test_empty_model_has_no_units():
    plan = make_plan(nn.ReLU(), 4, 3)
    assert plan.units == () and plan.num_params == 0


def test_gpt_units_are_blocks():
    plan = make_plan(GPT(n_layer=3), 2, 3)
    assert plan.unit_names == ("wte", "wpe", "blocks.0", "blocks.1", "blocks.2", "ln_f", "head")


def test_tied_weights_are_counted_once_and_live_in_the_root_unit():
    model = GPT(n_layer=1, tied=True)
    plan = make_plan(model, 2, 3)
    root = plan.unit(ROOT_UNIT)
    slot = root.slots[0]
    assert {slot.name, *slot.aliases} == {"wte.weight", "head.weight"}
    assert plan.num_params == sum(p.numel() for p in model.parameters())  # parameters() dedups ties


def test_frozen_parameters_stay_out_of_units():
    model = MLP([3, 4, 2])
    model.layers[0].weight.requires_grad_(False)
    plan = make_plan(model, 2, 2)
    assert plan.frozen == ("layers.0.weight",)
    assert all(s.name != "layers.0.weight" for u in plan.units for s in u.slots)


def test_wrap_policy_by_class_and_predicate():
    model = GPT(n_layer=2)
    by_class = make_plan(model, 2, 3, wrap=[nn.Linear])
    assert "blocks.0.qkv" in by_class.unit_names and ROOT_UNIT in by_class.unit_names  # layernorms -> root
    by_pred = make_plan(model, 2, 3, wrap=lambda path, m: path == "blocks")
    assert by_pred.unit_names == (ROOT_UNIT, "blocks")


def test_mixed_dtypes_are_rejected_with_the_fix():
    model = MLP([2, 2, 2])
    model.layers[1].double()
    with pytest.raises(ShardingError, match=r"model.to\(dtype\)"):
        make_plan(model, 2, 0)


def test_bad_stage_and_world():
    with pytest.raises(ShardingError, match="stage"):
        make_plan(MLP([2, 2]), 2, 4)
    with pytest.raises(ShardingError, match="world_size"):
        make_plan(MLP([2, 2]), 0, 1)


@given(numels=st.lists(st.integers(1, 13), min_size=1, max_size=4), world=st.integers(1, 6))
def test_shard_then_gather_round_trips(numels, world):
    """Each rank keeps its slice; all-gathering the slices restores the padded buffer exactly."""
    model = nn.Module()
    model.ps = nn.ParameterList(nn.Parameter(torch.arange(n, dtype=torch.float64) + 100 * i) for i, n in enumerate(numels))
    plan = make_plan(model, world, 3)
    (unit,) = plan.units
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    padded = torch.cat([flat, flat.new_zeros(unit.padded_numel - unit.numel)])

    def rank_fn(comm):
        lo, hi = unit.shard_range(comm.rank)
        return full_unit(unit, padded[lo:hi].clone(), comm)

    for got in simulated_world(world).run(rank_fn):
        assert torch.equal(got, padded)
    assert unit.padded_numel == max(world, math.ceil(sum(numels) / world) * world)


def test_each_stage_is_the_one_before_plus_one_sharded_kind():
    """specs/sharding.md §Placements: stage 3 = stage 2 + parameters, and so on down; the stage a
    placement reports is the preset it is."""
    from fnzero.sharding.zero._placement import Placement, placement_for_stage

    kinds = ("optimizer", "grads", "params")
    for stage in range(4):
        pl = placement_for_stage(stage)
        assert [getattr(pl, k) for k in kinds] == [i < stage for i in range(3)]
        assert pl.stage == stage and placement_for_stage(pl) is pl
    for kw in ({"grads": True}, {"params": True}, {"optimizer": True, "params": True}):
        with pytest.raises(ShardingError, match="a rank updates the shard whose gradient it owns"):
            Placement(**kw)
    for bad in (4, -1, True, "3"):
        with pytest.raises(ShardingError, match="ZeRO stage must be 0, 1, 2 or 3"):
            placement_for_stage(bad)


def test_a_plan_from_a_placement_equals_the_plan_from_its_stage_and_persistent_units_drop_params():
    from fnzero.sharding.zero._placement import placement_for_stage

    model = GPT(n_layer=2)
    for stage in range(4):
        assert make_plan(model, 2, placement_for_stage(stage)) == make_plan(model, 2, stage)
    plan = make_plan(model, 2, 3, persistence_threshold=10**9)
    assert plan.stage == 3 and all(u.persistent and u.placement == placement_for_stage(2) for u in plan.units)
    assert not plan.any_sharded_params
