"""Pipeline parallelism (specs/mesh.md §Pipeline): stages cut as DeepSpeed cuts them, schedules
that run every micro-batch's forward and backward once without deadlock and with the theoretical
bubble, and pp / dp x pp meshes whose step equals the unsharded one-process step in float64
(AdamW, clipping, accumulation) on fnzero's GPT and hypothesis-drawn MLPs; traffic and state bytes
equal their formulas; bad input is a ConfigError naming the numbers."""

from __future__ import annotations

import copy
import itertools

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import _worlds as W
import fnzero
from fnzero.pipeline import (
    LayerSpec, PipelineModule, bubble_fraction, gpipe, one_f_one_b, partition_balanced, partition_uniform, schedule,
)
from fnzero.pipeline._p2p import HEADER_NUMEL
from fnzero.sharding import MeshShape, make_mesh
from fnzero.testing import seeded, simulated_world

RTOL = 1e-9


# --- how layers are cut ----------------------------------------------------------------------------

# DeepSpeed 0.19.8's runtime/utils.py on these inputs (its tie rule included).
DEEPSPEED_BALANCED = [
    ([1] * 7, 3, [0, 3, 5, 7]), ([0, 5, 5, 5, 5, 0], 2, [0, 3, 6]), ([10, 1, 1, 1, 1, 10], 3, [0, 1, 5, 6]),
    ([3, 1, 4, 1, 5, 9, 2, 6], 4, [0, 3, 5, 6, 8]), ([0, 1, 1, 1, 1, 1, 1, 0], 2, [0, 4, 8]),
    ([100, 0, 0, 0], 2, [0, 3, 4]), ([7], 3, [0, 1, 1, 1]), ([2] * 5, 5, [0, 1, 2, 3, 4, 5]),
]
DEEPSPEED_UNIFORM = [(7, 3, [0, 3, 5, 7]), (2, 4, [0, 1, 2, 2, 2]), (10, 4, [0, 3, 6, 8, 10]), (12, 5, [0, 3, 6, 8, 10, 12])]


@pytest.mark.parametrize("weights,parts,expected", DEEPSPEED_BALANCED)
def test_balanced_partition_equals_deepspeeds(weights, parts, expected):
    assert partition_balanced(weights, parts) == expected


@pytest.mark.parametrize("items,parts,expected", DEEPSPEED_UNIFORM)
def test_uniform_partition_equals_deepspeeds(items, parts, expected):
    assert partition_uniform(items, parts) == expected


@settings(max_examples=60, deadline=None, derandomize=True)
@given(weights=st.lists(st.integers(0, 50), min_size=1, max_size=8), parts=st.integers(1, 4))
def test_balanced_partition_is_the_most_even_split(weights, parts):
    """No contiguous split into `parts` parts has a smaller (largest sum - smallest sum)."""
    bounds = partition_balanced(weights, parts)
    assert bounds[0] == 0 and bounds[-1] == len(weights) and bounds == sorted(bounds) and len(bounds) == parts + 1
    if len(weights) <= parts:
        return

    def spread(b):
        sums = [sum(weights[b[i]:b[i + 1]]) for i in range(parts)]
        return max(sums) - min(sums)

    best = min(spread([0, *cuts, len(weights)]) for cuts in itertools.combinations(range(1, len(weights)), parts - 1))
    assert spread(bounds) == best


# --- schedules -------------------------------------------------------------------------------------

def _simulate(kind: str, p: int, m: int, v: int = 1) -> int:
    """Run every stage's actions with unit-time passes of a chunk, blocking receives and async
    sends, the way the runtime does (model chunk c·p + s is rank s's chunk c); return the makespan
    (fails on a deadlock)."""
    acts = [schedule(kind, p, m, s, v) for s in range(p)]
    pos, clock = [0] * p, [0] * p
    f_done, b_done = {}, {}
    while any(pos[s] < len(acts[s]) for s in range(p)):
        moved = False
        for s in range(p):
            if pos[s] == len(acts[s]):
                continue
            kind_, j, c = acts[s][pos[s]]
            g = c * p + s
            dep = (f_done.get((g - 1, j)) if g > 0 else 0) if kind_ == "F" else (
                b_done.get((g + 1, j)) if g < p * v - 1 else f_done.get((g, j)))
            if dep is None:
                continue
            clock[s] = max(clock[s], dep) + 1
            (f_done if kind_ == "F" else b_done)[(g, j)] = clock[s]
            pos[s] += 1
            moved = True
        assert moved, f"{kind} deadlocks at p={p} m={m} v={v}"
    return max(clock)


@settings(max_examples=40, deadline=None, derandomize=True)
@given(p=st.integers(1, 5), extra=st.integers(0, 5), kind=st.sampled_from(["gpipe", "1f1b", "interleaved"]),
       v=st.integers(1, 3))
def test_schedules_run_each_pass_once_without_deadlock_and_with_the_theoretical_bubble(p, extra, kind, v):
    m, v = (p * (1 + extra // 2), v) if kind == "interleaved" else (p + extra, 1)
    for s in range(p):
        acts = schedule(kind, p, m, s, v)
        for c in range(v):
            mine = [(a.kind, a.micro) for a in acts if a.chunk == c]
            assert sorted(mine) == sorted([("F", j) for j in range(m)] + [("B", j) for j in range(m)])
            assert all(mine.index(("F", j)) < mine.index(("B", j)) for j in range(m))
            assert [j for k, j in mine if k == "B"] == list(range(m))  # neighbours send and receive in one order
        if kind == "1f1b":  # at most p - s micro-batches in flight on stage s
            live = max(sum(1 for a in acts[:i + 1] if a.kind == "F") - sum(1 for a in acts[:i + 1] if a.kind == "B")
                       for i in range(len(acts)))
            assert live <= p - s
    # Unit-time chunk passes: 2(v·m + p - 1) ticks, of which 2(p - 1) idle per stage = the bubble.
    span = _simulate(kind, p, m, v)
    assert span == 2 * (v * m + p - 1)
    assert (span - 2 * v * m) / span == pytest.approx(bubble_fraction(p, m, v))


def test_1f1b_with_fewer_micro_batches_than_stages_is_a_config_error():
    with pytest.raises(fnzero.ConfigError, match="gradient_accumulation_steps is 2, the pipeline has 3 stages"):
        schedule("1f1b", 3, 2, 0)
    assert gpipe(3, 2, 0) and one_f_one_b(2, 2, 1)
    with pytest.raises(fnzero.ConfigError, match="'zigzag' is not one of"):
        schedule("zigzag", 2, 2, 0)
    with pytest.raises(fnzero.ConfigError, match="gradient_accumulation_steps is 6, not a multiple of the 4 stages"):
        schedule("interleaved", 4, 6, 0, 2)
    with pytest.raises(fnzero.ConfigError, match="2 virtual stages per rank runs the 'interleaved' schedule"):
        schedule("1f1b", 2, 4, 0, 2)


# --- equivalence -----------------------------------------------------------------------------------

GPT_C = W.PIPE_GPT
_gpt_layers, _lm_loss, _reference, _gpt_batches = W.pipe_gpt_layers, W.lm_loss, W.train_pipe_reference, W.pipe_gpt_batches
_cfg = W.pipe_config


def _pipelined(layers, loss_fn, batches, world, stages, zero, k, sched, extra=None, method="parameters", virtual=1):
    return simulated_world(world).run(lambda comm: W.train_pipelined(comm, layers, loss_fn, batches, stages, zero, k,
                                                                     sched, extra, method, virtual))


@pytest.mark.parametrize("world,stages,zero,sched,virtual", [
    (2, 2, 0, "gpipe", 1), (2, 2, 1, "1f1b", 1), (4, 2, 1, "1f1b", 1), (4, 2, 0, "gpipe", 1), (3, 3, 1, "1f1b", 1),
    (2, 2, 1, "interleaved", 2), (4, 2, 1, "interleaved", 2),
], ids=lambda v: str(v))
def test_pipelined_gpt_equals_the_unsharded_step(world, stages, zero, sched, virtual):
    """Every rank's consolidated stage parameters and the loss equal plain torch on the whole GPT
    (k = 4 micro-batches, clipping on), for GPipe, 1F1B and interleaved 1F1B (2 virtual stages per
    rank: each rank holds two non-adjacent chunks), with and without data parallelism."""
    layers = _gpt_layers()
    ref, ref_losses = _reference(layers, _lm_loss, _gpt_batches(), k=4)
    for params, losses, _ in _pipelined(layers, _lm_loss, _gpt_batches(), world, stages, zero, 4, sched,
                                        virtual=virtual):
        assert params, "each stage holds some layers"
        for name, t in params.items():
            torch.testing.assert_close(t, ref[name], rtol=RTOL, atol=1e-12, msg=lambda m: f"{name}: {m}")
        assert losses == pytest.approx(ref_losses, rel=RTOL)


class _Tanh(nn.Module):
    """A Linear then tanh: one layer of the drawn MLPs (a class, so LayerSpec can build it)."""

    def __init__(self, a: int, b: int):
        super().__init__()
        self.lin = nn.Linear(a, b).double()

    def forward(self, x):
        return torch.tanh(self.lin(x))


def _mse(out, y):
    return F.mse_loss(out, y)


@settings(max_examples=6, deadline=None, derandomize=True)
@given(widths=st.lists(st.integers(1, 7), min_size=3, max_size=7), stages=st.sampled_from([2, 3]),
       sched=st.sampled_from(["gpipe", "1f1b"]), method=st.sampled_from(["parameters", "uniform", "type:tanh"]),
       interval=st.sampled_from([0, 2]))
def test_drawn_mlps_equal_the_unsharded_step(widths, stages, sched, method, interval):
    """Layer counts and widths that do not divide by the stage count, any partition method,
    rematerialisation every 2 layers or none: the pipelined step equals plain torch."""
    if len(widths) - 1 < stages:
        widths = widths + [3] * (stages - len(widths) + 1)
    with seeded(sum(widths)):
        layers = [_Tanh(a, b) for a, b in zip(widths[:-1], widths[1:])]
    g = torch.Generator().manual_seed(len(widths))
    batches = [(torch.randn(8, widths[0], generator=g, dtype=torch.float64),
                torch.randn(8, widths[-1], generator=g, dtype=torch.float64)) for _ in range(2)]
    ref, ref_losses = _reference(layers, _mse, batches, k=4)
    extra = {"pipeline": {"stages": stages, "activation_checkpoint_interval": interval}}
    for params, losses, _ in _pipelined(layers, _mse, batches, stages, stages, 1, 4, sched, extra, method):
        for name, t in params.items():
            torch.testing.assert_close(t, ref[name], rtol=RTOL, atol=1e-12, msg=lambda m: f"{name}: {m}")
        assert losses == pytest.approx(ref_losses, rel=RTOL)


def test_layer_specs_are_built_only_by_the_stage_that_runs_them():
    built = []

    class Counted(_Tanh):
        def __init__(self, i):
            built.append(i)
            super().__init__(3, 3)

    pipe = PipelineModule([LayerSpec(Counted, i) for i in range(5)], _mse, partition_method="uniform")
    stage = pipe.stage(1, 2)
    assert [n.split(".")[0] for n, _ in stage.named_parameters()][::2] == ["3", "4"]
    assert built[-2:] == [3, 4] and len(built) == 2  # "uniform" needs no parameter count: nothing else built


def test_traffic_and_state_bytes_equal_their_formulas():
    """Per step, stage s sends m activations (with a header) forward and m gradients back
    (specs/collectives.md §Pipeline); each rank's model state is the ZeRO formula of its stage's
    parameters over the data-parallel ranks."""
    layers, k, micro = _gpt_layers(), 4, 1

    def rank(comm):
        cfg = _cfg(2, 2, 1, k, {"comms_logger": {"enabled": True}})
        sm = fnzero.shard(PipelineModule(copy.deepcopy(layers), _lm_loss), config=cfg, comm=comm)
        state = sm.init_state()
        step = fnzero.train_step(fnzero.pipeline_loss(sm), cfg)
        x, y = _gpt_batches()[0]
        d = MeshShape(dp=2, pp=2).coords(comm.rank)["dp"]
        sm.pp.comm.reset()
        state, _ = step(state, (x[d * 4:(d + 1) * 4], y[d * 4:(d + 1) * 4]))
        sent = sum(r.bytes for r in sm.pp.comm.records if r.op == "send")
        return sm.pp.stage_index, sent, fnzero.memory.model_state_bytes(state).total, sm.plan.num_padded

    act = micro * GPT_C.seq_len * GPT_C.d_model * 8  # one float64 activation of a micro-batch
    for stage, sent, total, padded in simulated_world(4).run(rank):
        assert sent == k * (act + HEADER_NUMEL * 8 if stage == 0 else act)
        assert total == 2 * fnzero.memory.zero_formula(padded, 1, 2, False)  # float64: twice fp32's bytes


def test_bad_pipelines_are_config_errors_naming_the_numbers():
    layers = _gpt_layers()  # 5 layers
    with pytest.raises(fnzero.ConfigError, match="a pipeline of 6 stages needs at least 6 layers; this model has 5"):
        PipelineModule(layers, _lm_loss).stage(0, 6)
    with pytest.raises(fnzero.ConfigError, match="tensor-parallel size 1 x 3 pipeline stages needs a world size that is a multiple of 3; this world has 1"):
        make_mesh(simulated_world(1).run(lambda comm: comm)[0], pp=3)
    with pytest.raises(fnzero.ConfigError, match="partition_method 'type:Conv' matches no layer"):
        PipelineModule(layers, _lm_loss, partition_method="type:Conv").stage(0, 2)
    assert PipelineModule(layers, _lm_loss, partition_method=[1, 4]).bounds(3) == [0, 1, 4, 5]  # split points
    with pytest.raises(fnzero.ConfigError, match=r"split points \[3, 2\] do not cut 5 layers into 3 non-empty"):
        PipelineModule(layers, _lm_loss, partition_method=[3, 2]).bounds(3)

    def zero2(comm):
        cfg = fnzero.load_config({"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 2}},
                                 world_size=2)
        fnzero.shard(PipelineModule(copy.deepcopy(layers), _lm_loss), config=cfg, comm=comm,
                     mesh=make_mesh(comm, pp=2))

    with pytest.raises(fnzero.DistributedError, match="ZeRO stage 2 with 2 pipeline stages"):
        simulated_world(2).run(zero2)

    def one_f_one_b_short(comm):
        cfg = _cfg(1, 2, 1, 1)
        fnzero.pipeline_loss(fnzero.shard(PipelineModule(copy.deepcopy(layers), _lm_loss), config=cfg, comm=comm))

    with pytest.raises(fnzero.DistributedError, match="gradient_accumulation_steps is 1, the pipeline has 2 stages"):
        simulated_world(2).run(one_f_one_b_short)


def _tied_layers(bias=False):
    with seeded(5):
        emb, mid, head = nn.Embedding(11, 6).double(), nn.Linear(6, 6).double(), nn.Linear(6, 11, bias=bias).double()
    head.weight = emb.weight
    return [emb, nn.Sequential(mid, nn.Tanh()), head]


@pytest.mark.parametrize("world,stages,zero,sched", [(2, 2, 0, "gpipe"), (4, 2, 1, "1f1b"), (3, 3, 1, "1f1b")],
                         ids=lambda v: str(v))
def test_a_weight_tied_across_stages_trains_as_one(world, stages, zero, sched):
    """An embedding tied to the LM head on another stage (DeepSpeed's TiedLayerSpec): each holder
    keeps a copy, their gradients are summed over the pipeline and counted once in the norm, so the
    run equals plain torch's on the tied model, and the copies stay equal."""
    layers = _tied_layers()
    g = torch.Generator().manual_seed(2)
    batches = [(torch.randint(0, 11, (8, 5), generator=g), torch.randint(0, 11, (8, 5), generator=g)) for _ in range(3)]
    ref, ref_losses = _reference(layers, _lm_loss, batches, k=4)
    ref["2.weight"] = ref["0.weight"]  # named_parameters lists a tied weight once
    for params, losses, _ in _pipelined(layers, _lm_loss, batches, world, stages, zero, 4, sched, method="uniform"):
        for name, t in params.items():
            torch.testing.assert_close(t, ref[name], rtol=RTOL, atol=1e-12, msg=lambda m: f"{name}: {m}")
        assert losses == pytest.approx(ref_losses, rel=RTOL)


def test_a_tied_weight_must_be_its_modules_only_parameter():
    with pytest.raises(fnzero.ShardingError, match="pipeline module '2' holds a weight shared with another stage"):
        PipelineModule(_tied_layers(bias=True), _lm_loss, partition_method="uniform").stage(1, 2)


def test_checkpoints_move_between_pipeline_layouts(tmp_path):
    """Saved at dp 2 x pp 2 (ZeRO-1), the checkpoint is the one a single-stage run writes: it loads
    at pp 1, pp 2 x dp 1 and pp 3 bit-identically, the next step equals the saving run's, and it
    exports to one safetensors file equal to the consolidated parameters."""
    from safetensors.torch import load_file

    layers, k = _gpt_layers(), 4
    batches = _gpt_batches()

    def run(comm, stages, zero, load=False):
        dp = comm.world_size // stages
        cfg = _cfg(dp, stages, zero, k)
        sm = fnzero.shard(PipelineModule(copy.deepcopy(layers), _lm_loss), config=cfg, comm=comm)
        state = sm.init_state()
        step = fnzero.train_step(fnzero.pipeline_loss(sm), cfg)
        d = MeshShape(dp=dp, pp=stages).coords(comm.rank)["dp"]
        per = 8 // dp
        rows = [(x[d * per:(d + 1) * per], y[d * per:(d + 1) * per]) for x, y in batches]
        if load:
            state, _ = fnzero.checkpoint.load(tmp_path, state, restore_rng=False)
        else:
            state, _ = step(state, rows[0])
            fnzero.checkpoint.save(tmp_path, state, tag="t")
        loaded = sm.gather(state)
        state, m = step(state, rows[1])
        return loaded, sm.gather(state), m["loss"]

    saved = simulated_world(4).run(lambda comm: run(comm, 2, 1))
    before, after = {}, {}
    for loaded_before, nxt, _ in saved:  # each rank: its stage's layers
        before.update(loaded_before)
        after.update(nxt)
    assert sorted(before) == sorted(n for n, _ in nn.Sequential(*layers).named_parameters())
    for world, stages, zero in [(1, 1, 0), (2, 2, 1), (3, 3, 0)]:
        for loaded, nxt, loss in simulated_world(world).run(lambda comm: run(comm, stages, zero, load=True)):
            for name, t in loaded.items():
                assert torch.equal(t, before[name]), (world, stages, name)
            for name, t in nxt.items():
                torch.testing.assert_close(t, after[name], rtol=RTOL, atol=1e-12)
            assert loss == pytest.approx(saved[0][2], rel=RTOL)
    out = fnzero.checkpoint.export(tmp_path / "t", tmp_path / "export", dtype="fp64")
    exported = {}
    for f in out:
        exported.update(load_file(f))
    assert sorted(exported) == sorted(before)
    assert all(torch.equal(exported[n], before[n]) for n in before)


def _hf(kind: str):
    return W.hf_model(kind, layers=3)


@pytest.mark.parametrize("kind,world,stages,zero,sched,tp", [
    ("gpt2", 2, 2, 1, "1f1b", 1), ("gpt2", 4, 2, 1, "gpipe", 1), ("llama", 2, 2, 0, "gpipe", 1),
    ("llama", 3, 3, 1, "1f1b", 1), ("gpt2", 4, 2, 1, "1f1b", 2), ("llama", 4, 2, 1, "gpipe", 2),
], ids=lambda v: str(v))
def test_hugging_face_models_as_pipelines_equal_the_unsharded_step(kind, world, stages, zero, sched, tp):
    """GPT-2 (its LM head tied to the embedding on another stage) and Llama (GQA, rotary) from small
    configs, cut by `hf_causal_lm` with no layer list written: each stage holds the model's own
    parameter names and equals plain torch training the Hugging Face model itself with the
    causal-LM loss. With tp 2 too, AutoTP's built-in plan splits each stage (a tied weight stays
    whole over tp, so its copies match)."""
    from fnzero.pipeline import causal_lm_loss, hf_causal_lm

    model = _hf(kind)
    g = torch.Generator().manual_seed(3)
    batches = [(ids, ids) for ids in (torch.randint(0, 51, (8, 9), generator=g) for _ in range(3))]
    ref_losses = []
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    for x, y in batches:
        opt.zero_grad()
        total = 0.0
        for xs, ys in zip(x.chunk(4), y.chunk(4)):
            loss = causal_lm_loss(ref(input_ids=xs).logits, ys) / 4
            loss.backward()
            total += float(loss.detach())
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
        opt.step()
        ref_losses.append(total)
    want = dict(ref.named_parameters(remove_duplicate=False))
    seen = set()
    extra = {"tensor_parallel": {"autotp_size": tp}} if tp > 1 else None
    for params, losses, _ in _pipelined(lambda: hf_causal_lm(copy.deepcopy(model)), causal_lm_loss, batches, world,
                                        stages, zero, 4, sched, extra):
        for name, t in params.items():
            torch.testing.assert_close(t, want[name].detach(), rtol=RTOL, atol=1e-12, msg=lambda m: f"{name}: {m}")
        assert losses == pytest.approx(ref_losses, rel=RTOL)
        seen |= set(params)
    assert seen == set(want)  # every parameter, under its Hugging Face name, on some stage


def test_tp_x_pp_equals_the_unsharded_step():
    """tp 2 x pp 2 (ZeRO-1): each stage's blocks split by an explicit plan over the layer-index names
    (`TPRule`), then cut into stages; every rank's consolidated stage equals plain torch."""
    from fnzero.sharding import TPRule

    layers, batches = _gpt_layers(), _gpt_batches()
    ref, ref_losses = _reference(layers, _lm_loss, batches, k=4)
    rules = [TPRule(r"^\d+\.qkv$", "column", blocks=3), TPRule(r"^\d+\.proj$", "row"), TPRule(r"^\d+\.fc$", "column"),
             TPRule(r"^\d+\.out$", "row")]

    def rank(comm):
        cfg = _cfg(1, 2, 1, 4, {"tensor_parallel": {"autotp_size": 2}})
        sm = fnzero.shard(PipelineModule(copy.deepcopy(layers), _lm_loss), config=cfg, comm=comm, tp_plan=rules)
        assert sm.tp is not None and sm.tp.splits and sm.pp.stages == 2
        state = sm.init_state()
        step = fnzero.train_step(fnzero.pipeline_loss(sm), cfg)
        losses = []
        for b in batches:
            state, m = step(state, b)
            losses.append(m["loss"])
        return sm.gather(state), losses

    for params, losses in simulated_world(4).run(rank):
        for name, t in params.items():
            torch.testing.assert_close(t, ref[name], rtol=RTOL, atol=1e-12, msg=lambda m: f"{name}: {m}")
        assert losses == pytest.approx(ref_losses, rel=RTOL)


def test_seeded_layer_specs_build_the_same_weights_at_any_stage_count():
    """seed_layers (DeepSpeed's option): LayerSpec i is built from seed 1234 + i, so stage 1 of 2
    holds exactly the layers a single stage builds; without it, what a stage builds depends on
    the RNG it finds."""
    specs = [LayerSpec(_Tanh, 3, 3) for _ in range(4)]
    whole = dict(PipelineModule(specs, _mse, seed_layers=True).stage(0, 1).named_parameters())
    torch.manual_seed(99)
    half = dict(PipelineModule(specs, _mse, partition_method="uniform").stage(1, 2, seed_layers=True).named_parameters())
    assert sorted(half) == ["2.lin.bias", "2.lin.weight", "3.lin.bias", "3.lin.weight"]
    assert all(torch.equal(t, whole[n]) for n, t in half.items())
    unseeded = dict(PipelineModule(specs, _mse, partition_method="uniform").stage(1, 2).named_parameters())
    assert not torch.equal(unseeded["2.lin.weight"], whole["2.lin.weight"])


def test_debug_collectives_check_point_to_point_messages():
    """specs/collectives.md §Pipeline: with debug_collectives each message carries a fingerprint;
    a receiver expecting another size names both sides, and a correct pipeline runs unchanged."""
    from fnzero.sharding.comm._observed import CheckedCollectives

    def mismatch(comm):
        checked = CheckedCollectives(comm)
        if comm.rank == 0:
            checked.send_async(torch.ones(3), 1).wait()
        else:
            checked.recv(torch.empty(4), 0)

    with pytest.raises(fnzero.DistributedError, match="rank 1 expected message #0 from rank 0 of 4 elements .*"
                                                      "rank 0 sent message #0 of 3 elements"):
        simulated_world(2).run(mismatch)
    layers, batches = _gpt_layers(), _gpt_batches()
    _, ref_losses = _reference(layers, _lm_loss, batches, k=4)

    def rank(comm):
        cfg = _cfg(1, 2, 1, 4)
        sm = fnzero.shard(PipelineModule(copy.deepcopy(layers), _lm_loss), config=cfg, comm=comm, debug_collectives=True)
        assert isinstance(sm.pp.comm, CheckedCollectives)
        state, step = sm.init_state(), fnzero.train_step(fnzero.pipeline_loss(sm), cfg)
        return [step(state, b)[1]["loss"] for b in batches[:1]]

    for losses in simulated_world(2).run(rank):
        assert losses == pytest.approx(ref_losses[:1], rel=RTOL)


def test_checkpoints_move_between_the_model_and_its_pipeline_across_meshes(tmp_path):
    """specs/checkpoint-format.md §Loading by name: pipeline layers cut from a model keep its
    parameter names, so a checkpoint of the plain GPT at dp 2 x tp 2 loads into tp 2 x pp 2
    bit-identically, and that run's checkpoint loads back into the plain GPT on one rank."""
    from fnzero.sharding import TPRule
    from fnzero.testing import GPT, gpt_layers

    with seeded(0):
        built = GPT(GPT_C).double()

    def gpt():  # copies of one model: a simulated rank building its own could race another rank's RNG use
        return copy.deepcopy(built)

    rules = [TPRule(r"^blocks\.\d+\.qkv$", "column", blocks=3), TPRule(r"^blocks\.\d+\.proj$", "row"),
             TPRule(r"^blocks\.\d+\.fc$", "column"), TPRule(r"^blocks\.\d+\.out$", "row")]
    batches = _gpt_batches()

    def plain(comm, tp, path_in, path_out):
        cfg = _cfg(comm.world_size // tp, 1, 1, 4, {"tensor_parallel": {"autotp_size": tp}})
        sm = fnzero.shard(gpt(), config=cfg, comm=comm)
        state = sm.init_state()
        if path_in:
            state, _ = fnzero.checkpoint.load(path_in, state, restore_rng=False)  # threads share torch's RNG
            return sm.gather(state)
        step = fnzero.train_step(lambda p, b: _lm_loss(sm.apply(p, b[0]), b[1]), cfg)
        d, per = comm.rank // tp, 8 // (comm.world_size // tp)
        state, _ = step(state, tuple(t[d * per:(d + 1) * per] for t in batches[0]))
        fnzero.checkpoint.save(path_out, state, tag="t")
        return sm.gather(state)

    def piped(comm):
        cfg = _cfg(1, 2, 1, 4, {"tensor_parallel": {"autotp_size": 2}})
        model = gpt()
        pipe = PipelineModule(gpt_layers(model=model), _lm_loss, names_from=model)
        sm = fnzero.shard(pipe, config=cfg, comm=comm, tp_plan=rules)
        state, _ = fnzero.checkpoint.load(tmp_path / "a", sm.init_state(), restore_rng=False)
        loaded = sm.gather(state)
        state, _ = fnzero.train_step(fnzero.pipeline_loss(sm), cfg)(state, batches[1])
        fnzero.checkpoint.save(tmp_path / "b", state, tag="t")
        return loaded, sm.gather(state)

    (saved, *_) = simulated_world(4).run(lambda comm: plain(comm, 2, None, tmp_path / "a"))
    after = {}
    for loaded, trained in simulated_world(4).run(piped):
        assert all(torch.equal(t, saved[n]) for n, t in loaded.items()), "dp2 x tp2 -> tp2 x pp2"
        after.update(trained)
    assert sorted(after) == sorted(saved)
    (back,) = simulated_world(1).run(lambda comm: plain(comm, 1, tmp_path / "b", None))
    assert all(torch.equal(back[n], after[n]) for n in after), "tp2 x pp2 -> one rank"


def test_jit_compiles_a_stages_layers_and_runs_other_scopes_eagerly():
    """specs/mesh.md §Pipeline: fnzero.jit's per-unit scope compiles each layer of a stage (no graph
    break, same losses); scope "loss" cannot be one graph across point-to-point sends and says so."""
    layers, batches = _gpt_layers(), _gpt_batches()
    _, ref_losses = _reference(layers, _lm_loss, batches, k=4)

    def rank(comm, scope):
        cfg = _cfg(1, 2, 1, 4)
        sm = fnzero.shard(PipelineModule(copy.deepcopy(layers), _lm_loss), config=cfg, comm=comm)
        state = sm.init_state()
        step = fnzero.jit(fnzero.train_step(fnzero.pipeline_loss(sm), cfg), backend="aot_eager", scope=scope)
        losses = []
        for b in batches[:2]:
            state, m = step(state, b)
            losses.append(m["loss"])
        return losses, step.fallback_reason, len(step.graph_breaks)

    for losses, fallback, breaks in simulated_world(2).run(lambda comm: rank(comm, "units")):
        assert (fallback, breaks) == (None, 0)
        assert losses == pytest.approx(ref_losses[:2], rel=RTOL)
    with pytest.warns(fnzero.JitWarning, match="a pipeline schedule sends activations between its stages"):
        for losses, fallback, _ in simulated_world(2).run(lambda comm: rank(comm, "loss")):
            assert "pipeline schedule" in fallback
            assert losses == pytest.approx(ref_losses[:2], rel=RTOL)


def test_a_pipeline_with_its_optimizer_on_nvme_checkpoints_and_resumes(tmp_path):
    """offload_optimizer: nvme on each stage: the save reads the store's files into the ordinary
    format; a fresh NVMe-backed pipeline resumes from it and takes the same next step."""
    layers = [layer.float() for layer in _gpt_layers()]
    batches = _gpt_batches()
    extra = {"zero_optimization": {"stage": 1, "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path / "nv")}}}

    def rank(comm, resume):
        cfg = _cfg(1, 2, 1, 4, extra)
        sm = fnzero.shard(PipelineModule(copy.deepcopy(layers), _lm_loss), config=cfg, comm=comm)
        state, step = sm.init_state(), fnzero.train_step(fnzero.pipeline_loss(sm), cfg)
        if resume:
            state, _ = fnzero.checkpoint.load(tmp_path / "ck", state, restore_rng=False)
        else:
            state, _ = step(state, batches[0])
            fnzero.checkpoint.save(tmp_path / "ck", state, tag="t")
        state, m = step(state, batches[1])
        return m["loss"], sm.gather(state)

    first = simulated_world(2).run(lambda comm: rank(comm, False))
    again = simulated_world(2).run(lambda comm: rank(comm, True))
    for (loss_a, params_a), (loss_b, params_b) in zip(first, again):
        assert loss_a == loss_b
        assert all(torch.equal(params_a[n], params_b[n]) for n in params_a)
