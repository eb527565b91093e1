"""Construction that never materialises the whole model (`specs/sharding.md` §Meta construction).

A model built on the meta device (or a zero-argument factory) is materialised one region at a
time by each rank, initialised by the model's own init code, and only this rank's shards are
kept. The gathered initial parameters are the same bits at world sizes 1, 2 and 4 and at every
stage, and each tensor's statistics match eager construction's.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from hypothesis import given, settings
from hypothesis import strategies as st

import fnzero
import fnzero.testing as ft
from fnzero.testing import GPT, simulated_world

transformers.logging.set_verbosity_error()

LLAMA = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                 num_key_value_heads=2, vocab_size=128, tie_word_embeddings=False)
GPT2 = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=128, n_positions=16)


def _cfg(stage, world):
    return fnzero.load_config({"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW"},
                               "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}},
                              world_size=world)


def _initial(factory, stage, world, seed=11):
    def rank(comm):
        sm = fnzero.shard(factory, config=_cfg(stage, world), comm=comm, init_seed=seed)
        return sm.state_dict(sm.init_state())

    return simulated_world(world).run(rank)


def _llama_partly_frozen():
    # A frozen-only embedding unit and a frozen-only decoder layer: their own init regions at every
    # stage (stage 3 holds them as frozen units, stages 0-2 whole by name), so the same bits.
    model = transformers.LlamaForCausalLM(LLAMA)
    model.model.embed_tokens.weight.requires_grad_(False)
    for p in model.model.layers[0].parameters():
        p.requires_grad_(False)
    return model


FACTORIES = {
    "llama": lambda: transformers.LlamaForCausalLM(LLAMA),
    "llama_partly_frozen": _llama_partly_frozen,
    "gpt2": lambda: transformers.GPT2LMHeadModel(GPT2),  # tied embeddings
    "fnzero_gpt": lambda: GPT(vocab_size=64, seq_len=8, d_model=16, n_layer=2, n_head=2, tied=True),
}


@pytest.mark.parametrize("kind", list(FACTORIES))
def test_same_bits_at_every_world_size_and_stage(kind):
    ref = _initial(FACTORIES[kind], 0, 1)[0]
    for stage, world in ((3, 2), (1, 4), (3, 4), (2, 2)):
        for r, got in enumerate(_initial(FACTORIES[kind], stage, world)):
            assert got.keys() == ref.keys()
            diff = [n for n in ref if not torch.equal(got[n], ref[n])]
            assert not diff, f"stage {stage}, world {world}, rank {r}: {diff}"
    # Another seed, other values: the seed reaches the init.
    other = _initial(FACTORIES[kind], 0, 1, seed=12)[0]
    assert any(not torch.equal(other[n], ref[n]) for n in ref) or len(ref) == 0


@pytest.mark.parametrize("kind", list(FACTORIES))
def test_statistics_match_eager_construction(kind):
    got = _initial(FACTORIES[kind], 3, 2)[0]
    torch.manual_seed(0)
    eager_model = FACTORIES[kind]()
    eager = {n: t.detach() for n, t in [*eager_model.named_parameters(remove_duplicate=False), *eager_model.named_buffers()]}
    assert set(got) == set(eager)
    for name, e in eager.items():
        g = got[name]
        assert g.shape == e.shape and g.dtype == e.dtype, name
        if not e.is_floating_point() or e.numel() < 2 or float(e.std()) == 0.0:
            assert torch.equal(g, e.detach()), f"{name}: a constant tensor (ones, zeros, positions, inv_freq) must match exactly"
            continue
        # Independent draws of >= 512 elements from the same distribution: the means agree within
        # a few standard errors, the standard deviations within ~10 %.
        se = float(e.std()) / e.numel() ** 0.5
        assert abs(float(g.mean()) - float(e.mean())) < 6 * se + 1e-6, name
        assert float(g.std()) == pytest.approx(float(e.std()), rel=0.12), name


def test_meta_model_trains_like_its_materialised_copy():
    """The meta-built model, gathered, trains exactly as the same weights built eagerly."""
    cfg = fnzero.load_config({"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 1.0,
                              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}},
                              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}, world_size=2)
    ids = torch.randint(0, 128, (4, 8), generator=torch.Generator().manual_seed(0))

    def rank(comm):
        with torch.device("meta"):
            model = transformers.LlamaForCausalLM(LLAMA).double()  # float64: compare tightly
        sm = fnzero.shard(model, config=cfg, comm=comm, init_seed=3)
        state = sm.init_state()
        initial = sm.state_dict(state)
        step = fnzero.train_step(lambda p, b: sm.apply(p, input_ids=b, labels=b).loss, cfg)
        state, _ = step(state, ids[2 * comm.rank: 2 * comm.rank + 2])
        return initial, sm.gather(state)

    (initial, trained), _ = simulated_world(2).run(rank)
    model = transformers.LlamaForCausalLM(LLAMA).double()
    model.load_state_dict(initial, strict=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    for r in range(2):
        (model(input_ids=ids[2 * r: 2 * r + 2], labels=ids[2 * r: 2 * r + 2]).loss / 2).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    for n, p in model.named_parameters():
        torch.testing.assert_close(trained[n], p.detach(), rtol=1e-9, atol=1e-12, msg=lambda m, n=n: f"{n}: {m}")


class _NoInit(torch.nn.Module):
    """A parameter no init code knows: left alone, it would train on garbage."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(3, 3)
        self.scale = torch.nn.Parameter(torch.empty(3))

    def forward(self, x):
        return self.lin(x) * self.scale


def test_an_uninitialised_parameter_is_named(tmp_path):
    sm = fnzero.shard(_NoInit, config=_cfg(3, 1))
    with pytest.raises(fnzero.ShardingError, match=r"uninitialised: scale\b"):
        sm.init_state()
    # Pretrained weights that supply it make it fine; ones that do not are named as lacking it.
    from safetensors.torch import save_file

    save_file({"scale": torch.full((3,), 2.0)}, tmp_path / "scale.safetensors")
    save_file({"lin.bias": torch.zeros(3)}, tmp_path / "bias.safetensors")
    with pytest.warns(fnzero.PretrainedWarning), pytest.raises(fnzero.ShardingError, match="pretrained weights lack them: scale"):
        sm.init_state(pretrained=tmp_path / "bias.safetensors")
    with pytest.warns(fnzero.PretrainedWarning, match="lin.weight"):
        state = sm.init_state(pretrained=tmp_path / "scale.safetensors")
    assert torch.equal(sm.gather(state)["scale"], torch.full((3,), 2.0))


class _Mixed(torch.nn.Module):
    """A torch module whose init is not `reset_parameters` (MultiheadAttention's is private), a
    bool buffer set in the constructor, and a parameter already real in an otherwise meta model."""

    def __init__(self):
        super().__init__()
        self.attn = torch.nn.MultiheadAttention(8, 2, batch_first=True)
        self.head = torch.nn.Linear(8, 2)
        self.register_buffer("mask", torch.ones(4, dtype=torch.bool))

    def forward(self, x):
        return self.head(self.attn(x, x, x, need_weights=False)[0])


def test_private_resets_bool_buffers_and_real_tensors():
    with torch.device("meta"):
        model = _Mixed()
    real = torch.arange(16.0).reshape(2, 8)
    model.head.weight = torch.nn.Parameter(real.clone())  # already loaded: the init must keep it
    sm = fnzero.shard(model, config=_cfg(3, 1), init_seed=1)
    # The bool buffer was only written by the constructor, on meta: named, not silently garbage.
    with pytest.raises(fnzero.ShardingError, match=r"uninitialised: mask\b"):
        sm.init_state()
    sm.initial_values().uninitialised.remove("mask")  # (as if pretrained weights had supplied it)
    got = sm.state_dict(sm.init_state())
    assert torch.equal(got["head.weight"], real)
    assert not torch.isnan(got["attn.in_proj_weight"]).any() and float(got["attn.in_proj_weight"].std()) > 0


def test_frozen_and_buffer_only_modules():
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.frozen = torch.nn.Linear(4, 4).requires_grad_(False)
            self.norm = torch.nn.BatchNorm1d(4)  # running stats: buffers, reset by reset_parameters
            self.head = torch.nn.Linear(4, 2)

        def forward(self, x):
            return self.head(self.norm(self.frozen(x)))

    got = _initial(Net, 3, 2)
    for r in got:
        assert torch.equal(r["norm.running_var"], torch.ones(4)) and int(r["norm.num_batches_tracked"]) == 0
        assert not torch.isnan(r["frozen.weight"]).any() and torch.equal(r["frozen.weight"], got[0]["frozen.weight"])
    assert not torch.equal(got[0]["frozen.weight"], torch.zeros(4, 4))


def test_a_model_sharded_twice_is_refused():
    with torch.device("meta"):
        meta = torch.nn.Linear(3, 2)
    for model in (torch.nn.Linear(3, 2), meta):
        fnzero.shard(model, config=_cfg(3, 1))
        with pytest.raises(fnzero.ShardingError, match="given to fnzero.shard already"):
            fnzero.shard(model, config=_cfg(3, 1))


@given(factory=ft.models(), stage=st.integers(0, 3), world=st.integers(2, 5), chunk=st.sampled_from([1, 3, 64, 1 << 18]))
@settings(max_examples=20, deadline=None)
def test_drawn_models_initialise_the_same_at_any_world(factory, stage, world, chunk):
    """Odd sizes, padding, tied and frozen parameters, replay chunks that shards start and end
    inside: a meta build's gathered initial state is the same bits on one rank at stage 0 and on
    every rank of any world at any stage."""
    from unittest import mock

    from fnzero.sharding.construct import _replay

    with mock.patch.object(_replay, "CHUNK", chunk):
        ref = _initial(factory, 0, 1, seed=4)[0]
        each = _initial(factory, stage, world, seed=4)
    for r, got in enumerate(each):
        assert got.keys() == ref.keys()
        assert all(torch.equal(got[n], ref[n]) for n in ref), (stage, world, r)
        assert not any(t.is_floating_point() and torch.isnan(t).any() for t in got.values())


# Replayed initialisation (`sharding/construct/_replay.py`): a rank computes only the chunks it keeps.


@given(rows=st.integers(1, 40), cols=st.integers(1, 40), chunk=st.sampled_from([1, 7, 16, 64, 4096]),
       cuts=st.lists(st.integers(0, 1600), min_size=2, max_size=6))
@settings(max_examples=40, deadline=None)
def test_a_replayed_range_is_that_range_of_the_whole(rows, cols, chunk, cuts):
    """Any range of a recorded tensor replays to the same bits as that range of the whole: chunks
    are computed whole, so no element depends on the part asked for (the world size)."""
    from unittest import mock

    from fnzero.sharding.construct import _replay

    with torch.device("meta"):
        w, b, i = torch.empty(rows, cols), torch.empty(cols, dtype=torch.float64), torch.empty(rows, dtype=torch.int32)
        never = torch.empty(3)

    def init(t):
        torch.nn.init.kaiming_uniform_(t["w"], a=5**0.5)  # overwritten whole below: never replayed
        torch.nn.init.normal_(t["w"], std=0.02)
        t["w"].mul_(2.0).add_(0.5).clamp_(min=0.4, max=0.6)  # elementwise arithmetic with scalars
        t["w"][0].zero_()  # a row, as an embedding's padding index
        t["b"].copy_(torch.arange(cols) * 0.5)  # from a tensor computed on the side
        t["i"].data.random_(0, 10)

    with mock.patch.object(_replay, "CHUNK", chunk):
        recs = _replay.record(init, {"w": w, "b": b, "i": i, "never": never}, seed=3)
        assert [o.kind for o in recs["w"].ops] == ["random", "random", "pointwise", "pointwise", "pointwise", "fill"]
        assert recs["never"].untouched() and not any(recs[n].untouched() for n in "wbi")
        for name, rec in recs.items():
            whole = rec.whole().reshape(-1)
            for k, (lo, hi) in enumerate(zip(cuts, cuts[1:])):
                lo, hi = sorted((min(lo, rec.numel), min(hi, rec.numel)))
                dtype = rec.dtype if k % 2 else torch.float64  # another dtype: converted as it is written
                part = torch.empty(hi - lo, dtype=dtype)
                rec.fill(lo, hi, part)
                assert torch.equal(part, whole[lo:hi].to(dtype)) or (name == "never" and part.isnan().all())
        assert torch.equal(recs["b"].whole(), torch.arange(cols) * 0.5) and bool((recs["w"].whole()[0] == 0).all())


def test_each_rank_computes_only_the_chunks_it_keeps():
    """ZeRO-3 over 4 ranks: a rank replays its shard's chunks (and at most one chunk more at each
    end of each tensor it overlaps), and the gathered values are the same bits as on one rank."""
    import threading
    from unittest import mock

    from fnzero.sharding.construct import _replay

    factory = lambda: torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(3)])  # noqa: E731
    done: dict[int, int] = {}
    chunk = _replay.TensorRecord._chunk

    def counted(rec, c, c0, c1, buf):
        done[threading.get_ident()] = done.get(threading.get_ident(), 0) + (c1 - c0)
        return chunk(rec, c, c0, c1, buf)

    def initial(world):
        def rank(comm):
            sm = fnzero.shard(factory, config=_cfg(3, world), comm=comm, init_seed=5, wrap=[torch.nn.Linear])
            return sm.state_dict(sm.init_state())

        done.clear()
        return simulated_world(world).run(rank), dict(done)

    with mock.patch.object(_replay, "CHUNK", 256), mock.patch.object(_replay.TensorRecord, "_chunk", counted):
        (want,), whole = initial(1)
        got, each = initial(4)
    total = 3 * (64 * 64 + 64)
    assert sum(whole.values()) == total  # one rank: every element once, the discarded reset never
    assert len(each) == 4 and all(n <= total / 4 + 3 * 2 * 2 * 256 for n in each.values()), each
    for r in got:
        assert all(torch.equal(r[n], want[n]) for n in want)


class _Odd(torch.nn.Module):
    """Init code that cannot be replayed by slices: such a region is materialised whole."""

    def __init__(self):
        super().__init__()
        self.orth = torch.nn.Linear(6, 6)  # orthogonal_: a QR of a temporary, copied in
        self.unit = torch.nn.Linear(6, 6)  # scaled by its own norm: reads its values
        self.trunc = torch.nn.Linear(6, 6)  # trunc_normal_: rejection sampling (and a no-op on meta tensors)
        self.plain = torch.nn.Linear(6, 3)

    def _init_weights(self, m):
        if m is self.orth:
            torch.nn.init.orthogonal_(m.weight)
        elif m is self.unit:
            m.weight.mul_(1.0 / float(m.weight.norm()))
        elif m is self.trunc:
            torch.nn.init.trunc_normal_(m.weight, std=0.02, a=-0.03, b=0.03)


def test_init_code_that_cannot_be_replayed_is_run_on_the_materialised_region():
    from fnzero.sharding.construct._materialize import MetaInitializer, Recorded
    from fnzero.sharding.zero._plan import make_plan

    with torch.device("meta"):
        model = _Odd()
    plan = make_plan(model, 1, 3, wrap=[torch.nn.Linear])
    init = MetaInitializer(model, plan, 0)
    kinds = {}
    for region in ("orth", "unit", "trunc", "plain"):
        with init.initialised(region) as values:
            kinds[region] = isinstance(values, Recorded)
    assert kinds == {"orth": False, "unit": False, "trunc": False, "plain": True}
    assert all(t.is_meta for t in model.parameters())  # the attempt to record left the model as it was

    def initial(world):
        def rank(comm):
            sm = fnzero.shard(_Odd, config=_cfg(3, world), comm=comm, init_seed=2, wrap=[torch.nn.Linear])
            return sm.state_dict(sm.init_state())

        return simulated_world(world).run(rank)

    (want,) = initial(1)
    torch.testing.assert_close(want["orth.weight"] @ want["orth.weight"].T, torch.eye(6), atol=1e-5, rtol=0)
    assert float(want["unit.weight"].norm()) == pytest.approx(1.0)
    assert float(want["trunc.weight"].abs().max()) <= 0.03  # not reset_parameters()' kaiming values (up to 0.41)
    for r in initial(2) + initial(4):
        assert all(torch.equal(r[n], want[n]) for n in want)


class _FilledThroughAView(torch.nn.Linear):
    """Init code that fills whole tensors through permuted views (`zeros_(w.T)`) after its draws."""

    def reset_parameters(self):
        with torch.no_grad():
            if self.in_features == 5:  # the only write to the weight goes through its transpose
                torch.nn.init.zeros_(self.weight.T)
                self.bias.fill_(0.5)
            else:
                super().reset_parameters()
                self.weight.mT.fill_(0.25)
                self.bias[1:].zero_()  # a part: the rest keeps the draw


def _filled_through_a_view():
    return torch.nn.Sequential(_FilledThroughAView(5, 7), _FilledThroughAView(7, 3))


def test_a_whole_fill_through_a_permuted_view_is_a_whole_fill():
    def initial(world):
        def rank(comm):
            sm = fnzero.shard(_filled_through_a_view, config=_cfg(3, world), comm=comm, init_seed=4, wrap=[torch.nn.Linear])
            return sm.state_dict(sm.init_state())

        return simulated_world(world).run(rank)

    (want,) = initial(1)  # a fill through `w.T` once left the tensor "uninitialised" and init_state refused it
    assert torch.equal(want["0.weight"], torch.zeros(7, 5)) and torch.equal(want["0.bias"], torch.full((7,), 0.5))
    assert torch.equal(want["1.weight"], torch.full((3, 7), 0.25))
    assert torch.equal(want["1.bias"][1:], torch.zeros(2)) and want["1.bias"][0] != 0
    for r in initial(2) + initial(4):
        assert all(torch.equal(r[n], want[n]) for n in want)
