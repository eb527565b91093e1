"""Each fnzero.testing assertion passes on correct code and fails, naming the pytree path, the rank
and the size of the difference, on deliberately broken code (specs/testing.md §Assertions)."""

from __future__ import annotations

import math

import re

import pytest
import torch

import fnzero
import fnzero.testing as ft
from fnzero.sharding import CollectivesBase
from fnzero.sharding.zero._plan import UnitPlan

MLP = ft.ModelFactory("mlp", sizes=(3, 5, 2))
GPT = ft.ModelFactory("gpt", gpt=tuple(sorted(dict(vocab_size=11, seq_len=4, d_model=6, n_layer=2, n_head=2, mlp_ratio=1, tied=True).items())))


def cfg(stage, k=1, clip=1.0, precision=None):
    d = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": k, "gradient_clipping": clip,
         "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}},
         "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}
    if precision:
        # fp16: a moderate initial scale. With 2**16, N ranks' fp16 gradients summed in the
        # reduction overflow where the one-process reference's do not (skips then differ).
        d[precision] = {"enabled": True, **({"initial_scale_power": 8} if precision == "fp16" else {})}
    return fnzero.load_config(d)


# -- assert_trees_close -------------------------------------------------------------------------------
def test_trees_close_names_path_count_and_magnitude():
    a = {"w": torch.zeros(2, 3, dtype=torch.float64), "b": [torch.ones(4), 1.5]}
    b = ft.tree_snapshot(a)
    b["w"][1, 2] = 1e-3
    with pytest.raises(AssertionError) as e:
        ft.assert_trees_close(b, a, rtol=1e-9, atol=1e-12, what="rank 3", root="params")
    msg = str(e.value)
    assert "rank 3: params['w']: 1 of 6 elements differ; max abs diff 0.001" in msg
    assert "at index (1, 2)" in msg
    ft.assert_trees_close(b, a, atol=2e-3)


def test_trees_close_structure_dtype_scalars_and_nan():
    with pytest.raises(AssertionError, match=r"missing \[\"\['b'\]\"\]"):
        ft.assert_trees_close({"a": 1.0}, {"a": 1.0, "b": 2.0})
    with pytest.raises(AssertionError, match="dtype torch.float32 vs torch.float64"):
        ft.assert_trees_close(torch.zeros(2), torch.zeros(2, dtype=torch.float64))
    with pytest.raises(AssertionError, match=r"\['loss'\]: got 1.0, want 1.1 \(abs diff 0.1"):
        ft.assert_trees_close({"loss": 1.0}, {"loss": 1.1}, rtol=1e-3)
    nan = torch.tensor([math.nan, math.inf, 1.0])
    ft.assert_trees_close(nan, nan.clone(), rtol=0)  # NaN == NaN, inf == inf
    with pytest.raises(AssertionError, match="1 of 3 elements differ"):
        ft.assert_trees_close(nan, torch.tensor([math.nan, math.inf, math.nan]))
    with pytest.raises(AssertionError, match="elements differ"):
        ft.assert_trees_close(nan, nan.clone(), equal_nan=False)


# -- assert_stage_equivalent --------------------------------------------------------------------------
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_stage_equivalent_holds(stage):
    ft.assert_stage_equivalent(MLP, MLP.loss, cfg(stage, k=2), MLP.batch(5), world_size=3, steps=3)
    ft.assert_stage_equivalent(GPT, GPT.loss, cfg(stage), GPT.batch(3), world_size=2, steps=2)


class DropContribution(CollectivesBase):
    """Collectives that zero one rank's contribution to every gradient reduction: the classic
    'a shard's gradient got lost' bug. (The async forms come from CollectivesBase, so they go
    through these too.)"""

    def __init__(self, inner, dropped_rank=1):
        self.inner, self.rank, self.world_size = inner, inner.rank, inner.world_size
        self.scale = 0.0 if inner.rank == dropped_rank else 1.0

    def reduce_scatter(self, full, donate=False):
        return self.inner.reduce_scatter(full * self.scale)

    def all_reduce(self, t, op="sum"):
        if t.numel() == 2 and t.dtype == torch.float64 and t.dim() == 1:  # the [norm², loss] scalars: keep
            return self.inner.all_reduce(t, op)
        return self.inner.all_reduce(t * self.scale, op)

    def __getattr__(self, name):
        return getattr(self.inner, name)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_stage_equivalent_catches_a_dropped_shard_gradient(stage):
    with pytest.raises(AssertionError) as e:
        ft.assert_stage_equivalent(MLP, MLP.loss, cfg(stage, clip=0.0), MLP.batch(4), world_size=2, steps=2,
                                   wrap_comm=DropContribution)
    msg = str(e.value)
    assert f"ZeRO stage {stage} on 2 simulated ranks diverged" in msg
    assert "at step 0 of 2, rank 0" in msg
    # The gradient norm is the first witness (it is computed from the reduced gradient) ...
    assert "metrics['grad_norm']: got" in msg and "abs diff" in msg


def test_stage_equivalent_names_the_parameter_when_only_parameters_differ():
    with pytest.raises(AssertionError) as e:
        # ... and with metrics passing (a huge tolerance on them is not possible per leaf, so break
        # only the parameters: a wrong update on rank 1's slice).
        ft.assert_stage_equivalent(MLP, MLP.loss, cfg(1), MLP.batch(4), world_size=2, steps=1, wrap_comm=_CorruptGather)
    msg = str(e.value)
    assert "step 0 of 1, rank 0" in msg and "params['layers." in msg and "elements differ; max abs diff" in msg


class _CorruptGather:
    """Rank 1 sends a slightly wrong shard in every all_gather after the optimizer (stage 1 has no
    other all_gather), so only the parameters are wrong."""

    def __init__(self, inner):
        self.inner, self.rank, self.world_size = inner, inner.rank, inner.world_size

    def _corrupt(self, shard):  # (not init_state's integer checksums: they are not parameters)
        return shard + 1e-3 if self.rank == 1 and shard.is_floating_point() else shard

    def all_gather(self, shard):
        return self.inner.all_gather(self._corrupt(shard))

    def all_gather_async(self, shard, out=None, label=""):  # the step starts its parameter gathers asynchronously
        return self.inner.all_gather_async(self._corrupt(shard), out=out, label=label)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_stage_equivalent_catches_overlapping_shard_ranges(monkeypatch):
    """A wrong padding/layout: rank r > 0 owns [r*s - 1, (r+1)*s - 1), overlapping rank r-1."""
    right = UnitPlan.shard_range

    def overlapping(self, rank):
        lo, hi = right(self, rank)
        return (lo - 1, hi - 1) if rank > 0 else (lo, hi)

    monkeypatch.setattr(UnitPlan, "shard_range", overlapping)
    with pytest.raises(AssertionError, match=r"(?s)ZeRO stage 2 on 3 simulated ranks.*step 0 of 2.*differ"):
        ft.assert_stage_equivalent(MLP, MLP.loss, cfg(2), MLP.batch(6), world_size=3, steps=2)


def test_stage_equivalent_extends_the_batch_and_checks_rows():
    # 5 rows on 4 ranks x 2 micro-batches: extended to 8 rows, said in the failure message.
    with pytest.raises(AssertionError, match=r"8 global rows \(extended from 5\)"):
        ft.assert_stage_equivalent(MLP, MLP.loss, cfg(3, k=2), MLP.batch(5), world_size=4, steps=1,
                                   wrap_comm=DropContribution)
    with pytest.raises(ValueError, match="disagree on the row count"):
        ft.assert_stage_equivalent(MLP, MLP.loss, cfg(0), {"x": torch.zeros(3, 3), "y": torch.zeros(2, 2)})


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_stage_equivalent_in_16_bit(precision):
    ft.assert_stage_equivalent(GPT, GPT.loss, cfg(3, precision=precision), GPT.batch(4), world_size=4, steps=3)


# -- assert_pure --------------------------------------------------------------------------------------
def _setup(stage, comm=None, **step_kw):
    c = ft._runs.derive_config(cfg(stage), None, comm.world_size if comm else 1, 2)
    sm, state = ft._runs.build(MLP, c, comm, torch.float64, 0)
    return sm, state, fnzero.train_step(ft.step_loss(sm, MLP.loss), c, **step_kw)


@pytest.mark.parametrize("stage", [0, 3])
def test_pure_holds_for_the_fnzero_step(stage):
    def fn(comm):
        sm, state, step = _setup(stage, comm)
        batch = ft._runs.rank_slice(MLP.batch(4), comm.rank, 2)
        new_state, metrics = ft.assert_pure(step, state, batch)
        return int(new_state.step)

    assert ft.simulated_world(2).run(fn) == [1, 1]


def test_pure_catches_a_donating_step():
    def fn(comm):
        _, state, step = _setup(1, comm, donate=True)
        ft.assert_pure(step, state, ft._runs.rank_slice(MLP.batch(4), comm.rank, 2))

    with pytest.raises(fnzero.DistributedError) as e:
        ft.simulated_world(2).run(fn)
    msg = str(e.value)
    # Both ranks find it; whichever reports first stops the other inside a collective, so the
    # report names either.
    assert re.search(r"rank [01] of 2: the step modified its input state: state\.params\['", msg), msg
    assert "elements differ; max abs diff" in msg


def test_pure_catches_a_step_that_edits_its_batch():
    _, state, step = _setup(0)

    def sloppy(state, batch):
        batch["x"].mul_(2)  # e.g. in-place normalisation of the input
        return step(state, batch)

    with pytest.raises(AssertionError, match=r"rank 0 of 1: the step modified its input batch: batch\['x'\]: 6 of 6"):
        ft.assert_pure(sloppy, state, MLP.batch(2))


def test_pure_catches_a_nondeterministic_step():
    _, state, step = _setup(0)

    def noisy(state, batch):
        new, m = step(state, batch)
        return new, {**m, "loss": m["loss"] + torch.rand(()).item()}

    with pytest.raises(AssertionError, match=r"not deterministic.*step\(state, batch\)\[1\]\['loss'\]"):
        ft.assert_pure(noisy, state, MLP.batch(2))


# -- assert_reshard_roundtrip -------------------------------------------------------------------------
@pytest.mark.parametrize("n,s,m,t", [(3, 3, 2, 1), (1, 0, 4, 3), (2, 2, 3, 0)])
def test_reshard_roundtrip_holds(n, s, m, t):
    ft.assert_reshard_roundtrip(MLP, cfg(s), n, m, load_stage=t, loss_fn=MLP.loss, batch=MLP.batch(6), steps=2)


def test_reshard_roundtrip_catches_a_loader_that_loses_a_shard(monkeypatch):
    from fnzero import checkpoint

    real = checkpoint.load

    def lossy(path, like, **kw):
        state, client = real(path, like, **kw)
        if state.sharding.rank == 1:  # rank 1 drops its first optimizer moment
            exp_avg = {k: torch.zeros_like(v) for k, v in state.opt_state.exp_avg.items()}
            state = state.replace(opt_state=state.opt_state._replace(exp_avg=exp_avg))
        return state, client

    monkeypatch.setattr(checkpoint, "load", lossy)
    with pytest.raises(AssertionError) as e:
        ft.assert_reshard_roundtrip(MLP, cfg(2), 2, 3, loss_fn=MLP.loss, batch=MLP.batch(4))
    msg = str(e.value)
    assert "saved by 2 ranks at stage 2 and loaded by 3 ranks at stage 2" in msg
    assert "state['opt_state'].exp_avg['" in msg and "elements differ" in msg


# -- count_collectives --------------------------------------------------------------------------------
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_count_collectives_matches_the_traffic_spec(stage):
    """specs/collectives.md §Traffic: stages 0-2 send what DDP's all-reduce sends; stage 3 at most 1.5x."""

    def fn(comm):
        sm, state, step = _setup(stage, comm)
        batch = ft._runs.rank_slice(MLP.batch(6), comm.rank, 3)
        with ft.count_collectives(sm) as c:
            step(state, batch)
        assert isinstance(sm.comm, type(comm)) and state.sharding.comm is comm  # restored
        padded = sum(u.padded_numel for u in sm.plan.units) * 8
        return c.calls(), c.bytes("all_reduce"), c.ring_bytes(), padded, c.ops()

    calls, all_reduce, ring, padded, ops = ft.simulated_world(3).run(fn)[0]
    ddp = padded * 2 * 2 / 3 + 16 * 2 * 2 / 3  # gradients + the [norm², loss] scalars
    if stage < 3:
        assert ring == pytest.approx(ddp)
    else:
        assert ddp < ring <= 1.5 * ddp and "all_reduce" in ops and all_reduce == 16
    assert calls == len(ops)


def test_count_collectives_wraps_a_bare_comm():
    with ft.count_collectives(fnzero.LocalCollectives()) as c:
        c.comm.all_gather(torch.ones(3, dtype=torch.float64))
    assert c.summary() == {"all_gather": (1, 24)} and c.bytes() == 24 and c.ring_bytes() == 0
    with pytest.raises(ValueError, match="unknown collective"):
        c.calls("allgather")
    with pytest.raises(TypeError):
        with ft.count_collectives(3):
            pass
