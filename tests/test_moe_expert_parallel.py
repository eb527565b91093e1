"""Expert parallelism's collectives, memory and errors, counted on simulated worlds of 4 ranks
(`specs/collectives.md` §All-to-all, `specs/mesh.md` §Expert parallelism memory).

The model is fnzero's GPT with two MoE blocks of 4 experts: block 0 top-2 dropping tokens past
capacity, block 1 top-1 without dropping (its capacity differs by rank and is padded to the ep
group's largest). The comms logger records the dp, ep and edp collectives apart.
"""

from __future__ import annotations

import collections

import pytest
import torch
import torch.nn.functional as F

import fnzero
from fnzero import ConfigError
from fnzero.moe import MoE
from fnzero.testing import GPT, seeded, simulated_world

WORLD, EXPERTS, HIDDEN, VOCAB, SEQ, MICRO = 4, 4, 16, 64, 8, 2
TOKENS = MICRO * SEQ  # tokens one rank's MoE layer routes per micro-batch


def _model(ep: int, dtype=torch.float32) -> GPT:
    with seeded(0):
        return GPT(vocab_size=VOCAB, seq_len=SEQ, d_model=HIDDEN, n_layer=2, n_head=2, num_experts=EXPERTS,
                   moe=[dict(k=2, ep_size=ep, min_capacity=4), dict(k=1, ep_size=ep, drop_tokens=False)]).to(dtype)


def _config(stage: int, **extra):
    return fnzero.load_config({"train_micro_batch_size_per_gpu": MICRO, "optimizer": {"type": "AdamW"},
                               "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
                               **extra}, world_size=WORLD)


def _one_recorded_step(stage: int, ep: int):
    """Per rank: the plan's units, the (op, numel) records of the step on dp, ep and edp, and the
    no-drop layer's capacity (its largest expert count this micro-batch, at most the tokens)."""
    cfg = _config(stage, comms_logger={"enabled": True})

    def rank(comm):
        sm = fnzero.shard(_model(ep), config=cfg, comm=comm, mesh=fnzero.make_mesh(comm, ep=ep))
        state = sm.init_state()
        step = fnzero.train_step(
            lambda p, b: F.cross_entropy(sm.apply(p, b[:, :-1]).flatten(0, 1), b[:, 1:].flatten()), cfg)
        batch = torch.randint(0, VOCAB, (MICRO, SEQ + 1), generator=torch.Generator().manual_seed(comm.rank))
        comms = (sm.comm, state.sharding.ep.comm, state.sharding.ep.expert_dp)
        for c in comms:
            c.reset()
        step(state, batch)
        no_drop = sm.module.blocks[1].moe.deepspeed_moe
        capacity = min(int(no_drop.exp_counts.max()), TOKENS)
        return sm.plan.units, [[(r.op, r.numel, r.bytes) for r in c.records] for c in comms], capacity

    return simulated_world(WORLD).run(rank)


def _all_to_all_bytes(ep: int, capacity: int, itemsize: int) -> int:
    """specs/collectives.md §All-to-all: one MoE layer, one micro-batch: dispatch and combine
    forward, the same two backward, each sending (ep-1)/ep of the [E, C, hidden] buffer."""
    return 4 * (ep - 1) * EXPERTS * capacity * HIDDEN * itemsize // ep


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_expert_gradients_reduce_over_the_expert_data_parallel_group_only(stage):
    """specs/mesh.md §Expert parallelism memory, specs/collectives.md §All-to-all: at ep 2 on 4 ranks each
    expert unit is reduced (and gathered) on the edp Collectives only, each dense unit on dp only,
    once per step; the ep group carries the all-to-alls, whose bytes are the formula, and the
    no-drop layer's capacity all-gather."""
    ep = 2
    out = _one_recorded_step(stage, ep)
    capacities = [c for _, _, c in out]
    for r, (units, (dp, ep_records, edp), _) in enumerate(out):
        dense = collections.Counter(u.padded_numel for u in units if not u.is_expert)
        expert = collections.Counter(u.padded_numel for u in units if u.is_expert)
        assert len(expert) and not set(dense) & set(expert)  # the sizes tell the two kinds apart
        assert sum(expert.values()) == 2  # one expert unit per MoE layer
        reductions = ("reduce_scatter", "all_reduce")
        on_dp = collections.Counter(n for op, n, _ in dp if op in reductions)
        assert on_dp == dense + collections.Counter({2: 1}), (stage, r)  # + the norm and loss, two float64
        assert collections.Counter(n for op, n, _ in edp if op in reductions) == expert, (stage, r)
        assert {n for op, n, _ in dp if op == "all_gather"} <= set(dense)
        assert {n for op, n, _ in edp if op == "all_gather"} == (set(expert) if stage else set())
        # The ep group: 4 all-to-alls per MoE layer, and one all-gather of ep capacities (int64) for the no-drop one.
        assert [(op, n) for op, n, _ in ep_records if op != "all_to_all"] == [("all_gather", ep)]
        sent = sorted(b for op, _, b in ep_records if op == "all_to_all")
        drop_capacity = max(-(-2 * TOKENS // EXPERTS), 4)  # top-2, capacity factor 1: ceil(2 T / E), min_capacity 4
        group_capacity = max(capacities[r - r % ep: r - r % ep + ep])  # padded to the ep group's largest
        want = [_all_to_all_bytes(ep, drop_capacity, 4) // 4] * 4 + [_all_to_all_bytes(ep, group_capacity, 4) // 4] * 4
        assert sent == sorted(want), (stage, r)
    assert len(set(capacities)) > 1  # the no-drop layer's capacities differ by rank: the padding is exercised


@pytest.mark.parametrize("stage", [1, 3])
def test_model_state_bytes_are_the_expert_parallel_formula(stage):
    """specs/mesh.md §Expert parallelism memory: per rank, dense Ψ_d over the 4 dp ranks plus Ψ_e/ep
    over the 4/ep edp ranks, padding included, exactly, at ep 1, 2 and 4."""
    cfg = _config(stage)
    psi_e = fnzero.memory.expert_param_counts(_model(1))[1]
    for ep in (1, 2, 4):
        def rank(comm):
            sm = fnzero.shard(_model(ep), config=cfg, comm=comm, mesh=fnzero.make_mesh(comm, ep=ep))
            return sm.plan, fnzero.memory.model_state_bytes(sm.init_state()).total

        for plan, got in simulated_world(WORLD).run(rank):
            experts_here = sum(u.padded_numel for u in plan.units if u.is_expert)
            if ep == 1:  # experts inside the blocks' units: Ψ_e exactly, the units' padding counted dense
                assert experts_here == 0
                experts_here = psi_e
            dense = plan.num_padded - experts_here
            assert got == fnzero.memory.ep_zero_formula(dense, ep * experts_here, stage, WORLD, ep, False), (ep, stage)
            assert ep == 1 or experts_here * ep >= psi_e  # this rank's padded share of the model's experts
    # The saving at stage 1: a rank holds a quarter of the experts (whole: one edp rank), 16 bytes each.
    f = {ep: fnzero.memory.ep_zero_formula(10_000, 40_000, 1, WORLD, ep, False) for ep in (1, 4)}
    assert f[4] == 8 * 10_000 + 8 * 10_000 / 4 + 16 * 40_000 / 4 < f[1] == 8 * 50_000 + 8 * 50_000 / 4


def _errors(world: int, body) -> list[str]:
    """The ConfigError each rank of a simulated world raises running `body(comm)`."""
    def rank(comm):
        with pytest.raises(ConfigError) as e:
            body(comm)
        return str(e.value)

    return simulated_world(world).run(rank)


def _moe(**kw):
    return MoE(HIDDEN, torch.nn.Linear(HIDDEN, HIDDEN), **{"num_experts": EXPERTS, **kw})


def test_expert_parallel_errors_name_the_numbers():
    """Each bad choice is one ConfigError naming its numbers, before any collective."""
    with pytest.raises(ConfigError, match=r"num_experts=6 is not divisible by ep_size=4"):
        _moe(num_experts=6, ep_size=4)
    with pytest.raises(ConfigError, match=r"k=2 exceeds num_experts=1"):
        _moe(num_experts=1, k=2)
    with pytest.raises(ConfigError, match=r"capacity_factor=0 must be > 0"):
        _moe(capacity_factor=0)
    with pytest.raises(ConfigError, match=r"eval_capacity_factor=-1.0 must be > 0"):
        _moe(eval_capacity_factor=-1.0)
    # ep must divide the data-parallel ranks: asked of the mesh, or by the layers through shard.
    for msg in _errors(4, lambda comm: fnzero.make_mesh(comm, ep=3)):
        assert "expert-parallel size 3 must divide the data-parallel world" in msg and "4 data-parallel rank" in msg
    for msg in _errors(4, lambda comm: fnzero.make_mesh(comm, tp=2, ep=4)):
        assert "expert-parallel size 4" in msg and "2 data-parallel rank" in msg

    def three_of_four(comm):
        with seeded(0):
            model = torch.nn.Sequential(MoE(HIDDEN, torch.nn.Linear(HIDDEN, HIDDEN), num_experts=6, ep_size=3))
        fnzero.shard(model, config=_config(1), comm=comm)

    for msg in _errors(4, three_of_four):
        assert "expert-parallel size 3 must divide the data-parallel world" in msg and "4 data-parallel rank" in msg
    # The mesh's ep against the layers': different, or not dividing their experts.
    for msg in _errors(2, lambda comm: fnzero.shard(_model(4), config=_config(1), comm=comm,
                                                    mesh=fnzero.make_mesh(comm, ep=2))):
        assert "ask for expert-parallel size 4 but the mesh given has ep 2" in msg

    def six_over_four(comm):
        with seeded(0):
            model = torch.nn.Sequential(MoE(HIDDEN, torch.nn.Linear(HIDDEN, HIDDEN), num_experts=6))
        fnzero.shard(model, config=_config(1), comm=comm, mesh=fnzero.make_mesh(comm, ep=4))

    for msg in _errors(4, six_over_four):
        assert "6 experts do not divide over 4 expert-parallel ranks" in msg
    # Layers asking different sizes (refused before any mesh is made).
    with seeded(0):
        mixed = torch.nn.Sequential(_moe(ep_size=2), _moe(ep_size=4))
    with pytest.raises(ConfigError, match=r"different expert-parallel sizes \(0.deepspeed_moe.experts: 2, "
                                          r"1.deepspeed_moe.experts: 4\)"):
        fnzero.shard(mixed, config=_config(1))

    # A mesh with ep > 1 over a model with no experts (no MoE layer, no Hugging Face MoE block).
    for msg in _errors(2, lambda comm: fnzero.shard(torch.nn.Linear(HIDDEN, HIDDEN), config=_config(1), comm=comm,
                                                    mesh=fnzero.make_mesh(comm, ep=2))):
        assert "has no AutoEP preset" in msg


def test_memory_docstring_examples_run():
    import doctest

    from fnzero.memory import _estimate, _experts, _state_bytes

    for module in (_state_bytes, _experts, _estimate):
        result = doctest.testmod(module)
        assert result.attempted and not result.failed, module.__name__
