"""Exact model-state memory and collective traffic per stage (specs/sharding.md §Memory,
specs/collectives.md §Traffic)."""

import pytest
import torch

import fnzero
from fnzero import RecordingCollectives
from fnzero.memory import model_state_bytes, zero_formula
from fnzero.testing import GPT, seeded
from fnzero.testing._threads import simulated_world


def _cfg(stage, world, precision="fp32", reuse=0):
    # stage3_max_reuse_distance 0 unless asked: these tests are about the re-gather path (the
    # default keeps every unit of these small models gathered for backward).
    c = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0,
                              "stage3_max_reuse_distance": reuse},
    }
    if precision == "bf16":
        c["bf16"] = {"enabled": True}
        c["data_types"] = {"grad_accum_dtype": "bf16"}  # the ZeRO table counts 16-bit gradients
    return fnzero.load_config(c, world_size=world)


def _model():
    with seeded(0):  # ranks are threads sharing one generator: seed and build alone
        return GPT(vocab_size=50, seq_len=8, d_model=16, n_layer=2, n_head=2)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_model_state_bytes_follow_zero_formulas(stage, world, precision):
    model = _model()

    def rank_fn(comm):
        sm = fnzero.shard(model if comm.rank == 0 else _model(), config=_cfg(stage, world, precision), comm=comm)
        st = sm.init_state()
        return model_state_bytes(st), sm.plan

    results = simulated_world(world).run(rank_fn)
    for got, plan in results:
        psi_padded = plan.num_padded  # the formulas' Ψ, padding included (< world elements per unit)
        assert got.total == zero_formula(psi_padded, stage, world, precision != "fp32")
        assert plan.num_padded - plan.num_params < world * len(plan.units)


def _traffic(stage, world, reuse=0):
    def rank_fn(comm):
        rec = RecordingCollectives(comm)
        sm = fnzero.shard(_model(), config=_cfg(stage, world, reuse=reuse), comm=rec)
        state = sm.init_state()

        def loss_fn(params, batch):
            x, y = batch
            return torch.nn.functional.cross_entropy(sm.apply(params, x).flatten(0, 1), y.flatten())

        step = fnzero.train_step(loss_fn, _cfg(stage, world))
        x = torch.randint(0, 50, (2, 8))
        state, _ = step(state, (x, x))  # warm
        rec.reset()
        state, _ = step(state, (x, x))
        records = rec.reset()
        return rec.ring_bytes_sent(records), records, sm.plan

    return simulated_world(world).run(rank_fn)[0]


@pytest.mark.parametrize("world", [2, 4])
def test_ring_traffic_per_stage(world):
    """Stages 0-2 send what DDP's all-reduce of the gradients sends; stage 3 at most 1.5x that."""
    sent = {}
    for stage in range(4):
        sent[stage], records, plan = _traffic(stage, world)
    psi = plan.num_padded
    ddp = 4 * psi * 2 * (world - 1) / world
    scalar = 16 * 2 * (world - 1) / world  # one [norm², loss] float64 all-reduce per step
    for stage in (0, 1, 2):
        assert sent[stage] == pytest.approx(ddp + scalar), f"stage {stage}"
    assert ddp < sent[3] <= 1.5 * ddp + scalar  # stage3_max_reuse_distance 0: re-gathered for backward
    # DeepSpeed's default distance (1e9) keeps every unit of this model gathered for its backward:
    # from the second step on, one gather and one reduce-scatter per unit, exactly DDP's bytes.
    kept, records, _ = _traffic(3, world, reuse=1_000_000_000)
    assert kept == pytest.approx(ddp + scalar)
    assert sum(r.op == "all_gather" for r in records) == len(plan.units)


def test_stage3_keeps_the_last_forward_unit_for_backward():
    """specs/collectives.md §Per stage: the unit gathered last in forward (the head) is needed first
    in backward, so from the second step on (when the order is known) it is not gathered again."""
    def rank_fn(comm):
        rec = RecordingCollectives(comm)
        sm = fnzero.shard(_model(), config=_cfg(3, 2), comm=rec)
        state = sm.init_state()
        step = fnzero.train_step(
            lambda p, b: torch.nn.functional.cross_entropy(sm.apply(p, b[0]).flatten(0, 1), b[1].flatten()), _cfg(3, 2))
        x = torch.randint(0, 50, (2, 8))
        counts = []
        for _ in range(3):
            rec.reset()
            state, _ = step(state, (x, x))
            counts.append(sum(r.op == "all_gather" for r in rec.reset()))
        return counts, len(sm.plan.units)

    counts, units = simulated_world(2).run(rank_fn)[0]
    assert counts[1] == counts[2] == counts[0] - 1, counts
    assert counts[1] >= units  # every unit is still gathered for its forward


def test_stage3_never_all_reduces_gradients():
    _, records, _ = _traffic(3, 2)
    big_all_reduces = [r for r in records if r.op == "all_reduce" and r.numel > 2]
    assert big_all_reduces == []
    assert {r.op for r in records} == {"all_gather", "reduce_scatter", "all_reduce"}


def test_debug_collectives_names_the_first_divergence():
    def rank_fn(comm):
        from fnzero.sharding.comm._observed import CheckedCollectives

        c = CheckedCollectives(comm)
        c.all_reduce(torch.ones(3))
        if comm.rank == 0:
            c.all_reduce(torch.ones(2))
        else:
            c.all_gather(torch.ones(2))

    with pytest.raises(fnzero.DistributedError, match=r"diverged at collective #1.*rank 0: all_reduce of 2.*rank 1: all_gather of 2"):
        simulated_world(2).run(rank_fn)


def test_stage3_frees_regathered_params_before_their_gradient_is_assembled(monkeypatch):
    """specs/sharding.md §Apply: a unit's re-gathered parameters are gone by the time autograd
    concatenates their gradients (not after), so the two never sit side by side."""
    import weakref

    import torch.nn.functional as F

    from fnzero.sharding.zero import _runtime

    regathered, checked = {}, []
    orig_regather, orig_backward = _runtime.UnitRuntime.regather, _runtime.GatherUnit.backward

    def regather(rt):
        full = orig_regather(rt)
        regathered[rt.unit.name] = weakref.ref(full)
        return full

    def backward(ctx, grad_full):
        ref = regathered.get(ctx.rt.unit.name)
        checked.append((ctx.rt.unit.name, ref is not None and ref() is None))
        return orig_backward(ctx, grad_full)

    monkeypatch.setattr(_runtime.UnitRuntime, "regather", regather)
    monkeypatch.setattr(_runtime.GatherUnit, "backward", staticmethod(backward))
    cfg = _cfg(3, 1)
    sm = fnzero.shard(_model(), config=cfg)
    step = fnzero.train_step(lambda p, b: F.cross_entropy(sm.apply(p, b[:, :-1]).flatten(0, 1), b[:, 1:].flatten()), cfg)
    step(sm.init_state(), torch.randint(0, 50, (2, 9)))
    blocks = [name for name, _ in checked if name.startswith("blocks.")]
    assert len(blocks) == 2, checked
    assert all(freed for name, freed in checked if name in blocks), checked


def test_stage3_first_regather_starts_with_the_output_gradient():
    """specs/sharding.md §Apply (the forward→backward turn): with the last unit kept, backward's first re-gather is started
    when the output's gradient arrives, not when forward returns, so it never sits beside the loss
    computation (logits and their log-softmax on top of every activation). Same count per step."""
    import torch.nn.functional as F

    def rank_fn(comm):
        rec = RecordingCollectives(comm)
        sm = fnzero.shard(_model(), config=_cfg(3, 2), comm=rec)
        state = sm.init_state()
        seen = []

        def gathers():
            return sum(r.op == "all_gather" for r in rec.records)

        def loss_fn(p, b):
            logits = sm.apply(p, b[0])
            after_forward = gathers()
            loss = F.cross_entropy(logits.flatten(0, 1), b[1].flatten())
            seen.append((after_forward, gathers()))
            logits.register_hook(lambda g: seen.append(gathers()))  # runs after fnzero's hook
            return loss

        step = fnzero.train_step(loss_fn, _cfg(3, 2))
        x = torch.randint(0, 50, (2, 8))
        totals = []
        for _ in range(3):
            rec.reset()
            state, _ = step(state, (x, x))
            totals.append(gathers())
        return seen, totals, len(sm.plan.units)

    seen, totals, units = simulated_world(2).run(rank_fn)[0]
    (fwd, loss, at_grad) = seen[-2][0], seen[-2][1], seen[-1]
    assert fwd == loss == units, seen  # forward's gathers only, none started by the loss
    assert at_grad == fwd + 1, seen  # started with the output's gradient, ahead of the head's backward
    assert totals[1] == totals[2] == totals[0] - 1, totals


class _TwoHeads(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(4, 8), torch.nn.Linear(8, 8)
        self.c, self.d = torch.nn.Linear(8, 3), torch.nn.Linear(8, 3)

    def forward(self, x):
        h = torch.relu(self.b(torch.relu(self.a(x))))
        return {"c": self.c(h), "d": self.d(h)}  # d, gathered last, is the unit kept for backward


@pytest.mark.parametrize("used", [("c",), ("d",), ("c", "d")])
def test_stage3_deferred_regather_with_several_outputs_starts_once(used):
    """One hook per output tensor (a dict here), whichever reaches the loss: the first re-gather
    starts exactly once per step, and a step issues the same collectives every time."""
    def rank_fn(comm):
        rec = RecordingCollectives(comm)
        cfg = _cfg(3, 2)
        with seeded(0):
            model = _TwoHeads()
        sm = fnzero.shard(model, config=cfg, comm=rec)
        state = sm.init_state()

        def loss_fn(p, b):
            out = sm.apply(p, b)
            return sum(out[k].square().mean() for k in used)

        step = fnzero.train_step(loss_fn, cfg)
        x = torch.randn(2, 4)
        counts = []
        for _ in range(3):
            rec.reset()
            state, _ = step(state, x)
            counts.append(sum(r.op == "all_gather" for r in rec.reset()))
        return counts

    counts = simulated_world(2).run(rank_fn)[0]
    # Keeping d saves its re-gather only when the loss's backward goes through d.
    assert counts[1] == counts[2] == counts[0] - ("d" in used), counts


def _token_loss(sm):
    """Cross-entropy of `_model()`'s logits against its own input tokens (the batch is both)."""
    def loss_fn(params, batch):
        return torch.nn.functional.cross_entropy(sm.apply(params, batch).flatten(0, 1), batch.flatten())

    return loss_fn


class _BackwardProbe:
    """Records, for each gradient collective, whether autograd's engine was running when it started."""

    def __init__(self, inner):
        self.inner, self.rank, self.world_size, self.started = inner, inner.rank, inner.world_size, []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def _note(self, op, t):
        if t.dtype != torch.float64:  # the [norm², loss] scalars are float64, after backward by design
            self.started.append((op, torch._C._current_autograd_node() is not None))

    def all_reduce(self, t, op="sum"):
        self._note("all_reduce", t)
        return self.inner.all_reduce(t, op)

    def all_reduce_async(self, t, donate=False, label=""):
        self._note("all_reduce", t)
        return self.inner.all_reduce_async(t, donate=donate, label=label)

    def reduce_scatter(self, full, donate=False):
        self._note("reduce_scatter", full)
        return self.inner.reduce_scatter(full)

    def reduce_scatter_async(self, full, label=""):
        self._note("reduce_scatter", full)
        return self.inner.reduce_scatter_async(full, label=label)


@pytest.mark.parametrize("overlap", [True, None])
@pytest.mark.parametrize("stage", [0, 1, 2])
def test_gradient_collectives_start_inside_backward_unless_overlap_is_off(stage, overlap):
    """specs/collectives.md §Per stage: with `overlap_comm` true every unit's gradient collective
    is started from its gradient hook while backward still runs; unset (false below stage 3, as
    DeepSpeed resolves it), stages 0-1 start them only after backward."""
    zero = {"stage": stage} if overlap is None else {"stage": stage, "overlap_comm": overlap}
    cfg = fnzero.load_config({"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW"},
                              "zero_optimization": zero}, world_size=2)

    def rank_fn(comm):
        probe = _BackwardProbe(comm)
        sm = fnzero.shard(_model(), config=cfg, comm=probe)

        fnzero.train_step(_token_loss(sm), cfg)(sm.init_state(), torch.randint(0, 50, (2, 8)))
        return probe.started, len(sm.plan.units)

    started, units = simulated_world(2).run(rank_fn)[0]
    op = "all_reduce" if stage == 0 else "reduce_scatter"
    assert [o for o, _ in started] == [op] * units
    inside = [b for _, b in started]
    assert all(inside) if overlap or stage == 2 else not any(inside)


def test_stage3_step_frees_its_apply_runs_without_the_cycle_collector():
    """A run and its units' runtimes reference each other; left to the cycle collector they kept
    the previous state's parameter shards alive into the next step (631 against 461 MiB peak on
    the 27.4M GPT, donate=False). The step releases every run once backward is done."""
    import gc

    from fnzero.sharding.zero._runtime import ApplyRun

    cfg = _cfg(3, 2)

    def rank_fn(comm):
        sm = fnzero.shard(_model(), config=cfg, comm=comm)

        state = sm.init_state()
        step = fnzero.train_step(_token_loss(sm), cfg)
        for _ in range(2):
            state, _ = step(state, torch.randint(0, 50, (2, 8)))

    def alive() -> int:
        return sum(type(o) is ApplyRun for o in gc.get_objects())

    gc.collect()
    before = alive()  # runs an earlier test left for the collector are not this step's
    gc.disable()
    try:
        simulated_world(2).run(rank_fn)
        after = alive()
    finally:
        gc.enable()
    assert after == before
