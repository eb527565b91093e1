"""Exact resume and resharding: 2k steps straight == k steps, save, load, k steps."""

from __future__ import annotations

import os

import pytest
import torch
from _ckpt_helpers import full_buffers, run_steps, setup

import fnzero
from fnzero.checkpoint import load, save
from fnzero.testing import run_world
from fnzero.testing._threads import simulated_world

K = 2


def _straight_and_resumed(tmp_path, kind, save_at, load_at, precision="fp32"):
    """(straight states, resumed states): the straight run stays at `save_at` = (world, stage)."""
    d = str(tmp_path / "ck")
    (w1, s1), (w2, s2) = save_at, load_at

    def first(comm):
        cfg, sm, state, step = setup(kind, s1, comm, precision)
        state, _ = run_steps(kind, step, state, comm, 0, K)
        save(d, state, tag="mid", client_state={"next_step": K}, config=cfg)
        state, losses = run_steps(kind, step, state, comm, K, K)
        return state, losses

    def second(comm):
        cfg, sm, like, step = setup(kind, s2, comm, precision)
        state, cs = load(d, like=like)
        assert int(state.step) == K and cs == {"next_step": K}
        state, losses = run_steps(kind, step, state, comm, cs["next_step"], K)
        return state, losses

    straight = simulated_world(w1).run(first)
    resumed = simulated_world(w2).run(second)
    return [s for s, _ in straight], [s for s, _ in resumed], straight[0][1], resumed[0][1]


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_resume_is_bit_exact_same_world_and_stage(tmp_path, stage):
    a, b, la, lb = _straight_and_resumed(tmp_path, "gpt", (2, stage), (2, stage))
    assert la == lb
    for field in ("params", "exp_avg", "exp_avg_sq"):
        fa, fb = full_buffers(a, field), full_buffers(b, field)
        for name in fa:
            assert torch.equal(fa[name], fb[name]), (field, name)
    assert int(a[0].opt_state.count) == int(b[0].opt_state.count) == 2 * K


def test_resume_fp16_restores_loss_scale_bit_exact(tmp_path):
    a, b, la, lb = _straight_and_resumed(tmp_path, "mlp:6,9,4", (2, 2), (2, 2), precision="fp16")
    assert la == lb
    assert float(a[0].loss_scale.scale) == float(b[0].loss_scale.scale)
    assert int(a[0].loss_scale.good_steps) == int(b[0].loss_scale.good_steps)
    for field in ("params", "master", "exp_avg"):
        fa, fb = full_buffers(a, field), full_buffers(b, field)
        assert all(torch.equal(fa[n], fb[n]) for n in fa), field


@pytest.mark.parametrize("save_at,load_at", [((2, 1), (3, 3)), ((4, 3), (1, 0)), ((1, 0), (4, 2))])
def test_resume_across_world_sizes_and_stages(tmp_path, save_at, load_at):
    a, b, la, lb = _straight_and_resumed(tmp_path, "gpt", save_at, load_at)
    assert la == pytest.approx(lb, rel=1e-9)
    for field in ("params", "exp_avg", "exp_avg_sq"):
        fa, fb = full_buffers(a, field), full_buffers(b, field)
        for name in fa:
            torch.testing.assert_close(fb[name], fa[name], rtol=1e-9, atol=1e-12, msg=f"{field} {name}")


def test_precision_change_maps_master_and_params(tmp_path):
    """fp32 checkpoint -> bf16 run: master = saved fp32 params, params = master in bf16; and back:
    bf16 checkpoint -> fp32 run takes the fp32 master, not the rounded bf16 params."""
    d32, d16 = str(tmp_path / "f32"), str(tmp_path / "b16")

    def train(precision, d, stage):
        def fn(comm):
            _, _, state, step = setup("mlp:5,7,3", stage, comm, precision, dtype=torch.float32)
            state, _ = run_steps("mlp:5,7,3", step, state, comm, 0, 1, dtype=torch.float32)
            save(d, state, tag="t")
            return state
        return simulated_world(2).run(fn)

    def reload(precision, d, stage):
        def fn(comm):
            _, _, like, _ = setup("mlp:5,7,3", stage, comm, precision, dtype=torch.float32)
            return load(d, like=like)[0]
        return simulated_world(2).run(fn)

    s32 = train("fp32", d32, 1)
    b = reload("bf16", d32, 2)
    src = full_buffers(s32, "params")
    for n, t in full_buffers(b, "master").items():
        assert t.dtype == torch.float32 and torch.equal(t, src[n])
    for n, t in full_buffers(b, "params").items():
        assert t.dtype == torch.bfloat16 and torch.equal(t, src[n].to(torch.bfloat16))
    assert all(torch.equal(x, y) for x, y in zip(full_buffers(b, "exp_avg").values(), full_buffers(s32, "exp_avg").values()))

    s16 = train("bf16", d16, 3)
    f = reload("fp32", d16, 0)
    m16 = full_buffers(s16, "master")
    for n, t in full_buffers(f, "params").items():
        assert t.dtype == torch.float32 and torch.equal(t, m16[n])
    assert f[0].master is None and f[0].loss_scale is None


def test_async_save_equals_blocking_save_while_training_continues(tmp_path):
    d = str(tmp_path / "ck")

    def fn(comm):
        _, _, state, step = setup("gpt", 2, comm)
        state, _ = run_steps("gpt", step, state, comm, 0, 1)
        save(d, state, tag="blocking", update_latest=False)
        h = save(d, state, tag="async", blocking=False)
        # Keep training with donate-style in-place writes into the saved state's own buffers: the
        # snapshot taken by save() must not see them.
        for t in [*state.params.values(), *state.opt_state.exp_avg.values()]:
            t.add_(1.0)
        run_steps("gpt", step, state, comm, 1, 1)
        h.wait()
        return comm.rank

    simulated_world(2).run(fn)
    a, b = os.path.join(d, "blocking"), os.path.join(d, "async")
    for r in range(2):
        with open(os.path.join(a, f"rank{r:05d}.bin"), "rb") as fa, open(os.path.join(b, f"rank{r:05d}.bin"), "rb") as fb:
            assert fa.read() == fb.read()
    from fnzero.checkpoint import _format as F

    def index(p):
        with open(os.path.join(p, F.INDEX_NAME), "rb") as f:
            return F.unpack(f.read(), p)

    ia, ib = index(a), index(b)
    for k in ("nonce", "created", "tag", "rng", "index_crc32"):  # the seal covers the fields that differ
        ia.pop(k), ib.pop(k)
    assert ia == ib
    with open(os.path.join(d, "latest")) as f:
        assert f.read().strip() == "async"


def test_rng_state_is_restored(tmp_path):
    _, _, state, _ = setup("mlp:3,2", 0, fnzero.LocalCollectives())
    torch.manual_seed(123)
    save(tmp_path, state, tag="t")
    want = torch.rand(5)
    torch.manual_seed(999)
    load(tmp_path, like=state)
    assert torch.equal(torch.rand(5), want)


def test_config_and_step_are_stored(tmp_path):
    cfg, _, state, _ = setup("mlp:3,2", 1, fnzero.LocalCollectives())
    save(tmp_path, state.replace(step=torch.tensor(7)), config=cfg)
    info = fnzero.checkpoint.info(tmp_path)
    c = info["checkpoints"][0]
    assert info["latest"] == "step_7" and c["step"] == 7 and c["stage"] == 1 and c["health"] == "ok"
    assert fnzero.load_config(c["config"], world_size=1) == cfg


def _llama(seed):
    import transformers

    torch.manual_seed(seed)
    hf = transformers.LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                                  num_key_value_heads=2, vocab_size=64, tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(hf).double()
    model.model.embed_tokens.requires_grad_(False)  # a frozen unit in the new layout, root in the old
    return model


def test_checkpoint_of_the_old_root_layout_loads_into_embedding_and_head_units(tmp_path):
    # specs/sharding.md §Plan: an untied language model's embedding and head became units of their
    # own; a checkpoint saved when they were in the root (here through wrap=) loads by parameter
    # name (specs/checkpoint-format.md §Loading by name), frozen embedding and Adam moments included.
    import transformers

    d = str(tmp_path / "ck")
    cfg = fnzero.load_config({"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
                              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}, world_size=2)
    ids = torch.randint(0, 64, (2, 2, 2, 8), generator=torch.Generator().manual_seed(0))

    def run(comm, wrap, seed, load_from):
        sm = fnzero.shard(_llama(seed), config=cfg, comm=comm, wrap=wrap)

        def loss_fn(params, x):  # computed here: transformers' labels= loss is float32
            logits = sm.apply(params, input_ids=x).logits
            return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), x[:, 1:].flatten())

        step = fnzero.train_step(loss_fn, cfg)
        state = sm.init_state(check_ranks_equal=False)
        if load_from:
            state, _ = load(load_from, like=state)
        else:
            state, _ = step(state, ids[0, comm.rank])
            save(d, state, tag="old")
        state, m = step(state, ids[1, comm.rank])
        return sm.plan.unit_names, m["loss"], sm.gather(state)

    old = simulated_world(2).run(lambda comm: run(comm, transformers.models.llama.modeling_llama.LlamaDecoderLayer, 0, None))
    new = simulated_world(2).run(lambda comm: run(comm, None, 1, d))
    assert old[0][0] == ("<root>", "model.layers.0", "model.layers.1")
    assert new[0][0] == ("<root>", "model.layers.0", "model.layers.1", "lm_head")  # the embedding: frozen unit
    assert new[0][1] == pytest.approx(old[0][1], rel=1e-12)  # the frozen embedding was loaded
    for name, want in old[0][2].items():
        torch.testing.assert_close(new[0][2][name], want, rtol=1e-9, atol=1e-12, msg=name)  # and the moments


# -- real processes ------------------------------------------------------------------------------
def _spawned_save(d):
    from fnzero.sharding.comm._collectives import ProcessGroupCollectives

    comm = ProcessGroupCollectives()
    _, _, state, step = setup("gpt_tied", 2, comm)
    state, _ = run_steps("gpt_tied", step, state, comm, 0, 2)
    save(d, state, tag="g", client_state={"rank_count": comm.world_size})
    h = save(d, state, tag="g_async", blocking=False, client_state={"rank_count": comm.world_size})
    h.wait()
    return {"params": full_buffers([state], "params"), "exp_avg": state.opt_state.exp_avg}


@pytest.mark.multiprocess
def test_spawned_gloo_two_ranks_save_one_rank_loads(tmp_path):
    d = str(tmp_path / "ck")
    out = run_world(_spawned_save, 2, d, timeout=120)
    for tag in ("g", "g_async"):
        _, _, like, _ = setup("gpt_tied", 0, fnzero.LocalCollectives())
        state, cs = load(d, like=like, tag=tag)
        assert cs == {"rank_count": 2}
        got = full_buffers([state], "params")
        for name, t in out[0]["params"].items():  # stage 2: every rank holds the full params
            assert torch.equal(got[name], t)
        for u in state.sharding.plan.units:  # rank r's moments are elements [r*shard, (r+1)*shard)
            cat = torch.cat([out[r]["exp_avg"][u.name] for r in range(2)])[: u.numel]
            assert torch.equal(state.opt_state.exp_avg[u.name][: u.numel], cat)
