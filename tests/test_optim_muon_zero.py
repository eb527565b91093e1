"""Muon at ZeRO stages 1-3 (specs/optim.md §Muon, §Muon at ZeRO stages 1-3): the whole-matrix
optimizer partition gives each matrix to one owning rank, which holds its momentum whole; the
training equals DeepSpeed's algorithm in float64 (the plain reference of tests/test_optim_muon.py)
on simulated worlds of 2 and 4 with accumulation and clipping, the state per rank is what the
partition says to the byte, the exchange sends what the formula says, a user's chain with
`scale_by_muon` trains at stage 3, the momentum checkpoints and reshards, and what is not built is
refused by name."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

import fnzero
from fnzero import optim
from fnzero._errors import ConfigError, DistributedError
from fnzero.memory import model_state_bytes, muon_state_bytes
from fnzero.sharding.zero._owners import whole_tensor_partition
from fnzero.testing import count_collectives, simulated_world

from test_optim_muon import BASE, CLIP, STEPS, TinyLM, _loss, _reference, ref_step

H = {**BASE, "wd": BASE["weight_decay"], "nesterov": True, "ns_steps": 5}
MUON_NAMES = {"up.weight", "down.weight"}


def _config(stage, world, k=2, **extra):
    return fnzero.load_config({
        "train_micro_batch_size_per_gpu": 8 // world // k, "gradient_accumulation_steps": k,
        "gradient_clipping": CLIP, "zero_optimization": {"stage": stage},
        "optimizer": {"type": "Muon", "params": dict(BASE)}, **extra}, world_size=world)


def _data():
    torch.manual_seed(0)
    model = TinyLM().double()
    return model, torch.randint(0, 16, (8, 5)), torch.randint(0, 16, (8, 5))


def _train(cfg, model, ids, labels, world, steps=STEPS, each=None):
    def rank(comm):
        m = TinyLM().to(next(model.parameters()).dtype)
        m.load_state_dict(model.state_dict())
        sm = fnzero.shard(m, config=cfg, comm=comm)
        state = sm.init_state()
        step = fnzero.train_step(lambda p, b: _loss(sm.apply(p, b[0]).double(), b[1]), cfg)
        rows = slice(8 // world * comm.rank, 8 // world * (comm.rank + 1))
        for _ in range(steps):
            state, _ = step(state, (ids[rows], labels[rows]))
        return (sm.gather(state), each(sm, state, step, (ids[rows], labels[rows])) if each else None)

    return simulated_world(world).run(rank)


@pytest.mark.parametrize("stage,world", [(0, 2), (1, 2), (2, 2), (3, 2), (1, 4), (2, 4), (3, 4)])
def test_muon_at_every_zero_stage_equals_deepspeeds_algorithm(stage, world):
    """Every parameter within 1e-9 of the float64 reference after 3 steps (2 micro-batches each,
    clipping active), on every rank; each rank's optimizer state is its owned matrices' momentum
    whole plus Adam's two moments of its pieces of the other parameters, exactly (stage 0: all of
    both), and `fnzero.memory.muon_state_bytes` says so from the plan."""
    model, ids, labels = _data()
    want = _reference(model, ids, labels, H)

    def state_bytes(sm, state, step, batch):
        r, part = sm.comm.rank, whole_tensor_partition(sm.plan, frozenset(MUON_NAMES))
        pieces = sum(hi - lo for u in sm.plan.units for lo, hi in [u.real_range(r)])  # this rank's real elements
        mine = sum(part.piece(n, r)[1] - part.piece(n, r)[0] for n in MUON_NAMES)  # ... of the matrices
        if stage == 0:  # every matrix's momentum, Adam's moments of every other parameter
            pieces, mine = sm.plan.num_params, sum(math.prod(part.shape(n)) for n in MUON_NAMES)
        formula = 8 * ((part.load(r) if stage else mine) + 2 * (pieces - mine))
        return model_state_bytes(state).optimizer, formula, muon_state_bytes(sm.plan, r, itemsize=8)

    for got, (held, formula, planned) in _train(_config(stage, world), model, ids, labels, world, each=state_bytes):
        for n in want:
            torch.testing.assert_close(got[n], want[n], rtol=0, atol=1e-9, msg=lambda m: f"stage {stage} {n}: {m}")
        assert held == formula == planned


def test_the_partition_is_balanced_and_the_exchange_sends_what_the_formula_says():
    """fnzero's GPT, 4 ranks, stage 2: owners are the greedy largest-first assignment (max/mean load
    as the spec states), and one step's all-to-alls send, per rank, 8 bytes x (2 x its pieces of
    the matrices it does not own + the rest of the matrices it owns)."""
    cfg = fnzero.load_config({"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 2},
                              "optimizer": {"type": "Muon"}}, world_size=4)
    torch.manual_seed(0)
    x, gpt = torch.randint(0, 64, (8, 8)), fnzero.testing.GPT(vocab_size=64, seq_len=8, d_model=16, n_layer=2, n_head=2)

    def rank(comm):
        sm = fnzero.shard(copy.deepcopy(gpt).double(), config=cfg, comm=comm)
        state = sm.init_state()
        step = fnzero.train_step(lambda p, b: _loss(sm.apply(p, b[:, :-1]), b[:, 1:]), cfg)
        with count_collectives(state) as counter:
            state, _ = step(state, x[2 * comm.rank: 2 * comm.rank + 2])
        return sm.plan, counter.bytes("all_to_all"), counter.calls("all_to_all")

    results = simulated_world(4).run(rank)
    plan = results[0][0]
    names = frozenset(s.name for u in plan.units for s in u.slots if optim.uses_muon(s.name, s.shape))
    part = whole_tensor_partition(plan, names)
    loads = [part.load(r) for r in range(4)]
    largest = max(math.prod(part.shape(n)) for n in names)
    assert sum(loads) == sum(math.prod(part.shape(n)) for n in names)
    assert max(loads) <= 4 / 3 * max(sum(loads) / 4, largest)  # Graham's bound for largest-first
    assert (max(loads) / (sum(loads) / 4)) == pytest.approx(1.0462, abs=1e-4)  # the spec's figure for this GPT
    for r, (_, sent, calls) in enumerate(results):
        assert calls == 2 and sent == 8 * part.exchange_numel(r)


def test_16_bit_training_with_an_fp32_master_matches_stage_0_where_the_gradients_do():
    """bf16 compute, fp32 master, 2 ranks: stage 1 gives stage 0's parameters bit for bit (the owner
    runs Newton–Schulz on the fp32 gradient stage 0 has); stage 3 gives stage 2's (both
    reduce-scatter each micro-batch's bf16 gradients, which moves any optimizer's result off stage
    0's by bf16 rounding: AdamW's too)."""
    model, ids, labels = _data()
    model = model.float()
    runs = {s: _train(_config(s, 2, bf16={"enabled": True}), model, ids, labels, 2)[0][0] for s in (0, 1, 2, 3)}
    for s, base in ((1, 0), (3, 2)):
        for n, t in runs[base].items():
            torch.testing.assert_close(runs[s][n], t, rtol=0, atol=0, msg=lambda m: f"stage {s} {n}: {m}")
    assert not torch.equal(runs[0]["up.weight"], model.up.weight.detach())


def test_a_users_chain_with_scale_by_muon_trains_at_stage_3():
    """`chain(scale_by_muon, lr)` over a bias-free MLP (every parameter a matrix), and
    `partition(select, muon, adam)` with a name-only select, at stage 3 on 2 ranks: the reference's
    numbers, and the loss falls. A select that sends a vector to `scale_by_muon` is a ConfigError
    naming it, on every rank (no rank waits in the exchange)."""
    def mlp(bias=False):
        torch.manual_seed(1)
        return nn.Sequential(nn.Linear(4, 8, bias=bias), nn.Tanh(), nn.Linear(8, 3, bias=False)).double()

    model, models = mlp(), {False: mlp(), True: mlp(bias=True)}  # built here: the ranks' threads share torch's seed
    x, y = torch.randn(16, 4, dtype=torch.float64), torch.randn(16, 3, dtype=torch.float64)
    cfg = fnzero.load_config({"train_micro_batch_size_per_gpu": 8, "zero_optimization": {"stage": 3}}, world_size=2)
    h = {"momentum": 0.9, "nesterov": True, "ns_steps": 5, "muon_lr": 0.02, "wd": 0.0}
    want, ref_state = {n: p.detach().clone() for n, p in model.named_parameters()}, {"t": 0}
    for _ in range(3):
        leaves = {n: t.clone().requires_grad_(True) for n, t in want.items()}
        loss = nn.functional.mse_loss(torch.func.functional_call(model, leaves, (x,)), y)
        want = ref_step(want, dict(zip(leaves, torch.autograd.grad(loss, list(leaves.values())))), ref_state, h)
    muon_only = optim.chain(optim.scale_by_muon(momentum=0.9), optim.scale_by_learning_rate(0.02))
    split = optim.partition(lambda n, s: n == "0.weight", muon_only,
                            optim.chain(optim.scale_by_muon(momentum=0.9), optim.scale_by_learning_rate(0.02)))

    def run(tx, bias=False):
        def rank(comm):
            sm = fnzero.shard(copy.deepcopy(models[bias]), config=cfg, comm=comm)
            state = sm.init_state(optimizer=tx)
            step = fnzero.train_step(lambda p, b: nn.functional.mse_loss(sm.apply(p, b[0]), b[1]), cfg, optimizer=tx)
            losses = []
            for _ in range(3):
                state, metrics = step(state, (x[8 * comm.rank: 8 * comm.rank + 8], y[8 * comm.rank: 8 * comm.rank + 8]))
                losses.append(metrics["loss"])
            return sm.gather(state), losses

        return simulated_world(2).run(rank)

    for tx in (muon_only, split):
        for got, losses in run(tx):
            for n in want:
                torch.testing.assert_close(got[n], want[n], rtol=0, atol=1e-12)
            assert losses[-1] < losses[0]
    vector_to_muon = optim.partition(lambda n, s: n.startswith("0."), muon_only, optim.adamw_chain())
    with pytest.raises(DistributedError, match=r"ConfigError: scale_by_muon: parameter '0.bias' has shape \(8,\)"):
        run(vector_to_muon, bias=True)  # raised by init_state on each rank: the world does not time out


def test_momentum_checkpoints_resume_bit_identical_and_reshard(tmp_path):
    """Saved after 2 steps at stage 2 on 2 ranks: resuming there gives the uninterrupted third step
    bit for bit; resuming on 4 ranks at stage 3 and at stage 0 gives it to rounding (the momentum
    is stored by parameter, whoever owned it)."""
    model, ids, labels = _data()

    def run(stage, world, steps, load):
        cfg = _config(stage, world)

        def rank(comm):
            m = TinyLM().double()
            m.load_state_dict(model.state_dict())
            sm = fnzero.shard(m, config=cfg, comm=comm)
            state = sm.init_state()
            if load:
                state, _ = fnzero.checkpoint.load(tmp_path, state)
            step = fnzero.train_step(lambda p, b: _loss(sm.apply(p, b[0]), b[1]), cfg)
            rows = slice(8 // world * comm.rank, 8 // world * (comm.rank + 1))
            for i in range(steps):
                state, _ = step(state, (ids[rows], labels[rows]))
                if not load and i == 1:
                    fnzero.checkpoint.save(tmp_path, state)
            return sm.gather(state)

        return simulated_world(world).run(rank)[0]

    full = run(2, 2, 3, False)
    for (stage, world), tol in {(2, 2): 0.0, (3, 4): 1e-12, (0, 2): 1e-12}.items():
        got = run(stage, world, 1, True)
        for n, t in full.items():
            torch.testing.assert_close(got[n], t, rtol=0, atol=tol, msg=lambda m: f"stage {stage} x{world} {n}: {m}")


@pytest.mark.parametrize("extra,key", [
    ({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}, "offload_optimizer.device"),
    ({"tensor_parallel": {"autotp_size": 2}}, "tensor_parallel.autotp_size"),
    ({"zero_optimization": {"stage": 1}, "expert_parallel": {"enabled": True, "autoep_size": 2}},
     "expert_parallel.autoep_size"),
])
def test_what_muon_does_not_run_beside_is_refused_by_key(extra, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        fnzero.load_config({"train_batch_size": 4, "optimizer": {"type": "Muon"}, **extra}, world_size=4)
