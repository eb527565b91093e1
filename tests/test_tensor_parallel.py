"""Tensor parallelism composed with ZeRO (specs/mesh.md): dp x tp meshes equal the unsharded
one-process step in float64, on fnzero's GPT, Hugging Face's GPT-2 and Llama, and hypothesis-drawn
MLPs whose widths the tensor-parallel size does not divide; the vocabulary-parallel cross-entropy
equals torch's; bad meshes and plans are ConfigErrors naming the numbers."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import _worlds as W
import fnzero
from fnzero.sharding import ParamSplit, TPRule, make_mesh, vocab_parallel_cross_entropy
from fnzero.testing import MLP, seeded, simulated_world

STEPS = 3
RTOL = 1e-9  # float64: only the order of sums differs


def _tp_run(kind, world, tp, stage, extra_tp=None, steps=STEPS):
    extra = {"tensor_parallel": {"autotp_size": tp, **(extra_tp or {})}}

    def rank(comm):
        out = W.train_fnzero(kind, stage, steps, comm, k=2, clip=0.5, extra=extra)
        return out["params"], out["losses"], [m["grad_norm"] for m in out["metrics"]]

    return simulated_world(world).run(rank)


@pytest.mark.parametrize("kind,world,tp,stage,vocab", [
    ("gpt_tp", 2, 2, 0, None), ("gpt_tp", 4, 2, 1, None), ("gpt_tp", 4, 2, 2, None), ("gpt_tp", 4, 2, 3, None),
    ("gpt_tp", 4, 4, 2, None), ("gpt_tp_tied", 4, 2, 3, True), ("gpt_tp_tied", 2, 2, 0, None),
    ("gpt_tp", 4, 2, 3, True),
], ids=lambda v: str(v))
def test_dp_x_tp_equals_the_unsharded_step(kind, world, tp, stage, vocab):
    """Every rank's consolidated parameters, loss and gradient norm equal plain torch's AdamW on
    the whole model and global batch (clipping and accumulation on)."""
    ref = W.train_reference(kind, STEPS, world // tp, k=2, clip=0.5)
    extra = {"vocab_parallel_lm_head": vocab} if vocab is not None else None
    for params, losses, _ in _tp_run(kind, world, tp, stage, extra):
        W.assert_close_tree(params, ref["params"], rtol=RTOL, atol=1e-12, what=f"{kind} dp{world // tp} tp{tp} z{stage}")
        assert losses == pytest.approx(ref["losses"], rel=RTOL)


def _hf_model(kind: str):
    return W.hf_model(kind, layers=2)


def _hf_run(kind, world, tp, stage, vocab=None):
    data = torch.randint(0, 51, (8, 9), generator=torch.Generator().manual_seed(1))
    dp = world // tp
    cfg_d = {"train_micro_batch_size_per_gpu": 4 // dp, "gradient_accumulation_steps": 2, "gradient_clipping": 0.5,
             "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}},
             "zero_optimization": {"stage": stage},
             "tensor_parallel": {"autotp_size": tp, "vocab_parallel_lm_head": vocab}}  # fmt: skip

    def rank(comm):
        cfg = fnzero.load_config(cfg_d, world_size=world)
        sm = fnzero.shard(_hf_model(kind), config=cfg, comm=comm)
        state = sm.init_state()

        def loss_fn(params, b):
            if world == 1:  # the reference: torch's cross-entropy of the whole logits, in float64
                logits = sm.apply(params, input_ids=b).logits
                return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 51), b[:, 1:].reshape(-1))
            return sm.apply(params, input_ids=b, labels=b).loss  # the model's own loss, made vocabulary-parallel

        step = fnzero.train_step(loss_fn, cfg)
        rows = 8 // dp
        d = comm.rank // tp
        for _ in range(STEPS):
            state, m = step(state, data[d * rows: (d + 1) * rows])
        return sm.gather(state), m["loss"]

    return simulated_world(world).run(rank)


@pytest.mark.parametrize("kind,world,tp,stage", [
    ("gpt2", 2, 2, 0), ("gpt2", 4, 2, 3), ("gpt2", 4, 4, 1), ("llama", 2, 2, 0), ("llama", 4, 2, 3),
    ("llama_tied", 4, 2, 2),
], ids=lambda v: str(v))
def test_hugging_face_models_split_by_autotp_equal_the_unsharded_step(kind, world, tp, stage):
    """GPT-2 (Conv1D, fused q|k|v, tied head) and Llama (GQA, untied or tied head) from small
    configs: AutoTP splits them with no plan given, and the model's own `labels=` loss becomes the
    vocabulary-parallel one (51 entries: not divisible by 2 or 4)."""
    (ref, ref_loss), = _hf_run(kind, 1, 1, 0)
    for params, loss in _hf_run(kind, world, tp, stage):
        W.assert_close_tree(params, ref, rtol=RTOL, atol=1e-12, what=f"{kind} dp{world // tp} tp{tp} z{stage}")
        assert loss == pytest.approx(ref_loss, rel=RTOL)


@settings(max_examples=6, deadline=None, derandomize=True)
@given(widths=st.lists(st.integers(1, 9), min_size=3, max_size=5), tp=st.sampled_from([2, 3]),
       dp=st.sampled_from([1, 2]), stage=st.sampled_from([0, 1, 2, 3]))
def test_explicit_plans_with_widths_the_tp_size_does_not_divide(widths, tp, dp, stage):
    """An MLP has no built-in plan: `tp_plan` splits its linears column/row in turn; widths of 1 to
    9 leave some ranks with one row more than others, or none at all."""
    n = len(widths) - 1
    rules = [TPRule(rf"layers\.{i}", "column" if i % 2 == 0 else "row") for i in range(n - n % 2)]
    gen = torch.Generator().manual_seed(sum(widths))
    x = torch.randn(4, 2, 2, widths[0], generator=gen, dtype=torch.float64)
    y = torch.randn(4, 2, 2, widths[-1], generator=gen, dtype=torch.float64)

    def train(comm, tp_):
        cfg = fnzero.load_config({"train_micro_batch_size_per_gpu": 2 // (comm.world_size // tp_),
                                  "gradient_accumulation_steps": 2, "gradient_clipping": 0.5,
                                  "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}},
                                  "zero_optimization": {"stage": stage if tp_ > 1 else 0}},
                                 world_size=comm.world_size // tp_)  # fmt: skip
        with seeded(3):
            model = MLP(widths).double()
        mesh = make_mesh(comm, tp=tp_)
        sm = fnzero.shard(model, config=cfg, comm=comm, mesh=mesh, tp_plan=rules if tp_ > 1 else None)
        state = sm.init_state()
        step = fnzero.train_step(lambda p, b: torch.nn.functional.mse_loss(sm.apply(p, b[0]), b[1]), cfg)
        d, per = mesh.coords["dp"], 4 // mesh.shape.dp
        for s in range(2):
            batch = x[s].reshape(4, -1)[d * per:(d + 1) * per], y[s].reshape(4, -1)[d * per:(d + 1) * per]
            state, _ = step(state, batch)
        return sm.gather(state)

    (ref,) = simulated_world(1).run(lambda comm: train(comm, 1))
    for got in simulated_world(dp * tp).run(lambda comm: train(comm, tp)):
        W.assert_close_tree(got, ref, rtol=RTOL, atol=1e-12, what=f"widths {widths} tp{tp} dp{dp} z{stage}")


@settings(max_examples=20, deadline=None, derandomize=True)
@given(shape=st.lists(st.integers(1, 9), min_size=1, max_size=3), dim_pick=st.integers(0, 2),
       blocks=st.sampled_from([1, 2, 3]), size=st.integers(1, 5))
def test_a_split_parameter_round_trips(shape, dim_pick, blocks, size):
    """Every rank's slice, put back together, is the full tensor, for block counts and sizes
    that do not divide (ranks may hold nothing)."""
    dim = dim_pick % len(shape)
    shape[dim] *= blocks
    full = torch.arange(torch.Size(shape).numel(), dtype=torch.float64).reshape(shape)
    split = ParamSplit(tuple(shape), dim, size, blocks)
    parts = [split.local(full, r) for r in range(size)]
    assert [tuple(p.shape) for p in parts] == [split.local_shape(r) for r in range(size)]
    assert torch.equal(split.full(parts), full)


@settings(max_examples=10, deadline=None, derandomize=True)
@given(vocab=st.integers(2, 11), tp=st.integers(2, 3), rows=st.integers(1, 6), ignore=st.booleans())
def test_the_vocabulary_parallel_cross_entropy_is_torchs(vocab, tp, rows, ignore):
    """Loss and logit gradients equal torch's cross-entropy on the whole logits, ignored targets
    included; no rank ever holds the whole logits."""
    gen = torch.Generator().manual_seed(vocab * 10 + rows)
    logits = torch.randn(rows, vocab, generator=gen, dtype=torch.float64) * 3
    target = torch.randint(0, vocab, (rows,), generator=gen)
    if ignore:
        target[0] = -100
    want_logits = logits.clone().requires_grad_(True)
    want = torch.nn.functional.cross_entropy(want_logits, target)
    want.backward()
    split = ParamSplit((rows, vocab), 1, tp)

    def rank(comm):
        local = split.local(logits, comm.rank).requires_grad_(True)
        loss = vocab_parallel_cross_entropy(local, target, split.start(comm.rank), comm)
        loss.backward()
        return loss.detach(), local.grad

    out = simulated_world(tp).run(rank)
    for loss, _ in out:
        torch.testing.assert_close(loss, want.detach(), rtol=1e-12, atol=1e-14, equal_nan=True)
    torch.testing.assert_close(split.full([g for _, g in out]), want_logits.grad, rtol=1e-12, atol=1e-14, equal_nan=True)


def _cfg(tp, world, **tp_extra):
    return fnzero.load_config({"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW"},
                               "tensor_parallel": {"autotp_size": tp, **tp_extra}}, world_size=world)  # fmt: skip


def test_bad_meshes_and_plans_are_config_errors_naming_the_numbers():
    with pytest.raises(fnzero.ConfigError, match=r"autotp_size` 3 does not divide the world size 4"):
        _cfg(3, 4)
    with pytest.raises(fnzero.ConfigError, match="tensor-parallel size 3 needs a world size that is a multiple of 3; "
                                                 "this world has 2 rank"):
        make_mesh(SimpleNamespace(world_size=2, rank=0), tp=3)

    def shard(model, cfg):
        return simulated_world(cfg.world_ranks).run(lambda comm: fnzero.shard(model(), config=cfg, comm=comm))

    with pytest.raises(fnzero.DistributedError, match="ConfigError: tensor_parallel.autotp_size 2 does not divide the model's n_head 3"):
        shard(lambda: W.make_model("gpt"), _cfg(2, 2))
    with pytest.raises(fnzero.DistributedError, match="ConfigError: tensor_parallel.autotp_size 4 does not divide the model's num_key_value_heads 2"):
        shard(lambda: _hf_model("llama"), _cfg(4, 4))
    with pytest.raises(fnzero.DistributedError, match="ConfigError: tensor parallelism over 2 ranks: fnzero has no built-in AutoTP plan for MLP"):
        shard(lambda: MLP([3, 4, 2]), _cfg(2, 2))
    with pytest.raises(fnzero.DistributedError, match="no built-in AutoTP plan for tensor_parallel.preset_model 'phi3' "
                                                      r"\(one of DeepSpeed's presets; fnzero's built-in plans are "):
        shard(lambda: MLP([4, 4, 2]), _cfg(2, 2, preset_model="phi3"))


def test_a_layer_with_a_forward_of_its_own_is_refused_not_split():
    """Gemma's embedding is an nn.Embedding that scales its output in its own forward: Llama's
    plan (the same module names) would replace it by a split embedding without the scale."""
    import transformers

    from fnzero.sharding.tp._autotp import PLANS

    def gemma():
        with seeded(0):
            return transformers.GemmaForCausalLM(transformers.GemmaConfig(
                vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                num_key_value_heads=2, head_dim=8))

    cfg = _cfg(2, 2)
    with pytest.raises(fnzero.DistributedError, match="ConfigError: AutoTP rule .* matched module 'model.embed_tokens', "
                                                      "a GemmaTextScaledWordEmbedding: a Embedding with a forward of its own"):
        simulated_world(2).run(lambda comm: fnzero.shard(gemma(), config=cfg, comm=comm, tp_plan=PLANS["llama"]))


def test_layer_specs_in_deepspeeds_format_split_any_model():
    """`partition_config.layer_specs` (patterns over parameter names, row/column) plan a model
    fnzero has no built-in plan for."""
    specs = {"partition_config": {"layer_specs": [
        {"patterns": [r"layers\.0\.weight$"], "partition_type": "column"},
        {"patterns": [r"layers\.1\.weight$"], "partition_type": "row"}]}}
    cfg = _cfg(2, 2, **specs)

    def rank(comm):
        with seeded(0):
            sm = fnzero.shard(MLP([3, 5, 2]), config=cfg, comm=comm)
        return {n: tuple(p.shape) for n, p in sm.module.named_parameters()}, sorted(sm.tp.splits)

    shapes, split = simulated_world(2).run(rank)[1]
    assert split == ["layers.0.bias", "layers.0.weight", "layers.1.weight"]
    assert shapes["layers.0.weight"] == (2, 3) and shapes["layers.1.weight"] == (2, 2)  # rank 1: 5 = 3 + 2


def _ckpt_cfg(stage, tp, world):
    return W.config(stage, k=1, micro=4 // (world // tp), world=world, clip=0.5,
                    extra={"tensor_parallel": {"autotp_size": tp}})  # fmt: skip


def _ckpt_batch(s, dp, r):
    x, y = W.global_batch("gpt_tp", s, 1, 1, 4, torch.float64)  # 4 rows per step, split over the dp ranks
    n = 4 // dp
    return x[0, 0, r * n:(r + 1) * n], y[0, 0, r * n:(r + 1) * n]


def _ckpt_run(path, world, tp, stage, *, load=False, save_after=None, steps=1, start=0):
    """Train `steps` steps from `start` (after loading `path`); save after step `save_after`.
    Per rank: (the consolidated parameters when saved or loaded, those at the end)."""
    def rank(comm):
        cfg = _ckpt_cfg(stage, tp, world)
        sm = fnzero.shard(W.make_model("gpt_tp"), config=cfg, comm=comm)
        state = sm.init_state()
        if load:
            state, _ = fnzero.checkpoint.load(path, state)
        mark = sm.gather(state)
        step = fnzero.train_step(lambda p, b: W.loss_of("gpt_tp", sm.apply(p, b[0]), b[1]), cfg)
        for s in range(start, start + steps):
            state, _ = step(state, _ckpt_batch(s, world // tp, comm.rank // tp))
            if s == save_after:
                fnzero.checkpoint.save(path, state)
                mark = sm.gather(state)
        return mark, sm.gather(state)

    return simulated_world(world).run(rank)


@pytest.fixture(scope="module")
def mesh_checkpoint(tmp_path_factory):
    """A checkpoint saved at dp 2 x tp 2, ZeRO-3, after 2 steps; the run's parameters then, and
    after a third step."""
    path = str(tmp_path_factory.mktemp("mesh_ckpt"))
    saved, after = _ckpt_run(path, 4, 2, 3, save_after=1, steps=3)[0]
    return path, saved, after


@pytest.mark.parametrize("world,tp,stage", [(4, 1, 1), (1, 1, 0), (2, 2, 1), (4, 4, 2), (4, 2, 3)],
                         ids=lambda v: str(v))
def test_a_checkpoint_saved_at_one_mesh_loads_at_any_other(mesh_checkpoint, world, tp, stage):
    """specs/mesh.md §Checkpoints: the dp2 x tp2 checkpoint loads at dp 4, dp 1, tp 2, tp 4 and
    its own mesh with the same parameters bit for bit, and the next step there equals the saving
    run's next step (so master weights and moments came back too)."""
    path, saved, after = mesh_checkpoint
    for loaded, cont in _ckpt_run(path, world, tp, stage, load=True, steps=1, start=2):
        assert all(torch.equal(loaded[k], saved[k]) for k in saved)
        W.assert_close_tree(cont, after, rtol=RTOL, atol=1e-12, what=f"continued at dp{world // tp} tp{tp} z{stage}")


def test_a_checkpoint_without_tensor_parallelism_loads_into_a_mesh(tmp_path):
    path = str(tmp_path)
    saved, after = _ckpt_run(path, 2, 1, 2, save_after=0, steps=2)[0]
    for loaded, cont in _ckpt_run(path, 4, 2, 3, load=True, steps=1, start=1):
        assert all(torch.equal(loaded[k], saved[k]) for k in saved)
        W.assert_close_tree(cont, after, rtol=RTOL, atol=1e-12, what="dp2 z2 -> dp2 x tp2 z3")


def test_a_tensor_parallel_checkpoint_exports_without_conversion(mesh_checkpoint, tmp_path):
    """It is an ordinary checkpoint of the whole model: `export` writes one consolidated safetensors
    file, and a live export from a tp run gives the same tensors."""
    from safetensors.torch import load_file

    path, saved, _ = mesh_checkpoint
    (file,) = fnzero.checkpoint.export(path, str(tmp_path / "out"), dtype="fp32")
    got = load_file(file)
    assert sorted(got) == sorted(saved) and all(torch.equal(got[k], saved[k].float()) for k in saved)

    def rank(comm):
        cfg = _ckpt_cfg(1, 2, 2)
        sm = fnzero.shard(W.make_model("gpt_tp"), config=cfg, comm=comm)
        state, _ = fnzero.checkpoint.load(path, sm.init_state())
        return fnzero.checkpoint.export_live(sm, state, str(tmp_path / "live"), dtype="fp32")

    written = simulated_world(2).run(rank)  # every rank: the one file tp rank 0 wrote
    assert written[0] == written[1] == [str(tmp_path / "live" / "model.safetensors")]
    live = load_file(written[0][0])
    assert all(torch.equal(live[k], got[k]) for k in got)


@pytest.mark.parametrize("kind", ["gpt_tp", "llama_tied"])
def test_a_meta_model_split_over_tp_gets_the_values_it_gets_without(kind):
    """specs/mesh.md §AutoTP: a model built on the meta device is initialised region by region as
    without tensor parallelism (its own init code, fnzero's seed), then cut, so its consolidated
    weights are the same at every mesh, and no rank ever holds the whole model."""
    def build():
        return W.make_model("gpt_tp") if kind == "gpt_tp" else _hf_model(kind)

    def weights(world, tp):
        def rank(comm):
            with seeded(0), torch.device("meta"):  # the lock of torch's RNG: other ranks' meta init draws from it
                model = build()
            cfg = _cfg(tp, world, vocab_parallel_lm_head=True)
            sm = fnzero.shard(model, config=cfg, comm=comm, init_seed=7)
            return sm.gather(sm.init_state())
        return simulated_world(world).run(rank)

    (want,) = weights(1, 1)
    for got in weights(4, 2) + weights(2, 2):
        assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)


def _split_numel(model, tp, rank, splits):
    seen, total = set(), 0
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in seen:
            continue
        seen.add(id(p))
        split = splits.get(name)
        total += torch.Size(split.local_shape(rank)).numel() if split is not None else p.numel()
    return total


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_model_state_bytes_are_the_zero_formula_of_each_ranks_slices(stage):
    """specs/mesh.md §Memory: a rank holds Ψ_r = its pieces of the split parameters + every
    replicated one; ZeRO's formula then applies over the dp ranks with Ψ_r (padding included)."""
    cfg = fnzero.load_config({"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW"},
                              "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
                              "tensor_parallel": {"autotp_size": 2}}, world_size=4)  # fmt: skip

    def rank(comm):
        full = W.make_model("gpt_tp", torch.float32)
        sm = fnzero.shard(W.make_model("gpt_tp", torch.float32), config=cfg, comm=comm)
        return sm.plan, fnzero.memory.model_state_bytes(sm.init_state()), _split_numel(full, 2, sm.tp.rank, sm.tp.splits)

    out = simulated_world(4).run(rank)
    for plan, got, psi_r in out:
        assert plan.num_params == psi_r
        assert got.total == fnzero.memory.zero_formula(plan.num_padded, stage, 2, False)
    full = W.make_model("gpt_tp", torch.float32)
    assert out[0][2] + out[1][2] < 2 * sum(p.numel() for p in full.parameters())  # the split ones are halved


def test_tensor_parallel_traffic_is_the_formula():
    """specs/collectives.md §Tensor parallel: per micro-batch, 2 all-reduces of B·S·H activations per
    block forward (row layers) and 2 backward (column layers' inputs), one more backward for the
    column-parallel head's input, one all-gather of the logits (the head, gathered), and one number
    for the gradient norm per step; all recorded on the tp axis."""
    cfg = fnzero.load_config({"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW"},
                              "comms_logger": {"enabled": True}, "tensor_parallel": {"autotp_size": 2}},
                             world_size=2)  # fmt: skip
    b, s, h, v, layers = 2, 8, 16, 37, 2

    def rank(comm):
        sm = fnzero.shard(W.make_model("gpt_tp", torch.float32), config=cfg, comm=comm)
        state = sm.init_state()
        step = fnzero.train_step(lambda p, x: torch.nn.functional.cross_entropy(
            sm.apply(p, x).flatten(0, 1), x.flatten()), cfg)
        x = torch.randint(0, v, (b, s), generator=torch.Generator().manual_seed(0))
        sm.tp.comm.records.clear()
        step(state, x)
        return [(r.op, r.bytes) for r in sm.tp.comm.records]

    for records in simulated_world(2).run(rank):
        act = b * s * h * 4
        assert sorted(records) == sorted([("all_reduce", act)] * (4 * layers + 1) + [("all_gather", b * s * 19 * 2 * 4)]
                                         + [("all_reduce", 8)])  # fmt: skip


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_pretrained_weights_load_into_tensor_parallel_slices(kind, tmp_path):
    """A Hugging Face save_pretrained directory into a meta model split over tp: every rank's
    consolidated weights are the file's, bit for bit (the files' whole tensors, cut per rank)."""
    model = _hf_model(kind)
    model.save_pretrained(tmp_path)
    want = {k: v for k, v in model.state_dict().items()}

    def rank(comm):
        with seeded(0), torch.device("meta"):
            meta = _hf_model(kind)
        sm = fnzero.shard(meta, config=_cfg(2, 4), comm=comm)
        return sm.state_dict(sm.init_state(pretrained=tmp_path))

    for got in simulated_world(4).run(rank):
        assert all(torch.equal(got[k], want[k]) for k in want if k in got)
        assert {k for k in want if "rotary" not in k} <= set(got)


def test_review_cases_lamb_frozen_split_parameters_and_configs_without_a_world():
    """Lamb normalises per tensor: refused on tensor-parallel slices, naming why. A frozen split
    parameter comes back whole from state_dict and through a checkpoint. A config with
    autotp_size loads without a world size (one tensor-parallel group)."""
    cfg = fnzero.config.load_config({"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "Lamb"},
                                     "tensor_parallel": {"autotp_size": 2}})  # no world size given  # fmt: skip
    assert (cfg.world_ranks, cfg.world_size) == (2, 1)

    def lamb(comm):
        sm = fnzero.shard(W.make_model("gpt_tp"), config=cfg, comm=comm)
        with pytest.raises(fnzero.ShardingError, match="cannot update tensor-parallel slices"):
            sm.init_state()

    simulated_world(2).run(lamb)

    def frozen(comm):
        model = W.make_model("gpt_tp")
        model.blocks[0].fc.weight.requires_grad_(False)
        want = model.blocks[0].fc.weight.detach().clone()
        sm = fnzero.shard(model, config=_cfg(2, 2), comm=comm)
        sd = sm.state_dict(sm.init_state())
        return torch.equal(sd["blocks.0.fc.weight"], want)

    assert simulated_world(2).run(frozen) == [True, True]


def test_a_tensor_parallel_group_built_under_different_seeds_is_named():
    def rank(comm):
        with seeded(comm.rank):  # a seed bug: every rank its own init
            model = W._make_model("gpt_tp", torch.float64, comm.rank)
        fnzero.shard(model, config=_cfg(2, 2), comm=comm)

    with pytest.raises(fnzero.DistributedError, match=r"tensor-parallel group built different models: tp rank\(s\) \[1\]"):
        simulated_world(2).run(rank)
