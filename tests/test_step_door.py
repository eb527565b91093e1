"""Batches and states are checked at the step's door (specs/sharding.md §Step, "What the step
refuses"): an empty batch, a batch of other than micro x gas rows, leaves of different lengths, a
state of another plan (stage, world size, model). Each is one `ShardingError` saying what was
expected and what came, and the input state is bit-identical afterwards."""

import pytest
import torch
import torch.nn.functional as F

import fnzero
import fnzero.testing as ft
from fnzero.testing import GPT, MLP, GPTConfig


def _cfg(micro=4, gas=2, world=1, **zero):
    return fnzero.load_config({
        "train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": gas,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}, "zero_optimization": zero,
    }, world_size=world)  # fmt: skip


def _mlp_step(cfg, stage):
    torch.manual_seed(0)
    sm = fnzero.shard(MLP([3, 5, 2]).double(), stage=stage, config=cfg)

    def loss_fn(params, batch):
        x, y = batch
        return F.mse_loss(sm.apply(params, x), y)

    return sm, sm.init_state(), fnzero.train_step(loss_fn, cfg)


def _rows(n):
    g = torch.Generator().manual_seed(1)
    return torch.randn(n, 3, generator=g, dtype=torch.float64), torch.randn(n, 2, generator=g, dtype=torch.float64)


def _refused(step, state, batch, match):
    before = ft.tree_snapshot(state)
    with pytest.raises(fnzero.ShardingError, match=match):
        step(state, batch)
    ft.assert_trees_equal(state, before)


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_an_empty_batch_is_refused_and_counts_no_step(stage):
    _, state, step = _mlp_step(_cfg(), stage)
    _refused(step, state, _rows(0), r"empty \(0 rows\)")
    _refused(step, state, [_rows(0), _rows(0)], r"micro-batch 0 of the list is empty")


def test_a_batch_of_other_than_micro_times_gas_rows_is_refused():
    _, state, step = _mlp_step(_cfg(micro=4, gas=2), 2)
    # 4 rows would split into two micro-batches of 2: refused, naming both numbers.
    _refused(step, state, _rows(4), r"4 rows; .*\(4\) x gradient_accumulation_steps \(2\) = 8 rows")
    _refused(step, state, _rows(16), "16 rows")
    _refused(step, state, [_rows(4), _rows(3)], r"micro-batch 1 of the list has 3 rows; .*\(4\)")
    new_state, metrics = step(state, _rows(8))  # the right size trains
    assert int(new_state.step) == 1 and torch.isfinite(torch.tensor(metrics["loss"]))


def test_leaves_of_different_lengths_are_refused_where_the_batch_is_split():
    _, state, step = _mlp_step(_cfg(micro=2, gas=2), 0)
    x, y = _rows(4)
    _refused(step, state, (x, y[:2]), r"different lengths along dim 0 \(0: 4, 1: 2\).*split into")
    # Unsplit, leaves may differ (images per sample, packed offsets): the model's business.
    cfg = _cfg(micro=4, gas=1)
    sm, state, _ = _mlp_step(cfg, 0)
    step = fnzero.train_step(lambda p, b: F.mse_loss(sm.apply(p, b["x"]), b["y"]) + 0 * b["offsets"].sum(), cfg)
    x, y = _rows(4)
    new, _ = step(state, {"x": x, "y": y, "offsets": torch.zeros(7, dtype=torch.float64)})
    assert int(new.step) == 1
    _refused(step, state, {"x": x[:0], "y": y[:0], "offsets": torch.zeros(0)}, r"empty \(0 rows\)")


def test_a_config_resolved_for_another_world_does_not_fix_the_rows():
    # train_batch_size 16 at world 1 derives micro 8; at world 2 this batch of 4 x 2 rows is not
    # held against it (the triad was not resolved for this world), only split.
    cfg = fnzero.config.load_config({"train_batch_size": 16, "gradient_accumulation_steps": 2,
                                     "optimizer": {"type": "AdamW"}})  # fmt: skip

    def run():
        with ft.seeded(0):
            sm = fnzero.shard(MLP([3, 5, 2]).double(), stage=2, config=cfg)
        step = fnzero.train_step(lambda p, b: F.mse_loss(sm.apply(p, b[0]), b[1]), cfg)
        return int(step(sm.init_state(), _rows(8))[0].step)

    with ft.simulated_world(2) as world:
        assert world.run(run) == [1, 1]


def _gpt(n_layer=2):
    return GPT(GPTConfig(vocab_size=64, seq_len=16, d_model=16, n_head=2, n_layer=n_layer))


def _lm_loss(sm):
    def loss_fn(params, batch):
        logits = sm.apply(params, batch[:, :-1])
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))

    return loss_fn


def _mismatched_states():
    """On 2 simulated ranks: a stage-3 state given to a stage-2 module and step, and a state of a
    2-layer model given to a 3-layer one. Returns the two error messages per rank."""
    cfg = fnzero.load_config({"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW"},
                              "zero_optimization": {"stage3_param_persistence_threshold": 0}})  # fmt: skip
    with ft.seeded(0):
        sm2, sm3, deeper = (fnzero.shard(_gpt(n), stage=s, config=cfg) for s, n in ((2, 2), (3, 2), (2, 3)))
    batch = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(0))
    messages = []
    for sm, state in ((sm2, sm3.init_state()), (deeper, sm2.init_state())):
        before = ft.tree_snapshot(state)
        with pytest.raises(fnzero.ShardingError) as e:
            fnzero.train_step(_lm_loss(sm), cfg)(state, batch)
        ft.assert_trees_equal(state, before)
        messages.append(str(e.value))
    return messages


def test_a_state_of_another_plan_is_refused_with_what_was_expected():
    with ft.simulated_world(2) as world:
        stage, model = world.run(_mismatched_states)[0]
    # Stage 3 holds half of each unit per rank; stage 2 expects the whole padded buffer.
    assert "'wte': shape (512,), expected (1024,)" in stage and "stage 2, world size 2" in stage
    assert "lack units ['blocks.2']" in model and "another stage, world size or model" in model


def test_a_hand_made_state_whose_params_do_not_fit_its_own_plan_is_refused():
    sm, state, step = _mlp_step(_cfg(micro=4, gas=1), 0)
    name = next(iter(state.params))
    bad = state.replace(params={**state.params, name: state.params[name][:-1]})
    _refused(step, bad, _rows(4), rf"state.params do not fit this plan: they hold '{name}'")
