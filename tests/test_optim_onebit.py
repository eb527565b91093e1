"""1-bit Adam, 0/1 Adam and 1-bit LAMB (specs/optim.md §1-bit optimizers) and the compressed
all-reduce (specs/collectives.md §Compressed all-reduce): fnzero's step on simulated worlds of 2
and 4 equals a single-process float64 simulation of DeepSpeed's algorithms written plainly in
`_onebit_reference.py` (N workers' local gradients, the same compression and error feedback), over steps before and
after the freeze; the bytes after the freeze equal the formula; what is not supported is refused."""

from __future__ import annotations

import functools

import pytest
import torch

import fnzero
from fnzero import optim
from fnzero._errors import ConfigError, ShardingError
from fnzero.sharding import RecordingCollectives, compressed_all_reduce
from fnzero.testing import simulated_world

from _onebit_reference import (
    CLIP, Tiny, loss_of, padded, padded_unit, ref_compressed, ref_onebit_adam, ref_onebit_lamb, ref_zero_one_adam,
)

# ---- fnzero's run ----
ONEBIT = {"lr": 0.01, "freeze_step": 3, "betas": [0.8, 0.95], "eps": 1e-6, "weight_decay": 0.1}
ZERO_ONE = {"lr": 0.01, "betas": [0.8, 0.95], "eps": 1e-6, "weight_decay": 0.1, "var_freeze_step": 5,
            "var_update_scaler": 2, "local_step_scaler": 2, "local_step_clipper": 4}
LAMB = {"lr": 0.01, "freeze_step": 3, "betas": [0.8, 0.95], "eps": 1e-6, "weight_decay": 0.1, "max_coeff": 10.0,
        "min_coeff": 0.01, "coeff_beta": 0.9, "factor_max": 4.0, "factor_min": 0.5, "factor_threshold": 0.1}
CASES = {  # config type, params, reference, steps (the warm-up, and three to five compressed steps)
    "OneBitAdam": (ONEBIT, ref_onebit_adam, 6),
    "ZeroOneAdam": (ZERO_ONE, ref_zero_one_adam, 10),
    "OneBitLamb": (LAMB, ref_onebit_lamb, 7),
}


def config(kind, params, n, **extra):
    return fnzero.load_config({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
                               "zero_optimization": {"stage": 0}, "optimizer": {"type": kind, "params": params},
                               "gradient_clipping": CLIP,
                               **extra}, world_size=n)


def run_fnzero(model, data, cfg, steps, n, record=False, optimizer=None):
    def rank(comm):
        comm = RecordingCollectives(comm) if record else comm
        m = Tiny().double()
        m.load_state_dict(model.state_dict())
        sm = fnzero.shard(m, config=cfg, comm=comm)
        state = sm.init_state(optimizer=optimizer)
        step = fnzero.train_step(lambda prm, b: loss_of(sm.apply(prm, b[0]), b[1]), cfg, optimizer=optimizer)
        per_step = []
        for _ in range(steps):
            if record:
                comm.reset()
            state, _ = step(state, data(comm.rank))
            per_step.append(comm.ring_bytes_sent() if record else None)
        return sm.gather(state), per_step, state

    return simulated_world(n).run(rank)


def setup(n):
    torch.manual_seed(0)
    model = Tiny().double()
    x, y = torch.randn(4 * n, 5, dtype=torch.float64), torch.randn(4 * n, 3, dtype=torch.float64)
    return model, lambda r: (x[4 * r:4 * r + 4], y[4 * r:4 * r + 4])


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("kind", list(CASES))
def test_equals_a_float64_simulation_of_deepspeeds_algorithm(kind, n):
    """Every rank's parameters within 1e-9 of the reference's after the warm-up and the compressed
    steps (0/1 Adam: its variance steps, compressed-gradient steps, frozen local steps with
    a growing interval, so ranks' parameters differ between exchanges)."""
    params, ref, steps = CASES[kind]
    model, data = setup(n)
    want = ref(model, data, n, steps, {**params, "betas": tuple(params["betas"])})
    got = run_fnzero(model, data, config(kind, params, n), steps, n)
    for r, (params_r, _, _) in enumerate(got):
        for k in want[r]:
            torch.testing.assert_close(params_r[k], want[r][k], rtol=0, atol=1e-9, msg=lambda msg: f"{kind} r{r} {k}: {msg}")
    moved = got[0][0]["a.weight"] - model.a.weight
    assert moved.abs().max() > 1e-3


@pytest.mark.parametrize("kind", list(CASES))
def test_the_configs_chain_given_as_optimizer_trains_bit_for_bit_as_the_config(kind):
    """The 1-bit types are chains too (`chain_from_config`): given as `optimizer=` on 2 simulated
    ranks, through the freeze and compressed steps, every rank's parameters equal the config's own
    run exactly (the chain declares the same fused step and that it exchanges its gradients)."""
    params, _, steps = CASES[kind]
    model, data = setup(2)
    cfg = config(kind, params, 2)
    tx = optim.chain_from_config(cfg)
    assert tx.exchanges_gradients
    for (want, _, _), (got, _, _) in zip(run_fnzero(model, data, cfg, steps, 2),
                                         run_fnzero(model, data, cfg, steps, 2, optimizer=tx)):
        assert all(torch.equal(got[k], want[k]) for k in want), kind


def test_compressed_all_reduce_is_pure_and_equals_the_reference():
    """Two tensors of odd sizes in one call, with errors from a first call: results and errors equal
    the reference, inputs untouched; the bytes are the formula's, signs in uint8."""
    n = 4
    torch.manual_seed(3)
    xs = [[torch.randn(3, 11, dtype=torch.float64), torch.randn(5, dtype=torch.float64)] for _ in range(n)]

    def rank(comm):
        rec = RecordingCollectives(comm)
        mine = xs[comm.rank]
        copies = [t.clone() for t in mine]
        empty = [t.new_zeros(0) for t in mine]
        first = compressed_all_reduce(rec, mine, empty, empty)
        rec.reset()
        second = compressed_all_reduce(rec, mine, first.worker_errors, first.server_errors)
        assert all(torch.equal(a, b) for a, b in zip(mine, copies))
        return first, second, rec.records, rec.ring_bytes_sent()

    out = simulated_world(n).run(rank)
    for i in range(2):
        r1, w, s = ref_compressed([x[i] for x in xs], [None] * n, [None] * n)
        r2, w, s = ref_compressed([x[i] for x in xs], w, s)
        for r in range(n):
            torch.testing.assert_close(out[r][1].results[i], r2, rtol=0, atol=1e-12)
            torch.testing.assert_close(out[r][1].worker_errors[i], w[r], rtol=0, atol=1e-12)
            torch.testing.assert_close(out[r][1].server_errors[i], s[r], rtol=0, atol=1e-12)
    records = out[0][2]
    assert [(x.op, x.dtype) for x in records] == [("all_to_all", torch.uint8), ("all_gather", torch.float64),
                                                  ("all_gather", torch.uint8), ("all_gather", torch.float64)]
    signs = (padded(33, n) + padded(5, n)) // 8  # 4 ranks pad to multiples of 32: 64 + 32 signs, 12 bytes
    assert out[0][3] == 2 * (n - 1) / n * signs + 2 * (n - 1) * 2 * 8
    assert fnzero.sharding.compressed_bytes([33, 5], n, 8) == out[0][3]


@pytest.mark.parametrize("kind", ["OneBitAdam", "OneBitLamb"])
def test_bytes_per_step_after_the_freeze_equal_the_formula(kind):
    """Before the freeze a step all-reduces every gradient (4Ψ·2(N−1)/N with Ψ=Σ numel, fp64 here:
    8Ψ); after it, the compressed exchange's formula plus the step's norm-and-loss all-reduce
    (two float64). 1-bit Adam compresses per tensor; 1-bit LAMB one flat buffer."""
    n = 4
    params, _, steps = CASES[kind]
    model, data = setup(n)
    got = run_fnzero(model, data, config(kind, params, n), steps, n, record=True)
    numels = [p.numel() for p in model.parameters()]
    units = [padded_unit(sum(p.numel() for p in mod.parameters()), n) for mod in (model.a, model.b)]
    scalars = 2 * (n - 1) / n * 16
    full = 2 * (n - 1) / n * 8 * sum(units) + scalars  # each module one unit, padded to a multiple of N
    compressed = fnzero.sharding.compressed_bytes(numels if kind == "OneBitAdam" else [sum(numels)], n, 8) + scalars
    per_step = got[0][1]
    assert per_step[1] == full and per_step[-1] == compressed
    assert compressed < full / 2  # tiny tensors: padded to N·lcm(N, 8) elements, and 2 scales each
    fp32 = 2 * (n - 1) / n * 4 * 10**6  # one million fp32 elements: the signs are 1/32 of it, plus 2 scales
    assert fnzero.sharding.compressed_bytes([10**6], n) == fp32 / 32 + 2 * (n - 1) * 4


def test_refused_combinations_each_name_the_key():
    base = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "OneBitAdam", "params": {"freeze_step": 2}}}
    cases = [
        ({"zero_optimization": {"stage": 1}}, "zero_optimization.stage"),
        ({"zero_optimization": {"stage": 0, "offload_optimizer": {"device": "cpu"}}}, "offload_optimizer"),
        ({"optimizer": {"type": "OneBitLamb", "params": {}}, "fp16": {"enabled": True, "loss_scale": 128}},
         "fp16.loss_scale"),
        ({"optimizer": {"type": "OneBitAdam", "params": {"freeze_step": -1}}}, "freeze_step"),
        ({"optimizer": {"type": "ZeroOneAdam", "params": {"var_update_scaler": 0}}}, "var_update_scaler"),
        ({"optimizer": {"type": "OneBitLamb", "params": {"factor_min": 5.0}}}, "factor_min"),
        ({"optimizer": {"type": "OneBitAdam", "params": {"amsgrad": True}}}, "amsgrad"),
        ({"tensor_parallel": {"autotp_size": 2}}, "tensor_parallel"),
    ]
    for extra, key in cases:
        with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
            fnzero.load_config({**base, **extra}, world_size=4)


def test_no_effect_keys_warn_and_a_sharded_state_is_refused():
    with pytest.warns(fnzero.config.ConfigWarning, match="comm_backend_name"):
        fnzero.load_config({"train_micro_batch_size_per_gpu": 1, "optimizer": {
            "type": "OneBitAdam", "params": {"comm_backend_name": "mpi"}}})
    with pytest.warns(fnzero.config.ConfigWarning, match="cuda_aware"):
        fnzero.load_config({"train_micro_batch_size_per_gpu": 1, "optimizer": {
            "type": "ZeroOneAdam", "params": {"cuda_aware": True}}})
    model, data = setup(2)
    cfg = fnzero.load_config({"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 2},
                              "optimizer": {"type": "AdamW"}}, world_size=2)
    opt = optim.onebit_adam(freeze_step=2)

    def rank(comm):
        sm = fnzero.shard(Tiny().double(), config=cfg, comm=comm)
        step = fnzero.train_step(lambda prm, b: loss_of(sm.apply(prm, b[0]), b[1]), cfg, optimizer=opt)
        with pytest.raises(ShardingError, match="ZeRO stage 0"):
            step(sm.init_state(optimizer=opt), data(comm.rank))

    simulated_world(2).run(rank)


def test_an_update_without_the_exchange_says_what_it_needs():
    opt = optim.onebit_adam(freeze_step=0)
    p = {"w": torch.ones(3)}
    s = opt.init(p)
    for _ in range(2):
        p, s = opt.update({"w": torch.ones(3)}, s, p)
    assert opt.local_gradients(s)
    with pytest.raises(ConfigError, match="compressed_all_reduce="):
        opt.update({"w": torch.ones(3)}, s, p)
    from fnzero.sharding import LocalCollectives
    p2, _ = opt.update({"w": torch.ones(3)}, s, p,
                       compressed_all_reduce=functools.partial(compressed_all_reduce, LocalCollectives()))
    assert not torch.equal(p2["w"], p["w"])


@pytest.mark.parametrize("kind", list(CASES))
def test_checkpoint_resumes_at_the_same_world_and_refuses_another(kind, tmp_path):
    """Saved after the freeze (each rank's errors under its own key), loaded into a fresh state on
    the same 2 ranks: the next step equals the saving run's. Loading on 4 ranks is refused, naming
    the errors; 0/1 Adam between two exchanges refuses to save (its ranks' parameters differ)."""
    params, _, steps = CASES[kind]
    model, data = setup(4)
    cfg2, cfg4 = config(kind, params, 2), config(kind, params, 4)

    def rank(comm):
        m = Tiny().double()
        m.load_state_dict(model.state_dict())
        sm = fnzero.shard(m, config=cfg2, comm=comm)
        state = sm.init_state()
        fresh = fnzero.tree_clone(state)
        step = fnzero.train_step(lambda prm, b: loss_of(sm.apply(prm, b[0]), b[1]), cfg2)
        for _ in range(steps - 1):
            state, _ = step(state, data(comm.rank))
        if kind == "ZeroOneAdam":  # steps 8 and 10 exchange: after 9 the ranks are between exchanges
            with pytest.raises(fnzero.CheckpointError, match="between two exchanges"):
                fnzero.checkpoint.save(str(tmp_path), state)
            state, _ = step(state, data(comm.rank))
        fnzero.checkpoint.save(str(tmp_path), state)
        loaded, _ = fnzero.checkpoint.load(str(tmp_path), fresh)
        for a, b in ((state.opt_state.worker_error, loaded.opt_state.worker_error),
                     (state.opt_state.server_error, loaded.opt_state.server_error)):
            assert all(torch.equal(x, y) for x, y in zip(optim_leaves(a), optim_leaves(b)))
        want, _ = step(state, data(comm.rank))
        got, _ = step(loaded, data(comm.rank))
        return sm.gather(want), sm.gather(got)

    # 0/1 Adam's ranks agree on their parameters after an exchange up to rounding (each undid its own
    # local steps), and the checkpoint holds each rank's part: equal within 1e-15, the others exactly.
    tol = 1e-15 if kind == "ZeroOneAdam" else 0.0
    for want, got in simulated_world(2).run(rank):
        for k in want:
            torch.testing.assert_close(got[k], want[k], rtol=0, atol=tol, msg=lambda msg: f"{k}: {msg}")

    def rank4(comm):
        m = Tiny().double()
        m.load_state_dict(model.state_dict())
        sm = fnzero.shard(m, config=cfg4, comm=comm)
        with pytest.raises(fnzero.CheckpointError, match="saved by 2 ranks and cannot be resharded to 4"):
            fnzero.checkpoint.load(str(tmp_path), sm.init_state())

    simulated_world(4).run(rank4)


def optim_leaves(tree):
    import optree
    return optree.tree_leaves(tree)


def _on_gloo():
    """Every optimizer's run on this spawned gloo rank (the exchange's uint8 all-to-all and all-gathers
    over torch.distributed), the parameters gathered."""
    from fnzero.sharding import ProcessGroupCollectives

    comm = ProcessGroupCollectives()
    model, data = setup(comm.world_size)
    out = {}
    for kind, (params, _, steps) in CASES.items():
        cfg = config(kind, params, comm.world_size)
        m = Tiny().double()
        m.load_state_dict(model.state_dict())
        sm = fnzero.shard(m, config=cfg, comm=comm)
        state = sm.init_state()
        step = fnzero.train_step(lambda prm, b, sm=sm: loss_of(sm.apply(prm, b[0]), b[1]), cfg)
        for _ in range(steps):
            state, _ = step(state, data(comm.rank))
        out[kind] = sm.gather(state)
    return out


@pytest.mark.multiprocess
def test_spawned_gloo_ranks_equal_the_simulation():
    """Two real gloo processes: each optimizer's parameters equal the reference's (1e-9)."""
    from fnzero.testing import run_world

    got = run_world(_on_gloo, 2, timeout=120)
    model, data = setup(2)
    for kind, (params, ref, steps) in CASES.items():
        want = ref(model, data, 2, steps, {**params, "betas": tuple(params["betas"])})
        for r in range(2):
            for k in want[r]:
                torch.testing.assert_close(got[r][kind][k], want[r][k], rtol=0, atol=1e-9,
                                           msg=lambda msg: f"{kind} r{r} {k}: {msg}")


def test_fp16_overflow_verdict_is_every_ranks_after_the_freeze():
    """fp16 with dynamic loss scaling, the scale so high that local gradients overflow on one rank
    only: every rank skips the same steps (the norm all-reduce carries the verdict), and training
    resumes with the lowered scale, the ranks' parameters equal."""
    n = 2
    model, data = setup(n)
    cfg = fnzero.load_config({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
                              "zero_optimization": {"stage": 0}, "fp16": {"enabled": True, "initial_scale_power": 12},
                              "optimizer": {"type": "OneBitAdam", "params": {**ONEBIT, "freeze_step": 2}}}, world_size=n)

    def rank(comm):
        m = Tiny().float()
        m.load_state_dict(model.state_dict())
        sm = fnzero.shard(m, config=cfg, comm=comm)
        state = sm.init_state()
        step = fnzero.train_step(lambda prm, b: loss_of(sm.apply(prm, b[0]).float(), b[1].float()), cfg)
        skipped = []
        for i in range(8):
            x, y = data(comm.rank)
            if i == 4 and comm.rank == 1:  # after the freeze: rank 1's own gradient overflows
                y = y * 1e6
            state, metrics = step(state, (x, y))
            skipped.append(metrics["skipped"])
        return skipped, sm.gather(state)

    (s0, p0), (s1, p1) = simulated_world(n).run(rank)
    assert s0 == s1 and s0[4] and not s0[-1]
    for k in p0:
        assert torch.equal(p0[k], p1[k])
