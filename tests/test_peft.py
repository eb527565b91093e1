"""PEFT (LoRA) models in and out of fnzero (`specs/peft.md`).

A meta-built `get_peft_model` model reads its base model's `save_pretrained` directory through
PEFT's names and keeps PEFT's adapter init (§Initialisation, §Names); trained adapters leave as
PEFT's own directory, which `PeftModel.from_pretrained` loads to the same logits (§Export); a new
run resumes from base + adapters, and adapters of another shape or config are one error (§Resume).
"""

from __future__ import annotations

import math
import os
import warnings

import peft
import pytest
import torch
import transformers

import fnzero
from fnzero.checkpoint._peft_names import peft_names
from fnzero.testing import simulated_world

transformers.logging.set_verbosity_error()
# peft 0.21's PeftModel reads transformers' deprecated `is_gradient_checkpointing`: theirs, not ours to fix.
pytestmark = pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")

LLAMA = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                 num_key_value_heads=2, vocab_size=128, tie_word_embeddings=False)
QWEN2 = transformers.Qwen2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                 num_key_value_heads=2, vocab_size=128, tie_word_embeddings=False)
LORA = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], modules_to_save=["lm_head"])
IDS = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(0))


def _cfg(stage, world):
    return fnzero.load_config({"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
                               "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}},
                              world_size=world)


def _peft(cls=transformers.LlamaForCausalLM, hf=LLAMA, **lora):
    """A factory of the PEFT model (fnzero.shard calls it on the meta device)."""
    return lambda: peft.get_peft_model(cls(hf), peft.LoraConfig(**{**LORA, **lora})).double()


def _base_dir(tmp_path_factory, cls, hf):
    torch.manual_seed(0)
    base = cls(hf).double()
    d = tmp_path_factory.mktemp(cls.__name__)
    base.save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return _base_dir(tmp_path_factory, transformers.LlamaForCausalLM, LLAMA)


def _real(base_dir, cls=transformers.LlamaForCausalLM, adapters=None, **lora):
    base = cls.from_pretrained(base_dir, dtype=torch.float64)
    if adapters is not None:
        return peft.PeftModel.from_pretrained(base, adapters).eval()
    return peft.get_peft_model(base, peft.LoraConfig(**{**LORA, **lora})).eval()


def _logits(model_or_sm, params=None):
    with torch.no_grad():
        if params is None:
            return model_or_sm(input_ids=IDS).logits
        return model_or_sm.apply(params, input_ids=IDS).logits


def _train(sm, state, cfg, steps=3):
    def loss_fn(params, batch):  # computed here: transformers' labels= loss is float32
        logits = sm.apply(params, input_ids=batch["x"]).logits
        return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), batch["x"][:, 1:].flatten())

    step = fnzero.train_step(loss_fn, cfg)
    for _ in range(steps):
        state, _ = step(state, {"x": IDS})
    return state


@pytest.mark.parametrize("stage", [0, 3])
def test_meta_peft_model_loads_its_base_and_keeps_peft_init(llama_dir, stage):
    """§Names, §Initialisation: base weights arrive through PEFT's names (base_layer, the
    modules_to_save copy of lm_head), lora_B is zero, so the logits are a real PEFT model's."""
    want = _logits(_real(llama_dir))

    def rank(comm):
        sm = fnzero.shard(_peft(), config=_cfg(stage, 2), comm=comm)
        state = sm.init_state(pretrained=llama_dir)
        return _logits(sm, state.params), sm.gather(state), sm.pretrained_report

    for logits, full, report in simulated_world(2).run(rank):
        torch.testing.assert_close(logits, want, rtol=0, atol=1e-9)
        assert report.missing == [] and report.unexpected == []
        lora = sorted(n for n in full if ".lora_" in n)
        assert sorted(report.adapters) == lora and len(lora) == 8
        bound = 1 / math.sqrt(LLAMA.hidden_size)  # kaiming_uniform_(a=√5) on an (r, in) weight
        a = torch.cat([full[n].reshape(-1) for n in lora if "lora_A" in n])
        assert all(not full[n].any() for n in lora if "lora_B" in n)
        # Uniform on [-bound, bound], not the model's _init_weights normal(0, 0.02) (max ≈ 0.07 here).
        assert a.abs().max() <= bound and a.abs().max() > 0.9 * bound and a.std() > 0.8 * bound / math.sqrt(3)


def test_meta_init_matches_eager_peft_except_lora_A_bits():
    """§Initialisation, what differs: lora_B zeros in both; lora_A the same bound, other draws."""
    torch.manual_seed(0)
    eager = _peft()()
    sm = fnzero.shard(_peft(), config=_cfg(0, 1))
    full = sm.gather(sm.init_state())
    for n, p in eager.named_parameters():
        if "lora_B" in n:
            assert torch.equal(full[n], p.detach()), n
        elif "lora_A" in n:
            assert full[n].shape == p.shape and not torch.equal(full[n], p.detach()), n


def test_trained_adapters_export_to_peft_and_resume(llama_dir, tmp_path):
    """§Export, §Resume: train at stage 3 on 2 ranks, export_adapters, PeftModel.from_pretrained
    gives fnzero's logits; a new run (stage 1, other world) from base + adapters has the same
    adapters and logits."""
    cfg = _cfg(3, 2)

    def rank(comm):
        sm = fnzero.shard(_peft(), config=cfg, comm=comm)
        state = _train(sm, sm.init_state(pretrained=llama_dir), cfg)
        paths = fnzero.checkpoint.export_adapters(sm, state, tmp_path / "lora")
        return _logits(sm, state.params), sm.gather(state), paths

    (logits, trained, paths), (_, _, paths1) = simulated_world(2).run(rank)
    assert paths == paths1 == [str(tmp_path / "lora" / "adapter_model.safetensors"),
                               str(tmp_path / "lora" / "adapter_config.json")]
    loaded = _real(llama_dir, adapters=tmp_path / "lora")
    torch.testing.assert_close(_logits(loaded), logits, rtol=0, atol=1e-9)
    assert (logits - _logits(_real(llama_dir))).abs().max() > 1e-3  # the adapters (and lm_head copy) trained

    sm = fnzero.shard(_peft(), config=_cfg(1, 1))
    state = sm.init_state(pretrained=llama_dir, adapters=tmp_path / "lora")
    resumed = sm.gather(state)
    for n, t in trained.items():
        assert torch.equal(resumed[n], t), n
    torch.testing.assert_close(_logits(sm, state.params), logits, rtol=0, atol=1e-9)


def test_qwen2_adapters_round_trip_through_peft(tmp_path_factory, tmp_path):
    """A second architecture (biased q/k/v, other targets, no modules_to_save) at stage 2."""
    cls = transformers.Qwen2ForCausalLM
    base_dir = _base_dir(tmp_path_factory, cls, QWEN2)
    lora = dict(target_modules=["k_proj", "down_proj"], modules_to_save=None, lora_alpha=16)
    cfg = _cfg(2, 2)

    def rank(comm):
        sm = fnzero.shard(_peft(cls, QWEN2, **lora), config=cfg, comm=comm)
        state = sm.init_state(pretrained=base_dir)
        first = _logits(sm, state.params)
        state = _train(sm, state, cfg, steps=2)
        fnzero.checkpoint.export_adapters(sm, state, tmp_path)
        return first, _logits(sm, state.params)

    first, logits = simulated_world(2).run(rank)[0]
    torch.testing.assert_close(first, _logits(_real(base_dir, cls, **lora)), rtol=0, atol=1e-9)
    torch.testing.assert_close(_logits(_real(base_dir, cls, adapters=tmp_path)), logits, rtol=0, atol=1e-9)


@pytest.mark.parametrize("task_type", [None, "CAUSAL_LM"])
def test_exported_adapters_are_the_files_peft_save_pretrained_writes(tmp_path, task_type):
    """§Export: the tensor names and the adapter_config.json of PeftModel.save_pretrained (its
    `auto_mapping`, the base model's class, included where the LoraConfig has no task type)."""
    import json

    from safetensors import safe_open

    torch.manual_seed(0)
    _peft(task_type=task_type)().save_pretrained(tmp_path / "peft")
    sm = fnzero.shard(_peft(task_type=task_type), config=_cfg(3, 1))
    fnzero.checkpoint.export_adapters(sm, sm.init_state(), tmp_path / "ours")
    files = {}
    for who in ("peft", "ours"):
        with safe_open(str(tmp_path / who / "adapter_model.safetensors"), "pt") as f:
            keys = set(f.keys())
        with open(tmp_path / who / "adapter_config.json") as f:
            config = json.load(f)
        config["target_modules"] = sorted(config["target_modules"])  # a set: its order is no meaning
        files[who] = keys, config
    assert files["ours"] == files["peft"]
    assert (files["ours"][1]["auto_mapping"] is not None) == (task_type is None)


def _peft_dir(tmp_path, name, base_dir=None, hf=LLAMA, **lora):
    """An adapter directory written by PEFT itself (save_pretrained)."""
    torch.manual_seed(1)
    base = transformers.LlamaForCausalLM.from_pretrained(base_dir, dtype=torch.float64) if base_dir else \
        transformers.LlamaForCausalLM(hf).double()
    peft.get_peft_model(base, peft.LoraConfig(**{**LORA, **lora})).save_pretrained(tmp_path / name)
    return tmp_path / name


def test_peft_written_adapters_resume_and_mismatches_are_one_error(llama_dir, tmp_path):
    """§Resume: PEFT's own directory loads; another r, another base, other targets, another
    lora_alpha are each one CheckpointError naming the tensors (shapes) or keys, before any read."""
    good = _peft_dir(tmp_path, "good", llama_dir)
    sm = fnzero.shard(_peft(), config=_cfg(0, 1))
    state = sm.init_state(pretrained=llama_dir, adapters=good)
    torch.testing.assert_close(_logits(sm, state.params), _logits(_real(llama_dir, adapters=good)), rtol=0, atol=1e-9)

    other_base = LLAMA.to_dict() | {"hidden_size": 48}
    cases = {
        _peft_dir(tmp_path, "r8", r=8): r"base shapes do not match.*q_proj\.lora_A\.weight: file \[8, 32\], model \[4, 32\]",
        _peft_dir(tmp_path, "base", hf=transformers.LlamaConfig(**other_base)):
            r"base shapes do not match.*lora_A\.weight: file \[4, 48\], model \[4, 32\]",
        _peft_dir(tmp_path, "targets", target_modules=["q_proj", "k_proj"]): r"other targets.*k_proj\.lora_A\.weight",
        _peft_dir(tmp_path, "alpha", lora_alpha=32): r"lora_alpha: file 32, model 8",
    }
    for path, match in cases.items():
        sm = fnzero.shard(_peft(), config=_cfg(0, 1))
        with pytest.raises(fnzero.CheckpointError, match=match):
            sm.init_state(pretrained=llama_dir, adapters=path)
        sm.init_state(pretrained=llama_dir)  # refused before reading: still usable


def test_missing_base_tensors_are_warned_without_the_adapters(llama_dir, tmp_path):
    """§Names: adapters are not 'missing'; a base tensor the file lacks is, and the warning
    counts the adapters instead of listing them."""
    from safetensors.torch import load_file, save_file

    sd = load_file(llama_dir / "model.safetensors")
    save_file({n: t for n, t in sd.items() if n != "model.norm.weight"}, tmp_path / "model.safetensors")
    sm = fnzero.shard(_peft(), config=_cfg(0, 1))
    with warnings.catch_warnings():
        warnings.simplefilter("error", fnzero.PretrainedWarning)
        sm.init_state(pretrained=llama_dir)  # adapters only: no warning
    sm = fnzero.shard(_peft(), config=_cfg(0, 1))
    with pytest.warns(fnzero.PretrainedWarning, match=r"lack 1 tensor\(s\).*model\.norm\.weight \(and 8 adapter") as w:
        sm.init_state(pretrained=tmp_path)
    assert "lora_" not in str(w[0].message)


def test_inits_that_read_base_weights_are_refused_on_meta():
    with pytest.raises(fnzero.ShardingError, match=r"adapter 'default' of .*q_proj.*init_lora_weights='pissa'"):
        fnzero.shard(_peft(init_lora_weights="pissa"), config=_cfg(0, 1))


def test_stage3_units_of_the_wrapped_embedding_and_head():
    # specs/sharding.md §Plan: through PEFT's wrapper the untied Llama's embedding and head are units
    # of their own; modules_to_save's trainable copy of the head and the frozen original are the
    # trainable and frozen units of one module, gathered together for its forward.
    plan = fnzero.shard(_peft(), config=_cfg(3, 1)).plan
    head, embed = "base_model.model.lm_head", "base_model.model.model.embed_tokens"
    assert plan.unit_names[-1] == head and embed not in plan.unit_names  # the embedding is frozen
    assert [s.name for s in plan.unit(head).slots] == [f"{head}.modules_to_save.default.weight"]
    assert [s.name for s in plan.frozen_unit(head).slots] == [f"{head}.original_module.weight"]
    assert [s.name for s in plan.frozen_unit(embed).slots] == [f"{embed}.weight"]
    assert [s.name for s in plan.frozen_unit("<root>").slots] == ["base_model.model.model.norm.weight"]
    assert plan.params_sharded(plan.unit(head)) and plan.params_sharded(plan.frozen_unit(embed))


def test_peft_names_map_to_the_base_model():
    names = {
        "base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight",
        "base_model.model.model.layers.0.self_attn.q_proj.base_layer.bias",
        "base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight",
        "base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector.default.weight",
        "base_model.model.model.layers.0.self_attn.k_proj.weight",
        "base_model.model.lm_head.original_module.weight",
        "base_model.model.lm_head.modules_to_save.default.weight",
    }
    p = peft_names(names)
    assert {n: p.base_of[n] for n in sorted(names)} == {
        "base_model.model.lm_head.modules_to_save.default.weight": "lm_head.weight",
        "base_model.model.lm_head.original_module.weight": "lm_head.weight",
        "base_model.model.model.layers.0.self_attn.k_proj.weight": "model.layers.0.self_attn.k_proj.weight",
        "base_model.model.model.layers.0.self_attn.q_proj.base_layer.bias": "model.layers.0.self_attn.q_proj.bias",
        "base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight": "model.layers.0.self_attn.q_proj.weight",
        "base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight": None,
        "base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector.default.weight": None,
    }
    assert peft_names({"model.layers.0.mlp.up_proj.weight"}) is None  # not a PEFT model: names as they are


def _gloo_rank(base_dir: str, out: str):
    from fnzero.sharding import ProcessGroupCollectives

    comm, cfg = ProcessGroupCollectives(), _cfg(3, 2)
    sm = fnzero.shard(_peft(), config=cfg, comm=comm)
    state = _train(sm, sm.init_state(pretrained=base_dir), cfg, steps=2)
    paths = fnzero.checkpoint.export_adapters(sm, state, out)
    again = fnzero.shard(_peft(), config=cfg, comm=comm)
    resumed = again.init_state(pretrained=base_dir, adapters=out)
    return paths, _logits(sm, state.params), _logits(again, resumed.params)


@pytest.mark.multiprocess
def test_gloo_ranks_export_once_and_resume(llama_dir, tmp_path):
    """§Export, §Resume on real processes: one rank writes, both return its paths; PEFT loads them
    to fnzero's logits, and a stage-3 run resumed from them on both ranks computes the same."""
    from fnzero.testing import run_world

    (p0, trained, resumed), (p1, _, resumed1) = run_world(_gloo_rank, 2, str(llama_dir), str(tmp_path / "lora"),
                                                          timeout=120)
    assert p0 == p1 and sorted(os.listdir(tmp_path / "lora")) == ["adapter_config.json", "adapter_model.safetensors"]
    for got in (_logits(_real(llama_dir, adapters=tmp_path / "lora")), resumed, resumed1):
        torch.testing.assert_close(got, trained, rtol=0, atol=1e-9)
