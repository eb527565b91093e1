"""The traps a new user fell into, each closed (README "What shard() does to your model"):
weights written back into a real module, load_state_dict into a sharded model refused, a sharded
model called directly refused, `apply` in the module's own train/eval mode, ranks that built
different weights started equal."""

import pytest
import torch
import torch.nn.functional as F

import fnzero
import fnzero.testing as ft
from fnzero.testing import GPT, GPTConfig


def _gpt(tied=False):
    return GPT(GPTConfig(vocab_size=32, seq_len=8, d_model=16, n_head=2, n_layer=2, tied=tied))


def _cfg(stage):
    return fnzero.load_config({"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
                               "zero_optimization": {"stage": stage}})  # fmt: skip


def _trained(sm, cfg, steps=2):
    def loss_fn(params, batch):
        logits = sm.apply(params, batch[:, :-1])
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))

    state, step = sm.init_state(), fnzero.train_step(loss_fn, cfg)
    g = torch.Generator().manual_seed(0)
    for _ in range(steps):
        state, _ = step(state, torch.randint(0, 32, (2, 9), generator=g))
    return state


@pytest.mark.parametrize("stage,tied", [(0, False), (3, True)])
def test_load_into_writes_the_trained_weights_into_a_fresh_module(stage, tied):
    cfg = _cfg(stage)
    torch.manual_seed(0)
    sm = fnzero.shard(_gpt(tied), config=cfg)
    state = _trained(sm, cfg)
    fresh = _gpt(tied)
    assert sm.load_into(fresh, state) is fresh
    ft.assert_trees_equal(dict(fresh.state_dict()), sm.state_dict(state))
    batch = torch.randint(0, 32, (2, 8))
    torch.testing.assert_close(fresh(batch), sm.apply(state.params, batch), rtol=0, atol=0)


def test_load_into_refuses_the_sharded_model_and_another_architecture():
    cfg = _cfg(2)
    sm = fnzero.shard(_gpt(), config=cfg)
    state = sm.init_state()
    with pytest.raises(fnzero.ShardingError, match="given to fnzero.shard"):
        sm.load_into(sm.module, state)
    other = GPT(GPTConfig(vocab_size=32, seq_len=8, d_model=16, n_head=2, n_layer=3))
    before = {k: v.clone() for k, v in other.state_dict().items()}
    with pytest.raises(fnzero.ShardingError, match=r"model keys not in the state \['blocks.2"):
        sm.load_into(other, state)
    ft.assert_trees_equal(dict(other.state_dict()), before)  # untouched
    sm.load_into(other, state, strict=False)  # the common keys
    torch.testing.assert_close(other.wte.weight, sm.state_dict(state)["wte.weight"], rtol=0, atol=0)


def test_load_state_dict_into_a_sharded_model_is_an_error_not_a_silent_no_op():
    model = _gpt()
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    fnzero.shard(model, config=_cfg(3))
    with pytest.raises(fnzero.ShardingError, match="sm.load_into"):
        model.load_state_dict(weights)


@pytest.mark.parametrize("stage", [0, 3])
def test_calling_a_sharded_model_directly_says_to_use_apply_or_load_into(stage):
    # (It ran on meta placeholders: torch's "Tensor.item() cannot be called on meta tensors" in a
    # Hugging Face model, a meta result or a unit's message at stage 3 here.)
    model = _gpt()
    sm = fnzero.shard(model, config=_cfg(stage))
    state = sm.init_state()
    batch = torch.randint(0, 32, (2, 8))
    with pytest.raises(fnzero.ShardingError, match=r"GPT was given to fnzero.shard.*cannot be called directly. "
                       r"Run it with sm.apply\(params, ...\).*sm.load_into\(fresh_model, state\)"):
        model(batch)
    assert sm.apply(state.params, batch).shape == (2, 8, 32)  # the way to run it, still working
    # Inside another sharded model's apply it is still this model's placeholders: refused.
    outer = torch.nn.Linear(8, 8)
    outer.forward = lambda x: model(x)
    sm_outer = fnzero.shard(outer, config=_cfg(stage))
    with pytest.raises(fnzero.ShardingError, match="cannot be called directly"):
        sm_outer.apply(sm_outer.init_state().params, batch)


@pytest.mark.parametrize("stage", [0, 3])
def test_apply_runs_in_the_modules_own_train_or_eval_mode(stage):
    """README Quickstart: dropout is on in `sm.apply` while the module is in training mode (as
    built, and as transformers' `from_config` builds), off after `model.eval()`."""

    def net():
        return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Dropout(0.5), torch.nn.Linear(16, 2))

    torch.manual_seed(0)
    model = net()
    sm = fnzero.shard(model, config=_cfg(stage))
    state = sm.init_state()
    reference = sm.load_into(net(), state).eval()
    x = torch.randn(4, 8)
    assert model.training and not torch.equal(sm.apply(state.params, x), reference(x))  # dropout on
    model.eval()
    torch.testing.assert_close(sm.apply(state.params, x), reference(x), rtol=0, atol=0)
    model.train()
    assert not torch.equal(sm.apply(state.params, x), reference(x))


def _built_apart(comm, same: bool):
    """Rank 1 builds the model under another seed unless `same`; returns init_state's error."""
    with ft.seeded(0 if same is True else comm.rank):
        model = _gpt()
    cfg = fnzero.load_config({"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW"},
                              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}})  # fmt: skip
    sm = fnzero.shard(model, config=cfg, comm=comm)
    try:
        sm.init_state(check_ranks_equal=same != "template")
    except fnzero.ShardingError as e:
        return str(e)
    return None


def test_ranks_that_built_different_weights_are_named_at_init_state():
    with ft.simulated_world(2) as world:
        assert world.run(lambda comm: _built_apart(comm, True)) == [None, None]
        r0, r1 = world.run(lambda comm: _built_apart(comm, False))
        # A template state, whose values a checkpoint load replaces next, may skip the check.
        assert world.run(lambda comm: _built_apart(comm, "template")) == [None, None]
    assert r0 == r1 and "rank 1 in ['wte', 'wpe', 'blocks.0', 'blocks.1'] ..." in r0 and "torch.manual_seed" in r0


def test_the_checksum_sees_any_bit_and_any_order():
    from fnzero.sharding.comm._observed import checksum

    x = torch.randn(1001, dtype=torch.float64)
    assert torch.equal(checksum(x), checksum(x.clone()))
    flipped = x.clone()
    flipped.view(torch.int64)[500] ^= 1  # one bit of one value
    assert not torch.equal(checksum(x), checksum(flipped))
    assert not torch.equal(checksum(x), checksum(x.flip(0)))
    assert torch.equal(checksum(torch.ones(3, dtype=torch.bfloat16)), checksum(torch.ones(3, dtype=torch.bfloat16)))
