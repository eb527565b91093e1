"""ZeRO++'s quantized collectives: the codec's error bound and byte count, the quantized all-gather
and all-to-all reduce-scatter, and qwZ / qgZ in training (specs/collectives.md §Quantized collectives)."""

import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

import fnzero
from fnzero import BlockQuantizer, CommQuantization, ConfigError, IdentityCodec, RecordingCollectives
from fnzero.sharding import dequantize, quantize, quantized_all_gather_async, quantized_reduce_scatter_async
from fnzero.testing import GPT, seeded
from fnzero.testing._threads import simulated_world

IDENTITY = IdentityCodec()
INT8 = BlockQuantizer()


# -- §Quantized collectives.Codec ------------------------------------------------------------------
def _scales_bound(x: torch.Tensor, block: int, bits: int) -> torch.Tensor:
    """Per element, half its block's float32 scale fl32(absmax / qmax): the spec's bound."""
    qmax = 2 ** (bits - 1) - 1
    nb = -(-x.numel() // block)
    rows = torch.nn.functional.pad(x.double(), (0, nb * block - x.numel())).view(nb, block)
    s = (rows.abs().amax(dim=1) / qmax).float().double()
    return (s / 2).repeat_interleave(block)[: x.numel()]


# Magnitudes from 1e-30 (the bound needs absmax/qmax to be a normal float32, >= 2^-126) to 1e4.
_magnitudes = st.one_of(st.floats(1e-3, 1e4), st.floats(1e-30, 1e-3))
_values = st.one_of(st.just(0.0), _magnitudes, _magnitudes.map(lambda v: -v))


@settings(max_examples=60, deadline=None)
@given(values=st.lists(_values, min_size=0, max_size=300), block=st.integers(1, 70), bits=st.sampled_from([8, 4]),
       dtype=st.sampled_from([torch.float64, torch.float32]))
def test_codec_error_is_within_half_a_scale_per_block(values, block, bits, dtype):
    x = torch.tensor(values, dtype=dtype)
    q, scales = quantize(x, block, bits)
    assert q.dtype == torch.int8 and scales.dtype == torch.float32
    assert q.numel() == x.numel() and scales.numel() == math.ceil(x.numel() / block)
    assert int(q.abs().max()) <= 2 ** (bits - 1) - 1 if q.numel() else True
    back = dequantize(q, scales, block, dtype)
    bound = _scales_bound(x, block, bits)
    # Computed in float32 for float32 input: plus half an ulp of the result.
    slack = back.double().abs() * 2.0 ** -24 if dtype == torch.float32 else 0
    assert bool(((back.double() - x.double()).abs() <= bound + slack).all())
    # absmax / (2 qmax) per block, the bound stated relative to the block's absmax
    assert bool((bound <= _scales_bound(x, block, bits) * (1 + 2.0 ** -24)).all())

    codec = BlockQuantizer(bits=bits, block=block)
    enc = codec.encode(x)
    payload = x.numel() if bits == 8 else (x.numel() + 1) // 2
    assert enc.dtype == torch.uint8 and enc.numel() == codec.nbytes(x.numel(), dtype) == payload + 4 * scales.numel()
    assert torch.equal(codec.decode(enc, x.numel(), dtype), back)
    assert torch.equal(IDENTITY.decode(IDENTITY.encode(x), x.numel(), dtype), x)


def test_codec_zero_and_nonfinite_blocks():
    x = torch.tensor([0.0, 0.0, 1.0, float("inf"), 2.0, 3.0, float("nan"), 1.0])
    back = INT8.decode(INT8.encode(x), 8, x.dtype)
    assert torch.equal(BlockQuantizer(block=2).decode(BlockQuantizer(block=2).encode(x), 8, x.dtype)[:2], x[:2])
    assert not bool(torch.isfinite(back).any())  # one block of 4096: the overflow is seen by fp16 loss scaling
    b2 = BlockQuantizer(block=2)
    back2 = b2.decode(b2.encode(x), 8, x.dtype)
    assert torch.equal(back2[:2], torch.zeros(2)) and bool(torch.isnan(back2[2:4]).all() and torch.isnan(back2[6:]).all())
    assert bool(torch.isfinite(back2[4:6]).all())
    with pytest.raises(fnzero.ShardingError, match="bits must be 4 or 8"):
        BlockQuantizer(bits=2)


def test_quantized_collectives_over_a_world_of_three():
    """Identity: exactly the plain collectives. int8: within the bounds, every rank the same buffer."""
    n, s = 3, 10

    def rank_fn(comm):
        g = torch.Generator().manual_seed(comm.rank)
        shard = torch.randn(s, dtype=torch.float64, generator=g)
        full = torch.randn(n * 7, dtype=torch.float64, generator=g)
        plain_ag, plain_rs = comm.all_gather(shard), comm.reduce_scatter(full)
        ident = (quantized_all_gather_async(comm, shard, IDENTITY).wait(),
                 quantized_reduce_scatter_async(comm, full, IDENTITY).wait())
        codec = BlockQuantizer(block=4)
        q_ag = quantized_all_gather_async(comm, shard, codec).wait()
        q_rs = quantized_reduce_scatter_async(comm, full, codec).wait()
        chunks = full.view(n, 7)
        return plain_ag, plain_rs, ident, q_ag, q_rs, shard, chunks

    out = simulated_world(n).run(rank_fn)
    shards = torch.cat([o[5] for o in out])
    for r, (plain_ag, plain_rs, (i_ag, i_rs), q_ag, q_rs, _, _) in enumerate(out):
        assert torch.equal(i_ag, plain_ag) and torch.allclose(i_rs, plain_rs, rtol=0, atol=1e-15)
        assert torch.equal(q_ag, out[0][3])  # every rank decodes every shard alike
        bound = torch.cat([_scales_bound(o[5], 4, 8) for o in out])
        assert bool(((q_ag - shards).abs() <= bound).all())
        rs_bound = sum(_scales_bound(o[6][r], 4, 8) for o in out)
        assert bool(((q_rs - plain_rs).abs() <= rs_bound + 1e-12).all())


# -- qwZ / qgZ in training ---------------------------------------------------------------------------
def _cfg(stage, world, precision="fp32", lr=1e-2, **zero):
    c = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": lr}},
         "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0,
                               "stage3_max_reuse_distance": 0, **zero}}
    if precision == "bf16":
        c["bf16"] = {"enabled": True}
    return fnzero.load_config(c, world_size=world)


def _model(dtype=torch.float64, freeze=False):
    with seeded(0):  # ranks are threads sharing one generator: seed and build alone
        m = GPT(vocab_size=64, seq_len=8, d_model=32, n_layer=2, n_head=2).to(dtype)
    if freeze:
        for p in m.blocks[0].fc.parameters():
            p.requires_grad_(False)
    return m


def _train(stage, world, quantization=None, steps=3, precision="fp32", dtype=torch.float64, freeze=False,
           same_batch=False, lr=1e-2, **zero):
    """Each rank's (losses, final params, records of the last step); a new batch each step, or the
    first one again (`same_batch`, to see the loss fall)."""
    cfg = _cfg(stage, world, precision, lr, **zero)

    def rank_fn(comm):
        rec = RecordingCollectives(comm)
        sm = fnzero.shard(_model(dtype, freeze), config=cfg, comm=rec, comm_quantization=quantization)
        state = sm.init_state()
        step = fnzero.train_step(
            lambda p, b: torch.nn.functional.cross_entropy(sm.apply(p, b[0]).flatten(0, 1).double(), b[1].flatten()), cfg)
        g = torch.Generator().manual_seed(100 + comm.rank)
        losses = []
        x = torch.randint(0, 64, (2, 8), generator=g)
        for _ in range(steps):
            x = x if same_batch else torch.randint(0, 64, (2, 8), generator=g)
            rec.reset()
            state, m = step(state, (x, x.roll(1, dims=1)))
            losses.append(float(m["loss"]))
        return losses, {k: v.double() for k, v in state.params.items()}, rec.reset()

    return simulated_world(world).run(rank_fn)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("stage", [2, 3])
def test_identity_codec_trains_exactly_as_unquantized(stage, world):
    ident = CommQuantization(weights=IDENTITY if stage == 3 else None, gradients=IDENTITY,
                             frozen_weights=IDENTITY if stage == 3 else None)
    freeze = stage == 3 and world == 2  # frozen units' gathers too
    plain = _train(stage, world, freeze=freeze)
    quant = _train(stage, world, ident, freeze=freeze)
    for (l0, p0, _), (l1, p1, recs) in zip(plain, quant):
        assert l0 == pytest.approx(l1, abs=1e-12, rel=0)
        for k in p0:
            assert float((p0[k] - p1[k]).abs().max()) <= 1e-12, k
        # what travelled went through the codec: bytes in place of the gradient reduce-scatters
        ops = {(r.op, r.dtype) for r in recs}
        assert ("all_to_all", torch.uint8) in ops and not any(r.op == "reduce_scatter" for r in recs)
        if stage == 3:
            assert ("all_gather", torch.float64) not in ops and ("all_gather", torch.uint8) in ops


def _by_op(records, op):
    return [r for r in records if r.op == op]


@pytest.mark.parametrize("precision,dtype,itemsize", [("bf16", torch.float32, 2), ("fp32", torch.float32, 4)])
def test_qwz_and_qgz_bytes_follow_the_formulas(precision, dtype, itemsize):
    """qwZ: each gather N·(s + 4⌈s/4096⌉) bytes against N·s·b; qgZ: each reduce-scatter becomes an
    all-to-all of (N−1)·(c + 4⌈c/4096⌉) bytes leaving the rank, against (N−1)·c·b ring-equivalent."""
    n = 2
    plain = _train(3, n, steps=2, precision=precision, dtype=dtype)[0][2]
    quant = _train(3, n, CommQuantization(weights=INT8, gradients=INT8), steps=2, precision=precision, dtype=dtype)[0][2]
    plain_ag, quant_ag = _by_op(plain, "all_gather"), _by_op(quant, "all_gather")
    assert len(plain_ag) == len(quant_ag) > 0
    for p, q in zip(plain_ag, quant_ag):
        s = p.numel // n
        assert p.bytes == n * s * itemsize and q.dtype == torch.uint8
        assert q.bytes == n * (s + 4 * math.ceil(s / 4096))
    total_plain = sum(r.bytes for r in plain_ag)
    scales = sum(4 * n * math.ceil(r.numel // n / 4096) for r in plain_ag)
    assert sum(r.bytes for r in quant_ag) == total_plain // itemsize + scales  # half of bf16, a quarter of fp32
    plain_rs, quant_a2a = _by_op(plain, "reduce_scatter"), _by_op(quant, "all_to_all")
    assert len(plain_rs) == len(quant_a2a) > 0 and not _by_op(quant, "reduce_scatter")
    for p, q in zip(plain_rs, quant_a2a):
        c = p.numel // n
        assert q.bytes == (n - 1) * (c + 4 * math.ceil(c / 4096))
        ring = p.bytes * (n - 1) / n
        assert q.bytes == ring / itemsize + (n - 1) * 4 * math.ceil(c / 4096)


def test_int8_training_stays_close_to_unquantized():
    """fp32 GPT, stage 3, qwZ + qgZ, 2 ranks, 8 AdamW steps at lr 3e-3 on one batch per rank. Each
    weight travels with at most m/254 error (m its block's absmax): the first step, before any
    update, differs by the forward at quantized weights alone (measured 3.4e-4 relative). After it,
    Adam's normalised update turns a quantized gradient's small change into a whole step of lr for
    the weights whose gradient is near zero, so the runs drift apart (measured 0.31 % at most). The
    bound is the issue's 2 % (six times that); it fails on a codec that drops scales or blocks."""
    plain = _train(3, 2, steps=8, dtype=torch.float32, same_batch=True, lr=3e-3)[0][0]
    quant = _train(3, 2, CommQuantization(weights=INT8, gradients=INT8), steps=8, dtype=torch.float32,
                   same_batch=True, lr=3e-3)[0][0]
    assert plain[-1] < 0.8 * plain[0] and quant[-1] < 0.8 * quant[0]  # both learn
    for a, b in zip(plain, quant):
        assert abs(a - b) <= 0.02 * a, (plain, quant)
    assert plain != quant  # the codec did act


def test_stages_that_move_nothing_quantizable_are_refused():
    for key, stage in (("zero_quantized_weights", 2), ("zero_quantized_nontrainable_weights", 2),
                       ("zero_quantized_gradients", 1)):
        with pytest.raises(ConfigError, match=f"`zero_optimization.{key}` is true but `zero_optimization.stage` is {stage}"):
            _cfg(stage, 1, **{key: True})
    cfg = _cfg(3, 1, zero_quantized_weights=True, zero_quantized_gradients=True)
    assert cfg.zero_optimization.zero_quantized_weights and cfg.zero_optimization.zero_quantized_gradients
    with pytest.raises(ConfigError, match="zero_quantized_weights` quantizes what ZeRO stage 3 moves, but this run is stage 2"):
        fnzero.shard(_model(), stage=2, config=cfg)
    with pytest.raises(ConfigError, match="zero_quantized_gradients` quantizes what ZeRO stage 2 moves, but this run is stage 1"):
        fnzero.shard(_model(), stage=1, comm_quantization=CommQuantization(gradients=INT8))
    sm = fnzero.shard(_model(), config=cfg)
    assert sm.sharding.quantization == CommQuantization(weights=INT8, gradients=INT8)


def test_identity_codec_with_offload_optimizer_and_the_whole_step_fallback():
    """The quantized reduce-scatter feeds the host optimizer as the plain one does (stage 3, cpu
    offload); `fnzero.jit(scope="step")` leaves qgZ's eager collectives out of its graph."""
    from fnzero.train._whole_step import whole_step_unsupported

    off = {"offload_optimizer": {"device": "cpu"}}  # the host Adam is float32
    plain = _train(3, 2, dtype=torch.float32, **off)
    quant = _train(3, 2, CommQuantization(weights=IDENTITY, gradients=IDENTITY), dtype=torch.float32, **off)
    for (l0, p0, _), (l1, p1, _) in zip(plain, quant):
        assert l0 == l1 and all(torch.equal(p0[k], p1[k]) for k in p0)
    cfg = _cfg(2, 1)
    sm = fnzero.shard(_model(), config=cfg, comm_quantization=CommQuantization(gradients=INT8))
    why = whole_step_unsupported(fnzero.train_step(lambda p, b: sm.apply(p, b).sum(), cfg), sm.init_state())
    assert why is not None and "zero_quantized_gradients" in why


def test_an_overflowed_fp16_gradient_stays_an_overflow_through_qgz():
    """A non-finite gradient decodes to NaN (its whole block), so fp16 loss scaling skips the step."""
    def rank_fn(comm):
        cfg = fnzero.load_config({"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW"},
                                  "fp16": {"enabled": True, "initial_scale_power": 32},
                                  "zero_optimization": {"stage": 2, "zero_quantized_gradients": True}}, world_size=2)
        sm = fnzero.shard(_model(torch.float32), config=cfg, comm=comm)
        step = fnzero.train_step(
            lambda p, b: torch.nn.functional.cross_entropy(sm.apply(p, b).flatten(0, 1).float(), b.flatten()), cfg)
        state, m = step(sm.init_state(), torch.randint(0, 64, (2, 8)))
        return m["skipped"], float(m["loss_scale"])

    for skipped, scale in simulated_world(2).run(rank_fn):
        assert skipped and scale == 2.0 ** 32  # hysteresis 2: the first overflow keeps the scale


def gloo_quantized_world():
    """World function (real gloo ranks): the quantized collectives' uint8 bytes through gloo's
    all-to-all and fnzero's direct all-gather, and a stage-3 run with qwZ + qgZ. Returns this
    rank's largest differences: identity against plain collectives and training, int8 against
    its bound, and the int8 run's losses against the plain run's."""
    from fnzero.sharding.comm._collectives import ProcessGroupCollectives

    comm = ProcessGroupCollectives()
    g = torch.Generator().manual_seed(comm.rank)
    shard, full = torch.randn(5000, dtype=torch.float64, generator=g), torch.randn(9000, dtype=torch.float64, generator=g)
    plain_ag, plain_rs = comm.all_gather(shard), comm.reduce_scatter(full)
    out = {
        "identity_ag": float((quantized_all_gather_async(comm, shard, IDENTITY).wait() - plain_ag).abs().max()),
        "identity_rs": float((quantized_reduce_scatter_async(comm, full, IDENTITY).wait() - plain_rs).abs().max()),
    }
    q_ag = quantized_all_gather_async(comm, shard, INT8).wait()
    bound = torch.cat([_scales_bound(s, 4096, 8) for s in plain_ag.view(comm.world_size, -1)])
    out["int8_ag_over_bound"] = float(((q_ag - plain_ag).abs() - bound).max())

    def run(quantization):
        cfg = _cfg(3, comm.world_size)
        sm = fnzero.shard(_model(), config=cfg, comm=comm, comm_quantization=quantization)
        step = fnzero.train_step(
            lambda p, b: torch.nn.functional.cross_entropy(sm.apply(p, b[0]).flatten(0, 1), b[1].flatten()), cfg)
        state, losses = sm.init_state(), []
        x = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(7 + comm.rank))
        for _ in range(3):
            state, m = step(state, (x, x.roll(1, dims=1)))
            losses.append(float(m["loss"]))
        return losses, state.params

    (l0, p0), (l1, p1) = run(None), run(CommQuantization(weights=IDENTITY, gradients=IDENTITY))
    out["identity_training"] = max(float((p0[k] - p1[k]).abs().max()) for k in p0)
    l2, _ = run(CommQuantization(weights=INT8, gradients=INT8))
    out["int8_loss_rel"] = max(abs(a - b) / a for a, b in zip(l0, l2))
    return out


@pytest.mark.multiprocess
def test_quantized_collectives_on_real_gloo_ranks():
    from fnzero.testing import run_world

    for r in run_world(gloo_quantized_world, 2, timeout=300):
        assert r["identity_ag"] == 0.0 and r["identity_rs"] <= 1e-15 and r["identity_training"] <= 1e-12, r
        assert r["int8_ag_over_bound"] <= 0.0 and 0.0 < r["int8_loss_rel"] <= 0.02, r
