"""AutoEP finds every transformers MoE model of the stacked-experts layout by its layout alone, with
no preset, pattern or warning, and its split experts compute what the model's eager experts do
(specs/mesh.md §AutoEP).

The survey is of the installed transformers: every model whose modeling file defines an `*Experts`
class is listed here, either as one AutoEP splits (`LAYOUT`, built tiny and checked) or as one it
refuses, with the reason (`OTHER`); a transformers upgrade that adds a model fails
`test_the_survey_covers_every_moe_model_in_transformers` until it is listed.

Each model of `LAYOUT` is built tiny in float64 (its float32 routers stay float32, as the model
makes them), its experts replaced (every module named `experts`, and nothing else), and the first
MoE block split over a simulated world of 2 expert-parallel ranks: on each rank's batch, the
block's output, its input's gradient and its dense parameters' gradients are the eager block's,
and each rank's slice of the experts' gradient is the eager gradient summed over both batches.
Three models whose experts sit in a block that needs more than the hidden states (Gemma 4 and
DiffusionGemma: the decoder layer; DeepSeek-V4: hash routing by token id) are checked whole.
Training against plain torch is `tests/test_moe_hf.py`.
"""

from __future__ import annotations

import contextlib
import copy
import glob
import importlib
import os
import re

import pytest
import torch
import transformers

from fnzero._errors import ConfigError
from fnzero.sharding.ep import autoep_replace
from fnzero.testing import seeded, simulated_world

VOCAB, HIDDEN = 64, 16
# Tiny sizes under every name the configs use; each applies where the config has the field.
SMALL = dict(
    vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=8, moe_intermediate_size=8, num_hidden_layers=2,
    num_attention_heads=2, num_key_value_heads=2, head_dim=8, max_position_embeddings=64, use_cache=False,
    num_experts=4, num_local_experts=4, n_routed_experts=4, moe_num_experts=4, num_experts_per_tok=2, moe_k=2,
    moe_topk=2, top_k=2, shared_expert_intermediate_size=8, first_k_dense_replace=1, n_group=1, topk_group=1,
    kv_lora_rank=8, q_lora_rank=8, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=4, qk_head_dim=8,
    linear_num_value_heads=2, linear_num_key_heads=1, linear_key_head_dim=8, linear_value_head_dim=8,
    linear_head_dim=8, linear_num_heads=2, swa_num_attention_heads=2, swa_num_key_value_heads=2, swa_head_dim=8,
    n_groups=1, num_layers=2, mamba_num_heads=2, mamba_head_dim=8, ssm_state_size=8,
    moe_shared_expert_intermediate_size=8, vocab_size_per_layer_input=VOCAB, hidden_size_per_layer_input=4,
    unpadded_vocab_size=VOCAB, index_head_dim=8, index_n_heads=1)
_MROPE = lambda section: {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": section}  # noqa: E731
_PAD0 = {"pad_token_id": 0}  # the default pad id lies past the tiny vocabulary
_DENSE_FIRST = {"mlp_layer_types": ["dense", "sparse"]}

# Every model whose experts AutoEP splits -> what its tiny config needs beyond SMALL.
LAYOUT: dict[str, dict] = {
    "afmoe": {}, "aria": {}, "axk1": {"head_dim": 4}, "axk2": {}, "bailing_hybrid": _PAD0,
    "beam": {**_DENSE_FIRST, "n_group": 1, "topk_group": 1}, "cohere2_moe": {}, "deepseek_ocr2": _DENSE_FIRST,
    "deepseek_v2": {}, "deepseek_v3": {"head_dim": 4}, "deepseek_v32": {}, "deepseek_v4": {},
    "diffusion_gemma": {"top_k_experts": 2}, "dots1": {"n_shared_experts": 1}, "dots3_note": _PAD0,
    "ernie4_5_moe": {}, "ernie4_5_vl_moe": {"moe_intermediate_size": [8, 8], "rope_parameters": _MROPE([1, 1, 2])},
    "exaone_moe": {}, "flex_olmo": _PAD0, "flint": {"mlp_only_layers": [0]},
    "gemma4": {"enable_moe_block": True, "top_k_experts": 2}, "glm4_moe": {}, "glm4_moe_lite": {},
    "glm4v_moe": {"rope_parameters": {**_MROPE([1, 1, 0]), "partial_rotary_factor": 0.5}},
    "glm5_next": {**_PAD0, **_DENSE_FIRST, "qk_rope_head_dim": 0}, "glm_moe_dsa": {}, "gpt_oss": {},
    "granitemoe": {}, "granitemoe_swa": {}, "granitemoehybrid": {"mamba_n_heads": 4, "mamba_d_state": 8},
    "granitemoeshared": {}, "hunyuan_v1_moe": {}, "hy_v3": {}, "hy_v4": _PAD0,
    "hy_v4_vl": {**_PAD0, "rope_parameters": _MROPE([1, 1, 0])}, "inkling": {}, "inkling2": {}, "inkling2_loop": {},
    "jamba": {}, "kimi_linear": _PAD0, "kolibri1": {}, "kolibri1_1": {"head_dim": 16, "index_num_heads": 1,
                                                                      "mlp_only_layers": [0]},
    "laguna": {}, "lara_mini": {}, "lfm2_moe": {"layer_types": ["conv", "full_attention"], "num_dense_layers": 1},
    "llama4": {}, "longcat_flash": {"head_dim": 4, "zero_expert_num": 2, "ffn_hidden_size": 8,
                                    "expert_ffn_hidden_size": 8},
    "mellum": {}, "mimo_v2_flash": {"num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 12,
                                    "v_head_dim": 8},
    "minicpm5_moe": {}, "minimax": {}, "minimax_m2": {}, "minimax_m3_vl": {}, "mistral4": {}, "mistral_large4": {},
    "mixtral": {}, "nemotron_h": {}, "olmoe": {}, "openai_privacy_filter": _PAD0, "phimoe": {}, "qwen2_moe": {},
    "qwen3_5_moe": {}, "qwen3_moe": {}, "qwen3_next": {}, "qwen3_omni_moe": {}, "qwen3_vl_moe": {}, "qwen4_exp": {},
    "solar_open": {}, "step3p7": {**_DENSE_FIRST, "sliding_window": 4}, "unlimited_ocr": {},
    "zaya": {"num_experts_per_tok": 1},  # ZAYA routes to one expert only
}
_SHARED_NORM = "holds \\['post_expert_norm.weight'\\], shared by all its experts"
_NOT_STACKED = "no module of the model holds transformers 5's stacked experts"
# Models with an `*Experts` class AutoEP does not split -> the ConfigError saying why (None: not
# built here). A norm weight every expert shares lives in the experts module (Ergo, Muse Spark):
# split, each rank would train it on its own experts' rows. The rest keep experts otherwise: DBRX
# as 2-D fused weights, JetMoE as a `weight` per projection, NLLB-MoE and Switch Transformers as a
# module per expert.
OTHER: dict[str, str | None] = {"ergo": _SHARED_NORM, "muse_spark": _SHARED_NORM, "jetmoe": _NOT_STACKED,
                                "nllb_moe": _NOT_STACKED, "switch_transformers": _NOT_STACKED, "dbrx": None}
_WHOLE = {"gemma4", "diffusion_gemma", "deepseek_v4"}  # checked whole (see the docstring)
# Experts that compute in float32 inside a float64 model: the eager code of OpenAI's privacy filter
# and Inkling 2 accumulates in float32, AutoEP's in the model's dtype (as transformers' batched and
# grouped implementations).
_FLOAT32_INSIDE = {"openai_privacy_filter", "inkling2", "inkling2_loop"}
TOL = 1e-12  # float64, the same operations on the same rows; ~1e-16 measured
TOL_FLOAT32 = 1e-6  # float32 rounding of values ~1 (2^-24 ~ 6e-8), a few roundings deep


def _model_class(model_type: str) -> type:
    module = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
    names = [n for n in dir(module) if isinstance(getattr(module, n), type)]
    for suffix in ("ForCausalLM", "TextModel", "Model"):
        for name in names:
            if name.endswith(suffix) and not any(w in name for w in ("PreTrained", "Vision", "Audio")):
                return getattr(module, name)
    raise AssertionError(f"{model_type}: no causal LM or text model class")


@contextlib.contextmanager
def _default_float64():
    """Parameters built in float64 unless the model asks float32 (Inkling 2's routers)."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


def tiny_model(model_type: str, **more):
    """The model built tiny in float64, eager experts, eval mode (PhiMoE's router samples in training)."""
    cls = _model_class(model_type)
    config_cls = cls.config_class
    fields = set(config_cls().to_dict()) | set(getattr(config_cls, "attribute_map", {}))
    config = config_cls(**{**{k: v for k, v in SMALL.items() if k in fields}, **LAYOUT.get(model_type, {}), **more})
    with seeded(0), _default_float64():
        model = cls(config)
    model.set_experts_implementation("eager")
    return model.eval()


def _run(unit, whole: bool, r: int):
    """Output, input gradient (None for token ids) and parameter gradients of `unit` on rank r's batch."""
    g = torch.Generator().manual_seed(100 + r)
    unit.zero_grad(set_to_none=True)
    if whole:
        x = torch.randint(VOCAB, (2, 8), generator=g)
        out = unit(input_ids=x)
        out = out.logits if getattr(out, "logits", None) is not None else out.last_hidden_state
    else:
        x = torch.randn(2, 8, HIDDEN, generator=g, dtype=torch.float64, requires_grad=True)
        out = unit(x)
        out = out[0] if isinstance(out, tuple) else out  # gpt-oss and Llama 4 return their router's scores too
    out.pow(2).sum().backward()
    grads = {n: None if p.grad is None else p.grad.clone() for n, p in unit.named_parameters()}
    return out.detach(), None if whole else x.grad, grads


def _assert_close(got, want, tol, what):
    assert (got is None) == (want is None), what
    if want is not None:
        err, scale = (got - want).abs().max().item(), want.abs().max().item()
        assert err <= tol * max(scale, 1e-300), f"{what}: error {err:.2e} against a largest value {scale:.2e}"


@pytest.mark.parametrize("model_type", sorted(LAYOUT))
def test_every_stacked_experts_model_is_found_and_splits_as_its_eager_experts(model_type):
    reference = tiny_model(model_type)
    model = copy.deepcopy(reference)
    paths = autoep_replace(model)  # no preset, no pattern, no warning (warnings are errors here)
    assert paths and paths == [n for n, _ in reference.named_modules() if n.rsplit(".", 1)[-1] == "experts"]
    whole = model_type in _WHOLE
    where, _, experts = paths[0].rpartition(".")
    unit, reference_unit = (model, reference) if whole else (model.get_submodule(where), reference.get_submodule(where))
    split = tuple(paths) if whole else (experts,)  # paths within the unit
    want = [_run(reference_unit, whole, r) for r in range(2)]
    copies = [copy.deepcopy(unit) for _ in range(2)]

    def rank(comm):
        for path in split:
            copies[comm.rank].get_submodule(path).split_experts(comm, where=path)
        return _run(copies[comm.rank], whole, comm.rank)

    tol = TOL_FLOAT32 if model_type in _FLOAT32_INSIDE else TOL
    for r, (out, x_grad, grads) in enumerate(simulated_world(2).run(rank)):
        _assert_close(out, want[r][0], tol, f"rank {r} output")
        _assert_close(x_grad, want[r][1], tol, f"rank {r} input gradient")
        for name, g in grads.items():
            if name.rpartition(".")[0] in split:  # this rank's experts: both ranks' rows reached them
                lo = r * g.shape[0]
                _assert_close(g, sum(w[2][name] for w in want)[lo:lo + g.shape[0]], tol, f"rank {r} {name}")
            else:
                _assert_close(g, want[r][2][name], tol, f"rank {r} {name}")


@pytest.mark.parametrize("model_type", sorted(t for t, why in OTHER.items() if why))
def test_moe_models_of_other_layouts_are_refused_saying_why(model_type):
    model = tiny_model(model_type, **({"pad_token_id": 0} if model_type == "ergo" else {}))
    with pytest.raises(ConfigError, match=OTHER[model_type]):
        autoep_replace(model)


def test_the_survey_covers_every_moe_model_in_transformers():
    root = os.path.join(os.path.dirname(transformers.__file__), "models")
    with_experts = set()
    for path in glob.glob(os.path.join(root, "*", "modeling_*.py")):
        with open(path, encoding="utf-8") as f:
            if re.search(r"^class \w*Experts\(", f.read(), re.MULTILINE):
                with_experts.add(os.path.basename(os.path.dirname(path)))
    assert not set(LAYOUT) & set(OTHER)
    assert with_experts == set(LAYOUT) | set(OTHER), (sorted(with_experts - set(LAYOUT) - set(OTHER)),
                                                      sorted(set(LAYOUT) | set(OTHER) - with_experts))
