"""Every ZeRO stage equals the unsharded single-process reference (specs/sharding.md §Equivalence).

The reference is plain PyTorch (torch.optim.AdamW, loss.backward over micro-batches,
clip_grad_norm_) on the global batch; fnzero runs each rank on its slice. In float64 the
parameters after the run agree to 1e-9 relative: the only differences are reduction order, ~1e-16
per operation. (In fp32, Adam turns reduction-order noise in parameters whose true gradient is zero
into lr-sized steps, which would measure noise rather than sharding; fp32 is checked on losses.)

Hypothesis draws models and worlds on the thread-simulated world (cheap); real gloo processes run
the fixed matrix in test_zero_multiprocess.py.
"""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import _worlds as W
from fnzero.testing._threads import simulated_world

RTOL_F64 = 1e-9  # float64 reduction-order differences are ~1e-15 after 10 steps; 1e-9 leaves margin


def _check(kind, stage, world, k, clip, steps, rtol=RTOL_F64):
    ref = W.train_reference(kind, steps, world, k=k, clip=clip)
    results = simulated_world(world).run(lambda comm: W.train_fnzero(kind, stage, steps, comm, k=k, clip=clip))
    for rank, r in enumerate(results):
        W.assert_close_tree(r["params"], ref["params"], rtol=rtol, atol=1e-12, what=f"stage {stage} rank {rank}/{world}")
        assert r["losses"] == pytest.approx(ref["losses"], rel=rtol)


awkward_mlps = st.lists(st.integers(1, 9), min_size=2, max_size=4).map(lambda s: "mlp:" + ",".join(map(str, s)))


@given(kind=awkward_mlps, stage=st.integers(0, 3), world=st.integers(1, 5), k=st.integers(1, 3), clip=st.sampled_from([0.0, 0.05, 1.0]))
@settings(max_examples=30)
def test_drawn_mlps_match_reference(kind, stage, world, k, clip):
    _check(kind, stage, world, k, clip, steps=4)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("world", [1, 2, 4])
def test_gpt_matches_reference(stage, world):
    _check("gpt", stage, world, k=2, clip=0.5, steps=10)


@pytest.mark.parametrize("stage", [0, 3])
def test_tied_and_frozen_parameters(stage):
    _check("gpt_tied", stage, 3, k=1, clip=1.0, steps=5)
    _check("mlp_frozen", stage, 2, k=2, clip=0.0, steps=5)


def test_a_dropped_shard_gradient_is_caught():
    """The check above can fail: zeroing one rank's gradient contribution breaks equivalence."""
    from fnzero.sharding.comm import _collectives

    class Dropping(_collectives.LocalCollectives):
        pass

    ref = W.train_reference("mlp:3,4,2", 3, 2)

    def broken(comm):
        inner = comm.reduce_scatter

        def reduce_scatter(full):
            return inner(full * (0 if comm.rank == 1 else 1))

        comm.reduce_scatter = reduce_scatter
        return W.train_fnzero("mlp:3,4,2", 2, 3, comm)

    got = simulated_world(2).run(broken)[0]
    with pytest.raises(AssertionError, match="elements differ"):
        W.assert_close_tree(got["params"], ref["params"], rtol=RTOL_F64)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_frozen_parameters_join_the_16bit_forward(precision):
    """A frozen embedding is cast to the compute dtype with the rest (it used to stay fp32)."""
    import fnzero
    from fnzero.testing import GPT

    model = GPT(vocab_size=11, seq_len=4, d_model=8, n_layer=1, n_head=2)
    model.wte.weight.requires_grad_(False)
    cfg = W.config(2, precision=precision, world=1)
    sm = fnzero.shard(model, config=cfg)
    state = sm.init_state()
    assert state.frozen["wte.weight"].dtype == state.params["blocks.0"].dtype
    step = fnzero.train_step(lambda p, b: W.loss_of("gpt", sm.apply(p, b), b), cfg)
    _, m = step(state, torch.randint(0, 11, (2, 4)))
    assert m["loss"] > 0 and not m["skipped"]


@pytest.mark.parametrize("stage", [2, 3])
def test_fp16_sums_across_ranks_do_not_overflow(stage):
    """At the default 2^16 loss scale, 16-bit gradients are divided by N before the cross-rank sum,
    so four ranks skip no step that one process would not skip."""
    extra = {"fp16": {"enabled": True}}  # initial_scale_power 16
    one = simulated_world(1).run(lambda c: W.train_fnzero("gpt", stage, 3, c, dtype=torch.float32, precision="fp16", extra=extra))[0]
    four = simulated_world(4).run(lambda c: W.train_fnzero("gpt", stage, 3, c, dtype=torch.float32, precision="fp16", extra=extra))[0]
    assert [m["skipped"] for m in four["metrics"]] == [m["skipped"] for m in one["metrics"]]
