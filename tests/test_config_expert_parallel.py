"""`expert_parallel`, DeepSpeed 0.19.8's AutoEP block (specs/config.md §Expert parallel): its keys and
defaults, each check, the keys that warn, `size`, and autoep_size against the data-parallel world.

What DeepSpeed says is pinned as literals, recorded by running its parser (runtime/config.py
get_expert_parallel_config -> module_inject/auto_ep_config.py parse_autoep_config) and its check
(validate_autoep_config, which the engine calls for an enabled block) on each block below; the
defaults themselves are rows of tests/test_config_defaults.py. DeepSpeed is not imported here.
"""

from __future__ import annotations

import warnings

import pytest

from fnzero._errors import ConfigError
from fnzero.config import ConfigWarning, ExpertParallelConfig, load_config

BASE = {"train_micro_batch_size_per_gpu": 1}
ON = {"enabled": True, "autoep_size": 2}

# The fields of DeepSpeed 0.19.8's AutoEPConfig (module_inject/auto_ep_presets/base.py), less its private
# _load_balance_coeff_explicit: every one is a key parse_autoep_config reads.
DEEPSPEED_KEYS = (
    "enabled", "autoep_size", "expert_tensor_parallel_size", "validate_folding_routing", "async_split_plan",
    "preset_model", "moe_layer_pattern", "expert_pattern", "router_pattern", "use_grouped_mm",
    "disable_triton_grouped_mm", "route_norm", "route_scale", "score_apply", "combine_impl", "row_weighting_impl",
    "gate_up_impl", "comm_backend", "comm_num_sm", "comm_qp_margin", "comm_max_tokens_per_rank", "num_expert_groups",
    "num_limited_groups", "score_func", "top_k", "load_balance_coeff", "routed_scaling_factor", "expert_w1",
    "expert_w2", "expert_w3", "num_experts_attr", "top_k_attr", "has_shared_experts", "shared_experts_pattern",
    "shared_experts_gate_pattern", "expert_activation",
)


def _load(block: dict, world_size: int | None = 4, **top):
    return load_config({**BASE, **top, "expert_parallel": block}, world_size=world_size)


def _refused(block: dict, *needles: str, world_size: int | None = 4, **top) -> list[str]:
    with pytest.raises(ConfigError) as info:
        _load(block, world_size, **top)
    errors = info.value.errors
    assert any(all(n in e for n in needles) for e in errors), errors
    return errors


# specs/config.md §Expert parallel: keys and defaults
def test_the_keys_are_deepspeeds_and_an_enabled_block_keeps_the_defaults():
    assert tuple(ExpertParallelConfig.model_fields) == DEEPSPEED_KEYS
    defaults = load_config(BASE).to_dict()["expert_parallel"]
    on = _load({"enabled": True}).to_dict()["expert_parallel"]
    # parse_autoep_config({"enabled": True}) gives the same defaults as the absent block
    assert on == {**defaults, "enabled": True} and "expert_w3" not in on
    for off in (None, False, {}, {"enabled": False}):  # parse_autoep_config: `if not param_dict:` the defaults
        assert load_config({**BASE, "expert_parallel": off}).to_dict()["expert_parallel"] == defaults


def test_expert_w3_absent_null_and_named_are_three_meanings_that_survive_to_json():
    # parse_autoep_config: absent -> _UNSET (the preset's name), null -> None (gate and up fused), a name.
    with warnings.catch_warnings():  # a named expert_w3 warns that it has no effect (tested below)
        warnings.simplefilter("ignore", ConfigWarning)
        absent, null, named = (_load({**ON, **extra}) for extra in ({}, {"expert_w3": None}, {"expert_w3": "up_proj"}))
    assert (absent.expert_parallel.expert_w3_given, null.expert_parallel.expert_w3_given) == (False, True)
    assert null.expert_parallel.expert_w3 is None and named.expert_parallel.expert_w3 == "up_proj"
    assert absent != null
    for cfg in (absent, null, named):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ConfigWarning)
            assert load_config(cfg.to_json(), world_size=4) == cfg


def test_size_is_autoep_size_when_enabled_else_1():
    assert load_config(BASE).expert_parallel.size == 1
    assert _load({"autoep_size": 4}).expert_parallel.size == 1  # DeepSpeed: the block has no effect when off
    assert _load({"enabled": True}).expert_parallel.size == 1
    assert _load({"enabled": True, "autoep_size": 4}).expert_parallel.size == 4
    assert _load({"enabled": True, "autoep_size": 2.0}).expert_parallel.size == 2  # JSON's integral float


# specs/config.md §Expert parallel: checks, each one problem naming the key and the value.
# DeepSpeed 0.19.8's ValueError for each (validate_autoep_config on the enabled block) in the comment.
@pytest.mark.parametrize("extra,needles", [
    # "score_func must be one of ('auto', 'softmax', 'sigmoid'), got 'tanh'"
    ({"score_func": "tanh"}, ("`expert_parallel.score_func`", "'softmax'", '"tanh"')),
    ({"score_apply": "mid"}, ("`expert_parallel.score_apply`", "'post'", '"mid"')),
    ({"combine_impl": "x"}, ("`expert_parallel.combine_impl`", "'legacy_bmm'", '"x"')),
    ({"row_weighting_impl": "x"}, ("`expert_parallel.row_weighting_impl`", "'eager'", '"x"')),
    ({"gate_up_impl": "x"}, ("`expert_parallel.gate_up_impl`", "'separate'", '"x"')),
    ({"comm_backend": "nccl"}, ("`expert_parallel.comm_backend`", "'deepep'", '"nccl"')),
    # "expert_activation must be one of ('swiglu', 'geglu_tanh', 'swiglu_clamped', 'swiglu_oai'), got 'relu'"
    ({"expert_activation": "relu"}, ("`expert_parallel.expert_activation`", "'swiglu_oai'", '"relu"')),
    ({"comm_num_sm": 0}, ("`expert_parallel.comm_num_sm`", ">= 1", "got 0")),  # "must be a positive integer"
    ({"comm_qp_margin": -1}, ("`expert_parallel.comm_qp_margin`", ">= 0", "got -1")),
    ({"comm_max_tokens_per_rank": -1}, ("`expert_parallel.comm_max_tokens_per_rank`", ">= 0", "got -1")),
    ({"num_expert_groups": 0}, ("`expert_parallel.num_expert_groups`", ">= 1", "got 0")),
    ({"num_limited_groups": 0}, ("`expert_parallel.num_limited_groups`", ">= 1", "got 0")),
    ({"autoep_size": 0}, ("`expert_parallel.autoep_size`", ">= 1", "got 0")),
    ({"expert_tensor_parallel_size": 0}, ("`expert_parallel.expert_tensor_parallel_size`", ">= 1", "got 0")),
    # "routed_scaling_factor must be a number or 'auto'"
    ({"routed_scaling_factor": "x"}, ("`expert_parallel.routed_scaling_factor`", '"auto" or a number', '"x"')),
    ({"top_k": 0}, ("`expert_parallel.top_k`", '"auto" or an integer >= 1', "got 0")),  # DeepSpeed: accepted
    ({"route_scale": "x"}, ("`expert_parallel.route_scale` must be a number", '"x"')),  # DeepSpeed: accepted
    ({"expert_w1": "a.b"}, ("`expert_parallel.expert_w1`", "no dots", '"a.b"')),  # "must be a direct attribute name"
    ({"expert_w1": ""}, ("`expert_parallel.expert_w1`", "non-empty", '""')),  # "must be a non-empty string"
    ({"router_pattern": "mlp.gate"}, ("`expert_parallel.router_pattern`", "no dots", '"mlp.gate"')),
    ({"shared_experts_pattern": "a.b"}, ("`expert_parallel.shared_experts_pattern`", "no dots")),
    ({"has_shared_experts": "yes"}, ("`expert_parallel.has_shared_experts`", "true or false", '"yes"')),
    ({"validate_folding_routing": "yes"}, ("`expert_parallel.validate_folding_routing`", "true or false")),
    ({"async_split_plan": 1}, ("`expert_parallel.async_split_plan`", "true or false", "got 1")),
    ({"preset_model": 3}, ("`expert_parallel.preset_model`", "must be a string", "got 3")),
    # DeepSpeed compiles it only when it looks for the layers (auto_ep.py ep_parser): fnzero at load
    ({"moe_layer_pattern": "model.layers.(\\d+"}, ("`expert_parallel.moe_layer_pattern`",
                                                 "not a valid regular expression", '"model.layers.(\\d+"')),
    # parse_autoep_config: "load_balance_coeff=0.01 is not supported in this AutoEP build", enabled or not
    ({"load_balance_coeff": 0.01}, ("`expert_parallel.load_balance_coeff` is 0.01", "not supported")),
])
def test_each_value_deepspeed_refuses_is_one_problem_naming_key_and_value(extra, needles):
    errors = _refused({**ON, **extra}, *needles)
    assert len(errors) == 1, errors


def test_values_are_checked_in_a_disabled_block_too_but_its_rules_are_not():
    # DeepSpeed 0.19.8 checks a disabled block's load_balance_coeff only; fnzero checks every value (a typo
    # stays one when the block is turned on), not the rules between keys, which the block being off voids.
    _refused({"score_func": "tanh"}, "`expert_parallel.score_func`")
    _refused({"load_balance_coeff": 0.5}, "`expert_parallel.load_balance_coeff`")
    cfg = _load({"autoep_size": 3, "expert_tensor_parallel_size": 2, "gate_up_impl": "fused", "use_grouped_mm": False})
    assert cfg.expert_parallel.size == 1


@pytest.mark.parametrize("extra,needles,top", [
    # "expert_parallel.expert_tensor_parallel_size=2 is reserved for expert-internal tensor parallelism and is
    # not supported yet" (validate_folding_global)
    ({"expert_tensor_parallel_size": 2}, ("`expert_parallel.expert_tensor_parallel_size` is 2", "not built"), {}),
    # "num_limited_groups (4) must be <= num_expert_groups (2)"
    ({"num_expert_groups": 2, "num_limited_groups": 4},
     ("`expert_parallel.num_limited_groups` 4", "`expert_parallel.num_expert_groups` 2"), {}),
    # 'gate_up_impl="fused" runs the gate and up projections as one torch._grouped_mm, but use_grouped_mm=false ...'
    ({"gate_up_impl": "fused", "use_grouped_mm": False}, ('`expert_parallel.gate_up_impl` is "fused"', "use_grouped_mm"),
     {}),
    # 'row_weighting_impl="fused" only runs inside the DeepEP route, but comm_backend="comm" was selected'
    ({"row_weighting_impl": "fused"}, ('`expert_parallel.row_weighting_impl` is "fused"', '"comm"'), {}),
    # 'row_weighting_impl="fused" only runs when DeepEP dispatch is active (autoep_size > 1), but autoep_size=1'
    ({"autoep_size": 1, "row_weighting_impl": "fused", "comm_backend": "deepep", "comm_max_tokens_per_rank": 8},
     ('`expert_parallel.row_weighting_impl` is "fused"', "`expert_parallel.autoep_size` 1"), {}),
    # "comm_max_tokens_per_rank must be a positive integer when comm_backend='deepep'"
    ({"comm_backend": "deepep"}, ("`expert_parallel.comm_max_tokens_per_rank` is 0", '"deepep"'), {}),
    # 'combine_impl="fused_weighted_sum" cannot be used with comm_backend="deepep"'
    ({"combine_impl": "fused_weighted_sum", "comm_backend": "deepep", "comm_max_tokens_per_rank": 8},
     ('`expert_parallel.combine_impl` is "fused_weighted_sum"', '"deepep"'), {}),
    # 'combine_impl="fused_weighted_sum" does not support folded tensor parallelism (tensor_parallel.autotp_size=2)'
    ({"combine_impl": "fused_weighted_sum"}, ('`expert_parallel.combine_impl` is "fused_weighted_sum"',
                                              "`tensor_parallel.autotp_size` 2"), {"tensor_parallel": {"autotp_size": 2}}),
    # "expert_parallel.async_split_plan does not support AutoEP+AutoTP folding yet"
    ({"async_split_plan": True}, ("`expert_parallel.async_split_plan` is true", "`tensor_parallel.autotp_size` 2"),
     {"tensor_parallel": {"autotp_size": 2}}),
    # "tensor_parallel.preset_model and expert_parallel.preset_model must match when both are set"
    ({"preset_model": "mixtral"}, ("`tensor_parallel.preset_model` \"deepseek_v2\"", '`expert_parallel.preset_model` '
                                   '"mixtral"'), {"tensor_parallel": {"preset_model": "deepseek_v2"}}),
])
def test_each_rule_between_keys_of_an_enabled_block_is_one_problem(extra, needles, top):
    world = 8 if top else 4
    errors = _refused({**ON, **extra}, *needles, world_size=world, **top)
    assert len(errors) == 1, errors


def test_preset_model_and_patterns_are_kept_as_given():
    # DeepSpeed refuses a preset it lacks ("Unknown preset_model 'olmoe'"); fnzero's sharding checks presets.
    cfg = _load({**ON, "preset_model": "olmoe", "moe_layer_pattern": r"model\.layers\.\d+\.mlp",
                 "router_pattern": "gate", "expert_pattern": "experts"})
    ep = cfg.expert_parallel
    assert (ep.preset_model, ep.moe_layer_pattern, ep.router_pattern) == ("olmoe", r"model\.layers\.\d+\.mlp", "gate")
    assert ep.expert_pattern == "experts"


# specs/config.md §Expert parallel: autoep_size against the world
def test_autoep_size_must_divide_the_data_parallel_world():
    _refused({**ON, "autoep_size": 3}, "`expert_parallel.autoep_size` 3", "data-parallel world size 4")
    # 8 ranks, tensor-parallel 2: 4 data-parallel ranks, which 4 divides and 8 does not
    assert _load({**ON, "autoep_size": 4}, 8, tensor_parallel={"autotp_size": 2}).expert_parallel.size == 4
    _refused({**ON, "autoep_size": 8}, "`expert_parallel.autoep_size` 8", "data-parallel world size 4", world_size=8,
             tensor_parallel={"autotp_size": 2})
    assert _load({**ON, "autoep_size": 3}, None).expert_parallel.size == 3  # no world given: nothing to divide
    assert _load({"autoep_size": 3}).expert_parallel.size == 1  # off: no effect


# specs/config.md §Expert parallel: keys without effect warn (legend W)
def _warnings(block: dict) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _load(block)
    return [str(w.message) for w in caught if issubclass(w.category, ConfigWarning)]


@pytest.mark.parametrize("key,value,why", [
    ("top_k", 2, "the model's own router is used, unchanged"),
    ("expert_w1", "w1", "splits the experts module's own stacked tensors"),
    ("num_experts_attr", "n_experts", "counts experts from them"),
    ("has_shared_experts", True, "shared experts stay the model's own dense modules"),
    ("shared_experts_pattern", "shared", "shared experts stay the model's own dense modules"),
    ("score_func", "sigmoid", "the model's own router is used, unchanged"),
    ("score_apply", "pre", "the model's own router is used, unchanged"),
    ("route_norm", False, "the model's own router is used, unchanged"),
    ("route_scale", 2.5, "the model's own router is used, unchanged"),
    ("routed_scaling_factor", 2.5, "the model's own router is used, unchanged"),
    ("num_expert_groups", 4, "the model's own router is used, unchanged"),
    ("top_k_attr", "k", "the model's own router is used, unchanged"),
    ("use_grouped_mm", False, "the model's own expert modules compute"),
    ("expert_activation", "geglu_tanh", "the model's own expert modules compute"),
    ("comm_num_sm", 24, "its own all-to-all"),
    ("validate_folding_routing", True, "folded routing"),
])
def test_a_key_without_effect_warns_once_naming_it_and_why(key, value, why):
    got = _warnings({**ON, key: value})
    assert len(got) == 1, got
    assert f"`expert_parallel.{key}`" in got[0] and "no effect in fnzero" in got[0] and why in got[0]


def test_defaults_written_out_and_a_disabled_block_do_not_warn():
    explicit = {"top_k": "auto", "score_func": "auto", "route_scale": 1, "use_grouped_mm": True, "comm_num_sm": 12,
                "comm_backend": "comm", "routed_scaling_factor": "auto", "route_norm": None}
    assert _warnings({**ON, **explicit}) == []
    assert _warnings({"top_k": 2, "score_func": "sigmoid", "comm_num_sm": 24}) == []


def test_an_explicit_auto_is_deepspeeds_value_not_a_placeholder():
    block = {**ON, "top_k": "auto", "score_func": "auto", "combine_impl": "auto", "routed_scaling_factor": "auto"}
    assert _load(block).expert_parallel.top_k == "auto"
    _refused({**ON, "autoep_size": "auto"}, '`expert_parallel.autoep_size` is "auto"')  # a placeholder there


def test_unknown_key_is_refused_saying_deepspeed_ignores_it():
    # parse_autoep_config reads its keys with dict.get: DeepSpeed ignores one it does not know.
    _refused({**ON, "top_kk": 2}, "`expert_parallel.top_kk`", "did you mean `top_k`", "DeepSpeed ignores")
