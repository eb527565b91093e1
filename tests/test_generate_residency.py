"""Generation's residency (`specs/generation.md` §Residency): at stage 3 the units that fit
`max_live_parameters` are gathered once per `generate` call and decoded from, the others streamed
per token; tokens equal transformers' at every budget; what is held is freed when the call ends.

Counted exactly: each unit gather is one float32 all-gather of the unit on the data axis
(the prompt and token agreements move integers)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

import fnzero
from fnzero.sharding.zero import plan_residency, residency_sizes
from fnzero.testing import GPT, count_collectives, seeded, simulated_world
from test_generate import IDS, MASK, NEW, VOCAB, build, config, reference


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 60), min_size=1, max_size=12), st.integers(0, 400))
def test_plan_residency_holds_all_that_fits_and_leaves_room_to_stream(numels, budget):
    """All units when their sum fits; otherwise the held ones plus the largest streamed one fit the
    budget (so held + the unit computing never exceeds it), and no unit is held that could not be."""
    sizes = [(i, n) for i, n in enumerate(numels)]
    held = plan_residency(sizes, budget)
    assert held <= set(range(len(numels)))
    assert plan_residency(list(sizes), budget) == held  # the same on every rank
    if sum(numels) <= budget:
        assert held == set(range(len(numels)))
        return
    streamed = [n for i, n in sizes if i not in held]
    assert streamed, "a budget below the whole model streams something"
    if held:
        assert sum(numels[i] for i in held) + max(streamed) <= budget
    if not held:  # nothing held: no unit and the largest of the others fit together
        assert all(n + max((m for j, m in sizes if j != i), default=0) > budget for i, n in sizes)


def _unit_gathers(counter) -> list[int]:
    """The numel of each float32 all-gather (a unit's gathered buffer)."""
    return [r.numel for r in counter.records if r.op == "all_gather" and r.dtype == torch.float32]


@pytest.mark.parametrize("kind,world", [("llama", 2), ("gpt2", 4)])
def test_units_move_once_per_call_when_they_fit_and_per_token_when_streamed(kind, world):
    """Default budget (the config's 1e9): every unit all-gathered exactly once in a call (it was
    once per token); budget 0: once per token, as before holding; 3/4 of the model: the
    held units once, the others per token. Greedy tokens equal transformers' in all three; with
    every unit held, the ranks that do not choose the tokens run no forward."""
    eos, want, _ = reference(kind)
    cfg = config(world)

    def rank(comm):
        sm = fnzero.shard(build(kind), config=cfg, comm=comm)
        state = sm.init_state()
        sizes = residency_sizes(sm.plan)
        total = sum(n for _, n in sizes)
        out, forwards = {}, []
        sm.module.register_forward_pre_hook(lambda *_: forwards.append(1))
        for budget in (None, 0, 3 * total // 4):
            forwards.clear()
            with count_collectives(sm) as c:
                tokens = fnzero.generate(sm, state, IDS, MASK, max_new_tokens=NEW, eos_token_id=eos,
                                         max_live_parameters=budget)  # fmt: skip
            out[budget] = (tokens, _unit_gathers(c), len(forwards))
        return sizes, out, sm.plan

    for r, (sizes, out, plan) in enumerate(simulated_world(world).run(rank)):
        shards = dict(sizes)  # a gather is recorded by its result: the unit's padded elements
        forwards = want.shape[1] - IDS.shape[1]  # one forward per new token
        for budget, (tokens, gathers, ran) in out.items():
            assert torch.equal(tokens, want), f"rank {r}, budget {budget}"
            # With every unit held, only rank 0 (the chooser) runs forwards: the others make the
            # prompt's gathers without one.
            assert ran == (0 if budget is None and r > 0 else forwards), (r, budget, ran)
        assert sorted(out[None][1]) == sorted(shards.values())
        assert len(out[0][1]) == forwards * len(shards)
        part = 3 * sum(n for _, n in sizes) // 4
        held = plan_residency(sizes, part)
        assert 0 < len(held) < len(shards)
        streamed = [shards[k] for k in shards if k not in held]
        assert sorted(out[part][1]) == sorted([shards[k] for k in held] + streamed * forwards)


def test_holding_frees_on_exit_and_on_error_and_holds_nothing_with_grad():
    """`sm.holding()`: the held buffers are dropped when the block ends, also by an exception; an
    apply with autograd on inside it gathers as usual (a held buffer has no history to share)."""
    cfg = config(2)
    x = IDS[:, :4]

    def rank(comm):
        sm = fnzero.shard(build("llama"), config=cfg, comm=comm)
        params = sm.init_state().params
        units = len(residency_sizes(sm.plan))
        with sm.holding() as held, count_collectives(sm) as c:
            with torch.no_grad():
                a = sm.apply(params, x).logits
                b = sm.apply(params, x).logits
            assert held.numel == sum(n for _, n in residency_sizes(sm.plan))
            sm.apply(params, x).logits.sum()  # with grad: gathered again
        no_grad_then_grad = len(_unit_gathers(c))
        assert held.numel == 0
        with pytest.raises(RuntimeError, match="stop"), sm.holding() as failed, torch.no_grad():
            sm.apply(params, x)
            raise RuntimeError("stop")
        assert failed.numel == 0
        with pytest.raises(fnzero.ShardingError, match="max_live_parameters"):
            fnzero.generate(sm, params, IDS, max_new_tokens=2, max_live_parameters=-1)
        return torch.equal(a, b), no_grad_then_grad, units

    for same, gathers, units in simulated_world(2).run(rank):
        assert same
        assert gathers == 2 * units


def test_streamed_units_are_fetched_ahead_across_forwards_and_give_the_same_logits():
    """fnzero's GPT with six blocks at a budget that holds some units and leaves room for the unit
    computing and the next: gathers start ahead, the last unit's into the next forward (wrapping),
    each streamed unit still moves once per forward, and the logits equal the unsharded model's."""
    cfg = config(2)
    x = torch.randint(0, 37, (2, 6), generator=torch.Generator().manual_seed(0))

    def make():
        with seeded(0):
            return GPT(vocab_size=37, seq_len=16, d_model=16, n_layer=6, n_head=2)

    def rank(comm):
        sm = fnzero.shard(make(), config=cfg, comm=comm)
        params = sm.init_state().params
        sizes = residency_sizes(sm.plan)
        budget = sum(n for _, n in sizes) - 5 * max(n for _, n in sizes) // 2
        outs = []
        with torch.no_grad(), count_collectives(sm) as c, sm.holding(budget) as held:
            for _ in range(3):
                outs.append(sm.apply(params, x))
            started = held.started
        return outs, _unit_gathers(c), started, plan_residency(sizes, budget), dict(sizes)

    with torch.no_grad():
        want = make()(x)
    for outs, gathers, started, planned, sizes in simulated_world(2).run(rank):
        for out in outs:
            torch.testing.assert_close(out, want, rtol=0, atol=1e-6)
        streamed = [n for k, n in sizes.items() if k not in planned]
        assert len(streamed) >= 3 and planned
        assert started >= 2  # one wrapped gather per forward after the first that had an order to follow
        assert sorted(gathers) == sorted([sizes[k] for k in planned] + streamed * 3 + streamed[:1])


def test_an_enclosing_holding_serves_every_call_until_the_params_change():
    """Two generate calls inside one `sm.holding()`: the second moves no unit; after a training step
    (new shards) the third gathers every unit again and gives the tokens of the stepped state."""
    cfg = config(2)
    data = torch.randint(3, VOCAB, (2, 6), generator=torch.Generator().manual_seed(2))

    def rank(comm):
        sm = fnzero.shard(build("llama"), config=cfg, comm=comm)
        state = sm.init_state()
        step = fnzero.train_step(lambda p, b: sm.apply(p, b[:, :-1]).logits.float().logsumexp(-1).mean(), cfg)
        units = len(residency_sizes(sm.plan))
        counts, tokens = [], []
        with sm.holding():
            for i in range(3):
                if i == 2:
                    state, _ = step(state, data[comm.rank:comm.rank + 1])
                with count_collectives(sm) as c:
                    tokens.append(fnzero.generate(sm, state, IDS, MASK, max_new_tokens=4))
                counts.append(len(_unit_gathers(c)))
            with pytest.raises(fnzero.ShardingError, match="give it to sm.holding"):
                fnzero.generate(sm, state, IDS, max_new_tokens=2, max_live_parameters=0)
        fresh = fnzero.generate(sm, state, IDS, MASK, max_new_tokens=4)
        return counts, tokens, fresh, units

    for counts, tokens, fresh, units in simulated_world(2).run(rank):
        assert counts == [units, 0, units]
        assert torch.equal(tokens[0], tokens[1]) and torch.equal(tokens[2], fresh)


def test_with_tensor_parallelism_the_other_data_parallel_groups_idle():
    """dp2 x tp2 at stage 3: the tensor-parallel group of data-parallel rank 0 decodes (its tp ranks
    hold different slices, so both compute); the other group makes the prompt's gathers without a
    forward and takes the tokens. transformers' tokens on every rank."""
    eos, want, _ = reference("llama")
    cfg = config(4, tp=2)

    def rank(comm):
        sm = fnzero.shard(build("llama"), config=cfg, comm=comm)
        state = sm.init_state()
        forwards = []
        sm.module.register_forward_pre_hook(lambda *_: forwards.append(1))
        tokens = fnzero.generate(sm, state, IDS, MASK, max_new_tokens=NEW, eos_token_id=eos)
        return tokens, len(forwards), sm.comm.rank

    for r, (tokens, ran, dp_rank) in enumerate(simulated_world(4).run(rank)):
        assert torch.equal(tokens, want), r
        assert ran == (want.shape[1] - IDS.shape[1] if dp_rank == 0 else 0), (r, dp_rank, ran)
