"""`fnzero.init_inference`: DeepSpeed-Inference's interface on fnzero (`specs/inference.md`).

Keys, aliases, defaults and the config-vs-kwargs merge are DeepSpeed 0.19.8's; the options that
mean something here (dtype, int8, tensor_parallel, checkpoint, zero, max_out_tokens) are judged
against the plain model in float64; the kernel keys warn.
"""

from __future__ import annotations

import json
import warnings

import pytest
import torch
import transformers

import fnzero
from fnzero.config import ConfigWarning
from fnzero.inference._int8 import quantize_weight
from fnzero.testing import MLP, simulated_world

import _worlds as W

transformers.logging.set_verbosity_error()

LLAMA = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16)
IDS = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(0))
F64 = {"dtype": torch.float64}


def _llama(meta: bool = False) -> transformers.LlamaForCausalLM:
    if meta:
        with torch.device("meta"):
            return transformers.LlamaForCausalLM(LLAMA)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(LLAMA).double()


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    """(a save_pretrained directory of a float64 Llama, that model's logits on IDS)."""
    model = _llama().eval()
    d = tmp_path_factory.mktemp("llama")
    model.save_pretrained(d)
    with torch.no_grad():
        return d, model(input_ids=IDS).logits


def _linear_engine(config=None, **kwargs):
    torch.manual_seed(0)
    return fnzero.init_inference(torch.nn.Linear(3, 2), config, **kwargs)


# §Keys: merge, precedence, aliases, defaults -------------------------------------------------------
def test_defaults_are_deepspeeds():
    engine = _linear_engine()
    cfg = engine.inference_config
    assert (cfg.dtype, cfg.max_out_tokens, cfg.tensor_parallel.tp_size, cfg.replace_with_kernel_inject) == (
        torch.float16, 1024, 1, False)
    assert all(t.dtype == torch.float16 for t in engine.params.values())  # DeepSpeed's default dtype is fp16
    assert engine(torch.ones(1, 3)).dtype == torch.float16  # inputs cast to the compute dtype


def test_config_and_kwargs_merge_and_a_conflict_is_deepspeeds_error(tmp_path):
    path = tmp_path / "ds_inference.json"
    path.write_text(json.dumps({"dtype": "fp32", "max_tokens": 64}))
    for source in (str(path), path.read_text(), {"dtype": "fp32", "max_tokens": 64}):
        cfg = _linear_engine(source, dtype="fp32", replace_method="auto").inference_config  # the same value twice: fine
        assert (cfg.dtype, cfg.max_out_tokens) == (torch.float32, 64)
    cfg = _linear_engine({"dtype": "bf16"}, max_out_tokens=7).inference_config  # kwargs join the config
    assert (cfg.dtype, cfg.max_out_tokens) == (torch.bfloat16, 7)
    with pytest.raises(fnzero.ConfigError, match=r"Conflicting argument 'dtype' in 'config':fp32 and kwargs:fp16"):
        _linear_engine({"dtype": "fp32"}, dtype="fp16")
    source = {"dtype": "fp32"}
    _linear_engine(source, max_tokens=9)
    assert source == {"dtype": "fp32"}  # the user's dict is not written into (DeepSpeed's is)


def test_aliases_dtype_names_and_deprecated_mp_size():
    cfg = _linear_engine(tp={"tp_size": 1}, max_tokens=5, min_tokens=1, dtype="float").inference_config
    assert (cfg.tensor_parallel.tp_size, cfg.max_out_tokens, cfg.dtype) == (1, 5, torch.float32)
    for name, dtype in [("fp32", torch.float32), ("float32", torch.float32), ("bf16", torch.bfloat16),
                        ("bfloat16", torch.bfloat16), ("fp16", torch.float16), ("half", torch.float16),
                        (torch.half, torch.float16), ("int8", torch.int8), ("torch.float32", torch.float32)]:
        engine = _linear_engine(dtype=name)
        assert engine.inference_config.dtype == dtype
        assert all(t.dtype == (dtype if dtype != torch.int8 else torch.float32) for t in engine.params.values())
    with pytest.warns(ConfigWarning, match="mp_size is deprecated use tensor_parallel.tp_size"):
        assert _linear_engine(mp_size=1).inference_config.tensor_parallel.tp_size == 1
    with pytest.raises(fnzero.ConfigError, match="Cannot provide deprecated parameter 'mp_size' and replacing "
                                                 "parameter 'tensor_parallel.tp_size' together"):
        _linear_engine(mp_size=1, tensor_parallel={"tp_size": 1})


def test_unknown_and_bad_keys_are_named():
    with pytest.raises(fnzero.ConfigError) as err:
        _linear_engine({"dtyp": "fp32", "tensor_parallel": {"tp_sise": 2}}, max_out_tokens=0, optimizer={})
    text = str(err.value)
    assert "`dtyp` is not a DeepSpeed-Inference key; did you mean `dtype`?" in text
    assert "`tensor_parallel.tp_sise` is not a DeepSpeed-Inference key; did you mean `tp_size`?" in text
    assert "`max_out_tokens` must be > 0, got 0" in text
    assert "`optimizer` is not a DeepSpeed-Inference key: an inference engine has no optimizer" in text
    with pytest.raises(fnzero.ConfigError) as err:  # two stray keys: the valid keys listed once for both
        _linear_engine({"tensor_parallel": {"foo_bar": 1, "qux_quux": 2}})
    assert "`tensor_parallel.foo_bar` and `tensor_parallel.qux_quux` are not DeepSpeed-Inference keys" in str(err.value)
    assert str(err.value).count("valid keys here: enabled, ") == 1, str(err.value)
    with pytest.raises(fnzero.ConfigError, match="`dtype` must be a torch dtype or one of .*got \"int4\""):
        _linear_engine(dtype="int4")
    with pytest.raises(fnzero.ConfigError, match="`tensor_parallel.tp_group` is a object: fnzero builds"):
        _linear_engine(tensor_parallel={"tp_group": object()})
    with pytest.raises(fnzero.ConfigError, match="`injection_policy` is an object: fnzero's AutoTP"):
        _linear_engine(injection_dict={torch.nn.Linear: ("x",)})


@pytest.mark.parametrize("key,value", [
    ("replace_with_kernel_inject", True), ("kernel_inject", True), ("enable_cuda_graph", True), ("use_triton", True),
    ("triangular_masking", False), ("return_tuple", False), ("keep_module_on_host", True), ("min_out_tokens", 4),
    ("moe", {"ep_size": 2}), ("quant", {"weight": {"num_bits": 4}}), ("training_mp_size", 2),
    ("save_mp_checkpoint_path", "/x"), ("tensor_parallel", {"tp_grain_size": 32}),
])
def test_kernel_and_format_keys_warn_that_they_have_no_effect(key, value):
    name = {"kernel_inject": "replace_with_kernel_inject", "tensor_parallel": "tensor_parallel.tp_grain_size",
            "moe": "moe", "quant": "quant"}.get(key, key)
    with pytest.warns(ConfigWarning, match=rf"`{name}` is .*, which has no effect in fnzero: "):
        _linear_engine(dtype="fp32", **{key: value})


def test_default_values_do_not_warn():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _linear_engine(replace_with_kernel_inject=False, enable_cuda_graph=False, triangular_masking=True, moe=False,
                       tensor_parallel={"tp_size": 1, "tp_grain_size": 64}, dtype="fp32")


# §checkpoint, §tensor_parallel, §zero --------------------------------------------------------------
def test_checkpoint_directory_and_file_fill_a_meta_model(llama_dir):
    d, want = llama_dir
    for kwargs in ({"checkpoint": str(d)}, {"checkpoint": "model.safetensors", "base_dir": str(d)}):
        engine = fnzero.init_inference(_llama(meta=True), **F64, **kwargs)
        torch.testing.assert_close(engine(input_ids=IDS).logits, want, rtol=1e-12, atol=1e-12)
    with pytest.raises(fnzero.ConfigError, match="`checkpoint` is a dict .* which fnzero does not read"):
        fnzero.init_inference(_llama(meta=True), checkpoint={"type": "ds_model", "checkpoints": []})


def test_tensor_parallel_and_zero3_equal_the_plain_model(llama_dir):
    """tp 2 splits every layer over the two ranks (half of each projection per rank); ZeRO-3 over
    two ranks holds half of each unit; both give the plain model's logits."""
    d, want = llama_dir

    def rank(kwargs):
        engine = fnzero.init_inference(_llama(meta=True), checkpoint=str(d), **F64, **kwargs)
        return engine(input_ids=IDS).logits, sum(t.numel() for t in engine.params.values())

    whole = sum(p.numel() for p in _llama().parameters())
    for kwargs, at_most in (({"tensor_parallel": {"tp_size": 2}}, 0.6), ({"zero": {"stage": 3, "stage3_param_persistence_threshold": 0}}, 0.6)):
        for logits, held in simulated_world(2).run(lambda: rank(kwargs)):
            torch.testing.assert_close(logits, want, rtol=1e-9, atol=1e-12)
            assert held < at_most * whole, (kwargs, held, whole)


def test_zero_inference_keeps_the_shards_on_nvme_and_saves_loads_and_exports_them(llama_dir, tmp_path):
    """ZeRO-Inference with `offload_param` nvme (`specs/inference.md` §ZeRO-Inference), 2 ranks: the
    state's shards are placeholders over a parameter store (no memory held; `stored` is what the
    engine without offload holds), the logits are the plain model's, and the state's whole tensors
    (`state_dict`, `export_live`, a checkpoint loaded into an engine over other weights, whose store
    it then fills) are the checkpoint's."""
    from safetensors.torch import load_file

    from fnzero.memory import model_state_bytes
    from fnzero.sharding.zero._param_store import is_placeholder

    d, want = llama_dir
    zero = {"stage": 3, "stage3_param_persistence_threshold": 0}
    nvme = {**zero, "offload_param": {"device": "nvme", "nvme_path": str(tmp_path / "nvme")}}
    plain_state = _llama().state_dict()

    def rank(comm):
        engine = fnzero.init_inference(_llama(meta=True), checkpoint=str(d), zero=nvme, **F64)
        plain = fnzero.init_inference(_llama(meta=True), checkpoint=str(d), zero=zero, **F64)
        sm, state = engine.sharded, engine.state
        sharded = [u for u in sm.plan.units if sm.plan.params_sharded(u)]
        held = bool(sharded) and all(is_placeholder(state.params[u.name]) for u in sharded)
        fnzero.checkpoint.save(tmp_path / "c", state, tag="t")
        paths = fnzero.checkpoint.export_live(sm, state, tmp_path / "export", hf_config=False)
        other = fnzero.init_inference(_llama(meta=True), zero=nvme, **F64)  # fnzero's own init: other weights
        loaded, _ = fnzero.checkpoint.load(tmp_path / "c", other.state, tag="t", restore_rng=False)
        return (engine(input_ids=IDS).logits, held, model_state_bytes(state), model_state_bytes(plain.state),
                sm.state_dict(state), paths, other(input_ids=IDS).logits, loaded.params is not None and all(
                    is_placeholder(loaded.params[u.name]) for u in sharded))

    for logits, held, m, p, whole, paths, again, still in simulated_world(2).run(rank):
        torch.testing.assert_close(logits, want, rtol=1e-9, atol=1e-12)
        assert held and still
        assert (m.params, m.frozen) == (0, 0) and m.stored == p.params + p.frozen > 0, (m, p)
        torch.testing.assert_close(again, want, rtol=1e-9, atol=1e-12)
        W.assert_close_tree({k: whole[k] for k in plain_state}, plain_state, rtol=0, atol=0, what="state_dict")
        exported = {k: v for p in paths if p.endswith(".safetensors") for k, v in load_file(p).items()}
        W.assert_close_tree({k: exported[k] for k in plain_state}, plain_state, rtol=0, atol=0, what="export_live")


def test_a_tp_size_the_heads_or_the_world_do_not_divide_names_both_numbers():
    with pytest.raises(fnzero.DistributedError, match="tensor_parallel.tp_size 3 does not divide the world size 2"):
        simulated_world(2).run(lambda: fnzero.init_inference(_llama(meta=True), tp={"tp_size": 3}))
    odd = transformers.LlamaConfig(vocab_size=32, hidden_size=24, intermediate_size=32, num_hidden_layers=1,
                                   num_attention_heads=3, num_key_value_heads=3)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(odd)
    with pytest.raises(fnzero.DistributedError, match="tensor_parallel.tp_size 2 does not divide the model's "
                                                      "num_attention_heads 3"):
        simulated_world(2).run(lambda: fnzero.init_inference(model, tensor_parallel={"tp_size": 2}))


def test_a_training_configs_zero_section_with_its_optimizer_offloaded_warns_and_keeps_the_shards_on_nvme(
        llama_dir, tmp_path):
    """DeepSpeedExamples' ds_config_nvme.json: parameters on NVMe with the optimizer on the CPU. An
    engine has no optimizer, so `offload_optimizer` warns that it has no effect (DeepSpeed's engine
    reads no `zero` key at all); the shards are placeholders over a parameter store, and the logits
    are the plain model's (`specs/inference.md` §ZeRO-Inference)."""
    from fnzero.sharding.zero._param_store import is_placeholder

    d, want = llama_dir
    zero = {"stage": 3, "stage3_param_persistence_threshold": 0, "offload_optimizer": {"device": "cpu", "pin_memory": True},
            "offload_param": {"device": "nvme", "nvme_path": str(tmp_path), "pin_memory": True, "buffer_count": 5,
                              "buffer_size": 1e8, "max_in_cpu": 1e9}}
    with pytest.warns(ConfigWarning, match=r"`zero.offload_optimizer` is .*, which has no effect in fnzero: an "
                                           "inference engine has no optimizer"):
        engine = fnzero.init_inference(_llama(meta=True), checkpoint=str(d), zero=zero, **F64)
    state = engine.state
    assert all(is_placeholder(state.params[u.name]) for u in engine.sharded.plan.units
               if engine.sharded.plan.params_sharded(u))
    torch.testing.assert_close(engine(input_ids=IDS).logits, want, rtol=1e-9, atol=1e-12)


def test_zero_sections_an_engine_cannot_use_are_refused():
    with pytest.raises(fnzero.ConfigError, match="read as a training config's zero_optimization: .*stage"):
        _linear_engine(zero={"stage": 7})


# §int8 ---------------------------------------------------------------------------------------------
def test_int8_rounds_each_weight_within_half_a_step_of_its_channel_scale():
    w = torch.randn(5, 7, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    w[2] = 0.0
    for layout, t in (("out_in", w), ("in_out", w.T)):
        q, scale = quantize_weight(t, layout)
        assert q.dtype == torch.int8 and q.abs().max() == 127 and scale.shape == ((5, 1) if layout == "out_in" else (1, 5))
        assert ((q.double() * scale - t).abs() <= scale / 2 + 1e-15).all()


@pytest.mark.parametrize("kind,bound", [("llama", 0.02), ("gpt2", 0.01)])
def test_int8_logits_stay_within_the_stated_error_and_the_state_holds_int8(kind, bound):
    """specs/inference.md §int8: max |logit error| <= bound x max |logit| (measured 0.9% and 0.4%)."""
    torch.manual_seed(0)
    if kind == "llama":
        make = lambda: transformers.LlamaForCausalLM(LLAMA)  # noqa: E731
    else:
        make = lambda: transformers.GPT2LMHeadModel(transformers.GPT2Config(  # noqa: E731
            vocab_size=128, n_positions=16, n_embd=64, n_layer=2, n_head=4))
    ref = make().double().eval()
    model = make().double()
    model.load_state_dict(ref.state_dict())
    with torch.no_grad():
        want = ref(input_ids=IDS).logits
    engine = fnzero.init_inference(model, dtype="int8")
    got = engine(input_ids=IDS).logits
    err = ((got - want).abs().max() / want.abs().max()).item()
    assert 1e-4 < err < bound, err  # quantised (not the float weights), and within the bound
    linears = {n: p for n, p in ref.named_parameters() if n.endswith("weight") and p.dim() == 2
               and "wte" not in n and "wpe" not in n and "embed" not in n and "lm_head" not in n}
    int8 = {n: t for n, t in engine.state.frozen.items() if t.dtype == torch.int8}
    assert set(int8) == set(linears) and all(int8[n].shape == linears[n].shape for n in linears)
    held = sum(t.numel() * t.element_size() for t in [*engine.params.values(), *engine.state.frozen.values()])
    float_bytes = sum(p.numel() * p.element_size() for p in ref.parameters())
    linear_bytes = sum(p.numel() for p in linears.values())
    assert held == float_bytes - 7 * linear_bytes + sum(t.numel() * 8 for n, t in engine.state.frozen.items()
                                                        if n.endswith("_scale"))


def test_int8_with_tensor_parallel_stays_within_the_bound(llama_dir):
    d, want = llama_dir
    out = simulated_world(2).run(lambda: fnzero.init_inference(_llama(meta=True), dtype=torch.int8, checkpoint=str(d),
                                                               tensor_parallel={"tp_size": 2})(input_ids=IDS).logits)
    for logits in out:
        assert (logits - want).abs().max() < 0.02 * want.abs().max()


def test_int8_on_a_training_state_is_refused():
    cfg = fnzero.load_config({"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW"}})
    sm = fnzero.shard(MLP([3, 4, 2]).double(), config=cfg)
    state = sm.init_state()
    for trained in (sm, state):
        with pytest.raises(fnzero.ConfigError, match="int8 weights cannot be trained"):
            fnzero.init_inference(trained, dtype=torch.int8)
    with pytest.raises(fnzero.ConfigError, match="dtype int8 with `zero.stage` 3"):
        _linear_engine(dtype="int8", zero={"stage": 3})
    engine = fnzero.init_inference(MLP([3, 4, 2]).double(), dtype="int8")
    step = fnzero.train_step(lambda p, b: engine.sharded.apply(p, b).sum(), cfg)
    with pytest.raises(fnzero.ShardingError, match="no optimizer state: it was made for inference"):
        step(engine.state, torch.ones(1, 3, dtype=torch.float64))


# §generate -----------------------------------------------------------------------------------------
def test_max_out_tokens_bounds_the_prompt_and_the_new_tokens():
    engine = fnzero.init_inference(_llama(), max_tokens=12, **F64)
    with pytest.raises(fnzero.ConfigError, match="Input with size 13 exceeds maximum length of 12. Please increase "
                                                 "max_tokens in the DeepSpeed Inference Config."):
        engine.generate(torch.zeros(1, 13, dtype=torch.long))
    with pytest.raises(fnzero.ConfigError, match=r"Input with size 8 and max_new_tokens 5 \(13 tokens\) exceed"):
        engine.generate(torch.zeros(1, 8, dtype=torch.long), max_new_tokens=5)
    config = transformers.GenerationConfig(max_new_tokens=5)
    with pytest.raises(fnzero.ConfigError, match="max_new_tokens 5"):
        engine.generate(torch.zeros(1, 8, dtype=torch.long), generation_config=config)


def test_generate_is_fnzero_generate_with_the_engines_parameters():
    pytest.importorskip("fnzero.inference._generate")
    engine = fnzero.init_inference(_llama(), **F64)
    ids = IDS[:1, :4]
    out = engine.generate(ids, max_new_tokens=3, do_sample=False)
    seq = ids
    for _ in range(3):  # greedy decoding, the whole sequence each step (no cache)
        seq = torch.cat([seq, engine(input_ids=seq).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(out, seq)
