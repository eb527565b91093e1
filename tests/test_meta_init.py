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


FACTORIES = {
    "llama": lambda: transformers.LlamaForCausalLM(LLAMA),
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
    assert not torch.equal(other[next(iter(ref))], ref[next(iter(ref))]) or len(ref) == 0


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


@given(factory=ft.models(), stage=st.integers(0, 3), world=st.integers(2, 5))
@settings(max_examples=20, deadline=None)
def test_drawn_models_initialise_the_same_at_any_world(factory, stage, world):
    """Odd sizes, padding, tied and frozen parameters: a meta build's gathered initial state is
    the same bits on one rank at stage 0 and on every rank of any world at any stage."""
    ref = _initial(factory, 0, 1, seed=4)[0]
    for r, got in enumerate(_initial(factory, stage, world, seed=4)):
        assert got.keys() == ref.keys()
        assert all(torch.equal(got[n], ref[n]) for n in ref), (stage, world, r)
        assert not any(t.is_floating_point() and torch.isnan(t).any() for t in got.values())
