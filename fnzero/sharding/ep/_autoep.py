"""AutoEP: find a Hugging Face MoE model's experts modules and replace each by an `HFExpertGroup`,
by DeepSpeed 0.19.8's presets and patterns or by layout (`specs/mesh.md` §AutoEP).
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

from torch import nn

from ..._errors import ConfigError
from ._hf_experts import HFExpertGroup, looks_like_experts

__all__ = ["AutoEPPreset", "AUTOEP_PRESETS", "AUTOEP_KEYS_READ", "AUTOEP_KEYS_NO_EFFECT", "autoep_replace",
           "find_moe_blocks", "resolve_autoep_preset"]


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
    "minimax_m3": AutoEPPreset(_LAYERS, "gate", "experts", ("minimax_m3_vl_text",), score_func="sigmoid",
                               shared_experts_pattern="shared_experts"),
    "qwen2_moe": AutoEPPreset(_LAYERS, "gate", "experts", ("qwen2_moe",), shared_experts_pattern="shared_expert",
                              origin="fnzero"),
    "olmoe": AutoEPPreset(_LAYERS, "gate", "experts", ("olmoe",), route_norm=False, origin="fnzero"),
}

# Model types DeepSpeed refuses with a note rather than a preset (the composite vision-language models).
_MODEL_TYPE_NOTES = {
    "qwen3_5_moe": "AutoEP replaces the Qwen3.5-MoE text backbone: pass the text model (Qwen3_5MoeForCausalLM, "
                   "model_type 'qwen3_5_moe_text'), or give moe_layer_pattern for the composite model",
    "minimax_m3_vl": "AutoEP replaces the MiniMax-M3 text backbone: pass the text model (MiniMaxM3VLForCausalLM, "
                     "model_type 'minimax_m3_vl_text'), or give moe_layer_pattern for the composite model",
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


def _model_type(model: nn.Module) -> str | None:
    # A pipeline stage cut from a model names it `plan_source` (`sharding/pp/_module.py`).
    source = model if hasattr(model, "config") else getattr(model, "plan_source", model)
    return getattr(getattr(source, "config", None), "model_type", None)


def resolve_autoep_preset(model: nn.Module, preset_model: str | None = None, moe_layer_pattern: str | None = None,
                          expert_pattern: str | None = None, router_pattern: str | None = None
                          ) -> AutoEPPreset | None:
    """The preset AutoEP uses, as DeepSpeed picks it: `preset_model` when given, else the one for
    `model.config.model_type`, else a custom preset from `moe_layer_pattern` (router `gate`, experts
    `experts` unless given); the patterns given override the preset's. None when none of these
    applies: the blocks are then found by their layout (`find_moe_blocks`)."""
    _child_name("expert_pattern", expert_pattern)
    _child_name("router_pattern", router_pattern)
    model_type = _model_type(model)
    if preset_model is not None:
        if preset_model not in AUTOEP_PRESETS:
            raise ConfigError(f"expert_parallel.preset_model: unknown preset_model {preset_model!r}; {_known()}")
        preset = AUTOEP_PRESETS[preset_model]
    else:
        preset = next((p for p in AUTOEP_PRESETS.values() if model_type in p.hf_model_types), None)
    if preset is None:
        if moe_layer_pattern is None:
            if model_type in _MODEL_TYPE_NOTES:
                raise ConfigError(f"expert_parallel: model_type {model_type!r} has no AutoEP preset "
                                  f"({_MODEL_TYPE_NOTES[model_type]}); {_known()}")
            return None
        preset = AutoEPPreset(moe_layer_pattern, "gate", "experts", origin="custom")
    overrides = {k: v for k, v in (("moe_layer_pattern", moe_layer_pattern), ("expert_pattern", expert_pattern),
                                   ("router_pattern", router_pattern)) if v is not None}
    return dataclasses.replace(preset, **overrides)


@dataclass(frozen=True)
class _Block:
    module: nn.Module
    name: str  # the block's path ("" for the model itself)
    experts: str  # its children's names
    router: str

    def path(self, child: str) -> str:
        return f"{self.name}.{child}" if self.name else child


def _router_rows(module: nn.Module) -> list[int]:
    return [p.shape[0] for p in module.parameters() if p.dim() == 2]


def _router_of(block: nn.Module, experts_name: str, num_experts: int) -> str | None:
    """The sibling of the experts that routes to them: one holding a 2-D weight with a row per
    expert (the first such child), else one with more rows (Longcat's router also scores its
    "zero experts", which its block computes itself); None without either."""
    siblings = [(n, c) for n, c in block.named_children() if n != experts_name and not looks_like_experts(c)]
    for wanted in (lambda rows: rows == num_experts, lambda rows: rows > num_experts):
        for name, child in siblings:
            if any(wanted(rows) for rows in _router_rows(child)):
                return name
    return None


def find_moe_blocks(model: nn.Module, expert_pattern: str | None = None,
                    router_pattern: str | None = None) -> list[_Block]:
    """Every block of `model` holding stacked experts beside a router, found by layout alone, in
    module order (`expert_pattern`/`router_pattern`, when given, must name those children).
    ConfigError naming a stacked experts module no router sits beside."""
    found, alone = [], []
    for name, block in model.named_modules():
        for child_name, child in block.named_children():
            if not looks_like_experts(child) or expert_pattern not in (None, child_name):
                continue
            router = _router_of(block, child_name, child._parameters["down_proj"].shape[0])
            if router_pattern is not None:
                router = router_pattern if isinstance(getattr(block, router_pattern, None), nn.Module) else None
            if router is None:
                alone.append(f"{name}.{child_name}" if name else child_name)
            else:
                found.append(_Block(block, name, child_name, router))
    if alone:
        raise ConfigError(f"expert_parallel: {alone[:3]} hold stacked experts, but no module beside them routes to "
                          f"them (a child of the same block with a 2-D weight of a row per expert"
                          f"{', named ' + repr(router_pattern) if router_pattern else ''}); give "
                          "expert_parallel.moe_layer_pattern and router_pattern")
    return found


def _matched_experts(model: nn.Module, preset: AutoEPPreset) -> list[_Block]:
    """Every block the preset matches that has its experts and router children."""
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
        found.append(_Block(block, name, preset.expert_pattern, preset.router_pattern))
    return found


def _blocks(model: nn.Module, preset: AutoEPPreset | None, expert_pattern: str | None,
            router_pattern: str | None) -> list[_Block]:
    if preset is not None:
        found = _matched_experts(model, preset)
        if not found:
            raise ConfigError(f"expert_parallel: moe_layer_pattern {preset.moe_layer_pattern!r} matches no MoE block "
                              f"with a {preset.expert_pattern!r} (experts) and a {preset.router_pattern!r} (router) "
                              "child")
        return found
    found = find_moe_blocks(model, expert_pattern, router_pattern)
    if not found:
        raise ConfigError(f"expert_parallel: model_type {_model_type(model)!r} has no AutoEP preset, and no module of "
                          "the model holds transformers 5's stacked experts (3-D gate_up_proj or up_proj, and "
                          f"down_proj) beside a router; give expert_parallel.preset_model or moe_layer_pattern; "
                          f"{_known()}")
    return found


def autoep_replace(model: nn.Module, preset_model: str | None = None, moe_layer_pattern: str | None = None,
                   expert_pattern: str | None = None, router_pattern: str | None = None) -> list[str]:
    """Replace, in place, every experts module AutoEP finds (by preset or pattern, else by layout:
    `resolve_autoep_preset`, `find_moe_blocks`) by an `HFExpertGroup` holding the same
    parameters; returns their paths. ConfigError when no MoE block is found, or an experts module
    cannot be split (`read_experts_layout`), disagrees with its router or is replaced already.

    >>> from transformers import MixtralConfig, MixtralForCausalLM
    >>> cfg = MixtralConfig(hidden_size=16, intermediate_size=8, num_hidden_layers=1, num_attention_heads=2,
    ...                     num_key_value_heads=1, num_local_experts=4, vocab_size=32)
    >>> autoep_replace(MixtralForCausalLM(cfg))
    ['model.layers.0.mlp.experts']
    """
    preset = resolve_autoep_preset(model, preset_model, moe_layer_pattern, expert_pattern, router_pattern)
    replacements = []  # every block checked before any is replaced: an error leaves the model as it was
    for block in _blocks(model, preset, expert_pattern, router_pattern):
        path = block.path(block.experts)
        experts = getattr(block.module, block.experts)
        if isinstance(experts, HFExpertGroup):
            raise ConfigError(f"{path}: its experts were replaced for expert parallelism already")
        group = HFExpertGroup.replacing(experts, path)
        rows = _router_rows(getattr(block.module, block.router))
        if preset is not None and rows and rows[0] != group.num_experts:
            raise ConfigError(f"{path}: the router {block.path(block.router)} scores {rows[0]} experts, the experts "
                              f"module holds {group.num_experts}")
        replacements.append((block, group))
    for block, group in replacements:
        setattr(block.module, block.experts, group)
    return [block.path(block.experts) for block, _ in replacements]
