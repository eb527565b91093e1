"""Pretrained weights straight into a sharded state (`specs/checkpoint-format.md` §Pretrained).

Directories written by transformers' `save_pretrained` (sharded, with its index) and by
`fnzero export` load into a model built on the meta device at any stage and world size; each rank
reads only the bytes of what it holds; a bad directory is refused before anything is read.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
import transformers
from hypothesis import given, settings
from hypothesis import strategies as st

import fnzero
import fnzero.testing as ft
from fnzero.testing import simulated_world

transformers.logging.set_verbosity_error()

LLAMA = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                 num_key_value_heads=2, vocab_size=128, tie_word_embeddings=False)
IDS = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(0))


def _cfg(stage, world, **extra):
    return fnzero.load_config({"train_micro_batch_size_per_gpu": 1, "gradient_clipping": 1.0,
                               "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
                               "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}, **extra},
                              world_size=world)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A Llama written by save_pretrained in three safetensors shards with their index."""
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(LLAMA)
    d = tmp_path_factory.mktemp("llama")
    model.save_pretrained(d, max_shard_size="40KB")
    assert len([f for f in os.listdir(d) if f.endswith(".safetensors")]) > 1
    return d, model


def _load(path, stage, world, factory=lambda: transformers.LlamaForCausalLM(LLAMA), **kw):
    def rank(comm):
        sm = fnzero.shard(factory, config=_cfg(stage, world), comm=comm)
        state = sm.init_state(pretrained=path, **kw)
        with torch.no_grad():
            logits = sm.apply(state.params, input_ids=IDS).logits
        return logits, sm.state_dict(state), sm.pretrained_report

    return simulated_world(world).run(rank)


@pytest.mark.parametrize("stage,world", [(3, 2), (0, 1), (3, 4), (2, 2)])
def test_save_pretrained_directory_loads_sharded(hf_dir, stage, world):
    d, model = hf_dir
    with torch.no_grad():
        want = model(input_ids=IDS).logits
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    results = _load(d, stage, world)
    for logits, sd, report in results:
        torch.testing.assert_close(logits, want, rtol=0, atol=0)
        assert report.missing == [] and report.unexpected == []
        for n, p in model.named_parameters():
            assert torch.equal(sd[n], p.detach()), n
    read = [r.bytes_read for _, _, r in results]
    if stage == 3:
        # Each rank reads its own shards: together exactly the model once (nothing is replicated).
        assert sum(read) == total and max(read) <= total // world + 4 * 32 * 128
    else:
        assert read == [total] * world


def test_export_round_trip_is_bit_identical_at_any_world_and_stage(tmp_path):
    """Train at stage 2 on 2 ranks, export, load at other stages and world sizes: the same bits."""
    cfg = _cfg(2, 2)
    ids = torch.randint(0, 128, (4, 8), generator=torch.Generator().manual_seed(1))

    def train(comm):
        sm = fnzero.shard(lambda: transformers.LlamaForCausalLM(LLAMA), config=cfg, comm=comm)
        state = sm.init_state()
        step = fnzero.train_step(lambda p, b: sm.apply(p, input_ids=b, labels=b).loss, cfg)
        for _ in range(2):
            state, _ = step(state, ids[comm.rank: comm.rank + 1])  # micro 1 per rank
        fnzero.checkpoint.export_live(sm, state, tmp_path / "out", max_shard_size="30KB")
        return sm.state_dict(state)

    trained = simulated_world(2).run(train)[0]
    for stage, world in ((3, 4), (0, 1), (1, 2)):
        for _, sd, report in _load(tmp_path / "out", stage, world):
            assert report.missing == []
            for n, t in trained.items():
                assert torch.equal(sd[n], t), (stage, world, n)


def test_fine_tuned_directory_reloads_with_from_pretrained(hf_dir, tmp_path):
    """save_pretrained -> fnzero (meta, stage 3) -> one step -> export -> from_pretrained (the
    export wrote config.json itself): the same logits as fnzero's gathered model."""
    d, _ = hf_dir
    cfg = _cfg(3, 2)

    def rank(comm):
        sm = fnzero.shard(lambda: transformers.LlamaForCausalLM(LLAMA), config=cfg, comm=comm)
        state = sm.init_state(pretrained=d)
        step = fnzero.train_step(lambda p, b: sm.apply(p, input_ids=b, labels=b).loss, cfg)
        state, _ = step(state, IDS[comm.rank: comm.rank + 1])
        fnzero.checkpoint.export_live(sm, state, tmp_path / "tuned", tied="first")
        with torch.no_grad():
            return sm.apply(state.params, input_ids=IDS).logits

    logits = simulated_world(2).run(rank)[0]
    reloaded = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "tuned")
    with torch.no_grad():
        torch.testing.assert_close(reloaded(input_ids=IDS).logits, logits, rtol=0, atol=0)


def test_dtypes_are_cast_to_the_training_precision(hf_dir, tmp_path):
    d, model = hf_dir
    bf16 = transformers.LlamaForCausalLM(LLAMA)
    bf16.load_state_dict(model.state_dict())
    bf16.to(torch.bfloat16).save_pretrained(tmp_path)
    _, sd, _ = _load(tmp_path, 3, 2)[0]
    for n, p in model.named_parameters():
        assert sd[n].dtype == torch.float32 and torch.equal(sd[n], p.detach().to(torch.bfloat16).float()), n


def test_missing_keys_keep_their_init_and_are_listed(hf_dir, tmp_path):
    d, model = hf_dir
    from safetensors.torch import save_file

    sd = {n: t.contiguous() for n, t in model.state_dict().items() if n != "lm_head.weight"}
    save_file(sd, tmp_path / "model.safetensors")
    with pytest.warns(fnzero.PretrainedWarning, match=r"lack 1 tensor\(s\).*lm_head.weight"):
        (_, got, report), = _load(tmp_path, 3, 1)
    assert report.missing == ["lm_head.weight"]
    assert not torch.isnan(got["lm_head.weight"]).any() and float(got["lm_head.weight"].std()) > 0.01


def _rank0_error(path, factory=lambda: transformers.LlamaForCausalLM(LLAMA), **kw):
    """init_state(pretrained=path) must raise before reading, and leave init_state usable."""
    sm = fnzero.shard(factory, config=_cfg(3, 1))
    with pytest.raises(fnzero.CheckpointError) as err:
        sm.init_state(pretrained=path, **kw)
    assert sm.pretrained_report is None
    sm.init_state()  # nothing half-loaded: the model's own initial state is still there
    return str(err.value)


def test_another_architecture_is_refused_naming_tensors(hf_dir):
    d, _ = hf_dir
    wider = transformers.LlamaConfig(**{**LLAMA.to_dict(), "intermediate_size": 48})
    msg = _rank0_error(d, lambda: transformers.LlamaForCausalLM(wider))
    assert "model.layers.0.mlp.up_proj.weight: file [64, 32], model [48, 32]" in msg
    deeper = transformers.LlamaConfig(**{**LLAMA.to_dict(), "num_hidden_layers": 1})
    msg = _rank0_error(d, lambda: transformers.LlamaForCausalLM(deeper))
    assert "does not have" in msg and "model.layers.1.self_attn.q_proj.weight" in msg
    # Allowed, the extra layer is ignored and the rest loads.
    (_, got, report), = _load(d, 3, 1, lambda: transformers.LlamaForCausalLM(deeper), allow_unexpected=True)
    assert report.unexpected and all(n.startswith("model.layers.1.") for n in report.unexpected)


def test_truncated_file_is_named(hf_dir, tmp_path):
    d, _ = hf_dir
    last = sorted(x for x in os.listdir(d) if x.endswith(".safetensors"))[-1]
    for f in os.listdir(d):
        data = (d / f).read_bytes()
        (tmp_path / f).write_bytes(data[:-100] if f == last else data)
    msg = _rank0_error(tmp_path)
    assert "truncated" in msg and "model-00003-of-00003.safetensors" in msg


def test_a_broken_index_or_directory_is_named(hf_dir, tmp_path):
    d, _ = hf_dir
    for f in os.listdir(d):
        if f != "model-00002-of-00003.safetensors":
            (tmp_path / f).write_bytes((d / f).read_bytes())
    assert "model-00002-of-00003.safetensors" in _rank0_error(tmp_path)
    assert "no such file" in _rank0_error(tmp_path / "nothing")
    (tmp_path / "junk.safetensors").write_bytes(b"\xff" * 64)
    assert "not a safetensors file" in _rank0_error(tmp_path / "junk.safetensors")
    index = json.loads((d / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) == 3


@given(factory=ft.models(), stage=st.integers(0, 3), world=st.integers(1, 5), fp16_file=st.booleans())
@settings(max_examples=25, deadline=None)
def test_drawn_models_load_exactly_at_any_stage_and_world(tmp_path_factory, factory, stage, world, fp16_file):
    """Odd sizes, padding, tied and frozen parameters: every rank's shards hold exactly the file's
    values (cast), and the ranks together read the bytes once at stage 3, frozen ones included."""
    from safetensors.torch import save_file

    with ft.seeded(5):
        source = factory()
    want = {n: t.detach().to(torch.float16 if fp16_file else t.dtype) for n, t in source.state_dict().items()}
    path = tmp_path_factory.mktemp("drawn") / "model.safetensors"
    save_file({n: t.contiguous() for n, t in want.items() if n not in _aliases(source)}, path)
    cfg = _cfg(stage, world)

    def rank(comm):
        sm = fnzero.shard(factory, config=cfg, comm=comm, init_seed=9)  # a meta build: other values
        state = sm.init_state(pretrained=path)
        return sm.state_dict(state), sm.pretrained_report.bytes_read, sm.plan

    results = simulated_world(world).run(rank)
    for got, _, _ in results:
        for n, t in want.items():
            assert torch.equal(got[n], t.to(got[n].dtype)), n
    plan = results[0][2]
    if stage == 3:  # frozen parameters are sharded too (`specs/sharding.md` §Frozen parameters)
        assert not plan.frozen
        assert sum(r for _, r, _ in results) == (plan.num_params + plan.num_frozen) * (2 if fp16_file else 8)


def _aliases(model):
    """Second and later names of tied parameters (save_pretrained writes each tensor once)."""
    seen, out = set(), set()
    for n, p in model.named_parameters(remove_duplicate=False):
        if id(p) in seen:
            out.add(n)
        seen.add(id(p))
    return out


def test_base_model_weights_load_into_a_model_with_a_head_and_back(hf_dir, tmp_path):
    """As from_pretrained does with `base_model_prefix`: a LlamaModel file into LlamaForCausalLM
    (the head keeps its init, named) and a LlamaForCausalLM directory into LlamaModel."""
    d, model = hf_dir
    model.model.save_pretrained(tmp_path / "base")
    with pytest.warns(fnzero.PretrainedWarning, match=r"lack 1 tensor\(s\).*lm_head.weight"):
        (_, got, report), = _load(tmp_path / "base", 3, 1)
    for n, p in model.model.named_parameters():
        assert torch.equal(got["model." + n], p.detach()), n

    def rank(comm):
        sm = fnzero.shard(lambda: transformers.LlamaModel(LLAMA), config=_cfg(3, 2), comm=comm)
        return sm.state_dict(sm.init_state(pretrained=d, allow_unexpected=True)), sm.pretrained_report

    for got, report in simulated_world(2).run(rank):
        assert report.unexpected == ["lm_head.weight"] and report.missing == []
        for n, p in model.model.named_parameters():
            assert torch.equal(got[n], p.detach()), n


def test_torch_pickles_are_refused_with_a_way_out(tmp_path):
    torch.save({"w": torch.ones(1)}, tmp_path / "pytorch_model.bin")
    msg = _rank0_error(tmp_path)
    assert "pickles are not loaded" in msg and "safe_serialization" in msg


def test_transformers_renames_of_its_own_files_are_applied(tmp_path):
    """GPT-NeoX's head is `lm_head.weight` in the model and `embed_out.weight` in its
    save_pretrained files (transformers renames it on load); fnzero reads transformers' renames
    (`specs/checkpoint-format.md` §Pretrained), so the head is loaded, not refused as unexpected."""
    cfg = transformers.GPTNeoXConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                     intermediate_size=32, tie_word_embeddings=False)
    torch.manual_seed(0)
    saved = transformers.GPTNeoXForCausalLM(cfg).double().eval()
    saved.save_pretrained(tmp_path)
    from safetensors import safe_open

    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        assert "embed_out.weight" in f.keys()  # the file's own name for the head
    torch.manual_seed(1)
    sm = fnzero.shard(transformers.GPTNeoXForCausalLM(cfg).double().eval(), stage=3, config=fnzero.load_config(
        {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW"}}))
    state = sm.init_state(pretrained=tmp_path)
    assert "lm_head.weight" in sm.pretrained_report.loaded and not sm.pretrained_report.missing
    ids = torch.randint(0, 64, (2, 6), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(sm.apply(state.params, input_ids=ids).logits, saved(input_ids=ids).logits,
                               rtol=0, atol=0)
