"""AutoEP: find a Hugging Face MoE model's experts modules by preset and replace each by an
`HFExpertGroup` (`specs/mesh.md §Expert parallelism`), in DeepSpeed 0.19.8's vocabulary.

A preset names, as DeepSpeed's `MoEModelPreset` does, the MoE blocks (`moe_layer_pattern`, a
regex that must match a module's whole dotted path), and two direct children of each block: its
router (`router_pattern`) and its experts (`expert_pattern`). A matched block without the experts
child is a dense layer (DeepSeek's first `first_k_dense_replace` layers) and is skipped, as is one
without the router child. Only the experts module is replaced: the router, the shared experts
and the router's aux loss stay the model's own, so the routing is the model's whatever the
config's routing keys say (`top_k`, `score_func`, `route_norm`, ...: `AUTOEP_KEYS_NO_EFFECT`).

Presets: DeepSpeed's `mixtral`, `qwen3_moe`, `qwen3_5_moe`, `deepseek_v2` and `deepseek_v3`, with
its model types (its `qwen3_moe` serves `qwen2_moe` models too, and `qwen3_5_moe` the text
backbone `qwen3_5_moe_text` only); fnzero's own `qwen2_moe` and `olmoe` (DeepSpeed 0.19.8 has no
preset of these names, and none for OLMoE at all). DeepSpeed's `minimax_m3` is not offered: its
experts compute a clamped SwiGLU (`_apply_gate` of their own), which `HFExpertGroup` refuses, and
transformers 5.24 has no `minimax_m3_vl_text` experts of the fused layout AutoEP reads without it.
"""

from __future__ import annotations

import dataclasses
import re
import warnings
from dataclasses import dataclass

from torch import nn

from ..._errors import ConfigError
from ...config._noop import ConfigWarning
from ._hf_experts import HFExpertGroup

__all__ = ["AutoEPPreset", "AUTOEP_PRESETS", "AUTOEP_KEYS_READ", "AUTOEP_KEYS_NO_EFFECT", "autoep_replace",
           "resolve_autoep_preset"]


@dataclass(frozen=True)
class AutoEPPreset:
    """Where a model family keeps its MoE blocks, and (informational) how its own router routes."""

    moe_layer_pattern: str  # regex, matched against a module's whole name (re.fullmatch)
    router_pattern: str  # the block's child holding the router (attribute name)
    expert_pattern: str  # the block's child holding the experts (attribute name): replaced
    hf_model_types: tuple[str, ...] = ()  # model.config.model_type values that pick this preset
    score_func: str = "softmax"  # what the model's router does: recorded, never applied
    route_norm: bool = True
    shared_experts_pattern: str = ""  # kept as the model's: recorded for the table only
    origin: str = "deepspeed"  # "deepspeed": DeepSpeed 0.19.8 has this preset; "fnzero": fnzero's own


_LAYERS = r"model\.layers\.\d+\.mlp"

AUTOEP_PRESETS: dict[str, AutoEPPreset] = {
    "mixtral": AutoEPPreset(_LAYERS, "gate", "experts", ("mixtral",)),
    "qwen3_moe": AutoEPPreset(_LAYERS, "gate", "experts", ("qwen3_moe",), shared_experts_pattern="shared_expert"),
    "qwen3_5_moe": AutoEPPreset(_LAYERS, "gate", "experts", ("qwen3_5_moe_text",),
                                shared_experts_pattern="shared_expert"),
    "deepseek_v2": AutoEPPreset(_LAYERS, "gate", "experts", ("deepseek_v2",), route_norm=False,
                                shared_experts_pattern="shared_experts"),
    "deepseek_v3": AutoEPPreset(_LAYERS, "gate", "experts", ("deepseek_v3",), score_func="sigmoid",
                                route_norm=False, shared_experts_pattern="shared_experts"),
    "qwen2_moe": AutoEPPreset(_LAYERS, "gate", "experts", ("qwen2_moe",), shared_experts_pattern="shared_expert",
                              origin="fnzero"),
    "olmoe": AutoEPPreset(_LAYERS, "gate", "experts", ("olmoe",), route_norm=False, origin="fnzero"),
}

# Model types DeepSpeed refuses with a note rather than a preset (the composite vision-language model).
_MODEL_TYPE_NOTES = {
    "qwen3_5_moe": "AutoEP replaces the Qwen3.5-MoE text backbone: pass the text model (Qwen3_5MoeForCausalLM, "
                   "model_type 'qwen3_5_moe_text'), or give moe_layer_pattern for the composite model",
}
_NOT_OFFERED = {
    "minimax_m3": "DeepSpeed's minimax_m3 preset is not offered: its experts use a clamped SwiGLU of their own",
}

# The `expert_parallel` keys autoep_replace reads (`enabled` and `autoep_size` are the mesh's), and
# those with no effect on it: the model's own routing, shared experts, expert count and expert
# computation are kept (the count is read from the experts' tensors and checked against the
# router's), and there is one dispatch implementation. A config should warn on the latter when set.
AUTOEP_KEYS_READ = ("preset_model", "moe_layer_pattern", "expert_pattern", "router_pattern")
AUTOEP_KEYS_NO_EFFECT = (
    "top_k", "top_k_attr", "num_experts_attr", "score_func", "score_apply", "route_norm", "route_scale",
    "routed_scaling_factor", "num_expert_groups", "num_limited_groups", "load_balance_coeff",
    "has_shared_experts", "shared_experts_pattern", "shared_experts_gate_pattern",
    "expert_activation", "expert_w1", "expert_w2", "expert_w3",
    "use_grouped_mm", "disable_triton_grouped_mm", "combine_impl", "row_weighting_impl", "gate_up_impl",
    "comm_backend", "comm_num_sm", "comm_qp_margin", "comm_max_tokens_per_rank", "async_split_plan",
    "validate_folding_routing")


def _known() -> str:
    types = sorted({t for p in AUTOEP_PRESETS.values() for t in p.hf_model_types})
    return f"known presets: {sorted(AUTOEP_PRESETS)}; model types: {types}"


def _child_name(key: str, value: str | None) -> None:
    if value is not None and (not isinstance(value, str) or not value or "." in value):
        raise ConfigError(f"expert_parallel.{key}={value!r}: must be the name of a direct child of the MoE block "
                          f"(an attribute name, no dots)")


def resolve_autoep_preset(model: nn.Module, preset_model: str | None = None, moe_layer_pattern: str | None = None,
                          expert_pattern: str | None = None, router_pattern: str | None = None) -> AutoEPPreset:
    """The preset AutoEP uses, as DeepSpeed picks it: `preset_model` when given, else the one for
    `model.config.model_type`, else a custom preset from `moe_layer_pattern` (router `gate`, experts
    `experts` unless given); the patterns given override the preset's."""
    _child_name("expert_pattern", expert_pattern)
    _child_name("router_pattern", router_pattern)
    # A pipeline stage cut from a model names it `plan_source` (`sharding/pp/_module.py`).
    source = model if hasattr(model, "config") else getattr(model, "plan_source", model)
    model_type = getattr(getattr(source, "config", None), "model_type", None)
    if preset_model is not None:
        if preset_model not in AUTOEP_PRESETS:
            why = _NOT_OFFERED.get(preset_model, f"unknown preset_model {preset_model!r}")
            raise ConfigError(f"expert_parallel.preset_model: {why}; {_known()}")
        preset = AUTOEP_PRESETS[preset_model]
    else:
        preset = next((p for p in AUTOEP_PRESETS.values() if model_type in p.hf_model_types), None)
    if preset is None and moe_layer_pattern is None and model_type not in _MODEL_TYPE_NOTES:
        preset = _common_layout(model, model_type)
    if preset is None:
        if moe_layer_pattern is None:
            note = _MODEL_TYPE_NOTES.get(model_type, "give expert_parallel.preset_model or moe_layer_pattern")
            raise ConfigError(f"expert_parallel: model_type {model_type!r} has no AutoEP preset ({note}); {_known()}")
        preset = AutoEPPreset(moe_layer_pattern, "gate", "experts", origin="custom")
    overrides = {k: v for k, v in (("moe_layer_pattern", moe_layer_pattern), ("expert_pattern", expert_pattern),
                                   ("router_pattern", router_pattern)) if v is not None}
    return dataclasses.replace(preset, **overrides)


def _common_layout(model: nn.Module, model_type: str | None) -> AutoEPPreset | None:
    """For a model type no preset names: the layout every preset shares (`model.layers.N.mlp` with a
    `gate` router and an `experts` child), when the model has it, with a ConfigWarning saying so;
    DeepSpeed likewise tries its presets in turn when none names the model. None when it does not."""
    common = AutoEPPreset(_LAYERS, "gate", "experts", origin="common")
    found = _matched_experts(model, common)
    if not found:
        return None
    warnings.warn(f"expert_parallel: model_type {model_type!r} has no AutoEP preset; its {len(found)} MoE block(s) "
                  f"were found by the layout the presets share ({_LAYERS} with 'gate' and 'experts' children). Give "
                  "expert_parallel.preset_model or moe_layer_pattern to choose", ConfigWarning, stacklevel=4)
    return common


def _matched_experts(model: nn.Module, preset: AutoEPPreset) -> list[tuple[nn.Module, str]]:
    """(block, path) of every block the preset matches that has its experts and router children."""
    try:
        pattern = re.compile(preset.moe_layer_pattern)
    except re.error as e:
        raise ConfigError(f"expert_parallel.moe_layer_pattern {preset.moe_layer_pattern!r} is not a regex: "
                          f"{e}") from None
    found = []
    for name, block in model.named_modules():
        if not pattern.fullmatch(name):
            continue
        experts = getattr(block, preset.expert_pattern, None)
        router = getattr(block, preset.router_pattern, None)
        if not isinstance(experts, nn.Module) or not isinstance(router, nn.Module):
            continue  # a dense layer, or no router: not an MoE block (DeepSpeed skips these too)
        found.append((block, name))
    return found


def autoep_replace(model: nn.Module, preset_model: str | None = None, moe_layer_pattern: str | None = None,
                   expert_pattern: str | None = None, router_pattern: str | None = None) -> list[str]:
    """Replace, in place, every experts module the AutoEP preset finds by an `HFExpertGroup`
    holding the same parameters; returns their paths (e.g. `model.layers.0.mlp.experts`).

    The preset is picked by `resolve_autoep_preset`. ConfigError when no preset applies, when the
    pattern matches no MoE block, when an experts module is not transformers 5's fused layout,
    when its router's expert count differs from its experts', or when it is replaced already.

    >>> from transformers import MixtralConfig, MixtralForCausalLM
    >>> cfg = MixtralConfig(hidden_size=16, intermediate_size=8, num_hidden_layers=1, num_attention_heads=2,
    ...                     num_key_value_heads=1, num_local_experts=4, vocab_size=32)
    >>> autoep_replace(MixtralForCausalLM(cfg))
    ['model.layers.0.mlp.experts']
    """
    preset = resolve_autoep_preset(model, preset_model, moe_layer_pattern, expert_pattern, router_pattern)
    found = _matched_experts(model, preset)
    if not found:
        raise ConfigError(f"expert_parallel: moe_layer_pattern {preset.moe_layer_pattern!r} matches no MoE block with "
                          f"a {preset.expert_pattern!r} (experts) and a {preset.router_pattern!r} (router) child")
    replacements = []  # every block checked before any is replaced: an error leaves the model as it was
    for block, name in found:
        path = f"{name}.{preset.expert_pattern}"
        experts = getattr(block, preset.expert_pattern)
        if isinstance(experts, HFExpertGroup):
            raise ConfigError(f"{path}: its experts were replaced for expert parallelism already")
        group = HFExpertGroup.replacing(experts, path)
        router_weight = getattr(getattr(block, preset.router_pattern), "weight", None)
        if router_weight is not None and router_weight.dim() == 2 and router_weight.shape[0] != group.num_experts:
            raise ConfigError(f"{path}: the router {name}.{preset.router_pattern} scores {router_weight.shape[0]} "
                              f"experts, the experts module holds {group.num_experts}")
        replacements.append((block, group, path))
    for block, group, _ in replacements:
        setattr(block, preset.expert_pattern, group)
    return [path for _, _, path in replacements]
