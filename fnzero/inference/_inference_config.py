"""DeepSpeed-Inference's config: `deepspeed.init_inference(model, config, **kwargs)`'s keys
(DeepSpeed 0.19.8, `deepspeed/inference/config.py`), validated with fnzero's strict types and merged
as DeepSpeed merges them (`specs/inference.md` §Merge of config and kwargs, §Keys).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Annotated, Any, Literal

import torch
from pydantic import BeforeValidator, Field
from pydantic_core import PydanticCustomError

from .._errors import ConfigError
from ..config import (
    read_source, Problems, join_path, listed, split_by_hint, validate_into, Bool, Int, Model, Str, describe,
)

__all__ = ["InferenceConfig", "TPConfig", "read_inference_config", "DTYPE_NAMES"]

# DeepSpeed's DtypeEnum spellings; float64 is fnzero's own (DeepSpeed refuses it): exact tests.
DTYPE_NAMES: dict[torch.dtype, tuple[str, ...]] = {
    torch.float16: ("torch.float16", "fp16", "float16", "half"),
    torch.float32: ("torch.float32", "fp32", "float32", "float"),
    torch.bfloat16: ("torch.bfloat16", "bf16", "bfloat16", "bfloat"),
    torch.int8: ("torch.int8", "int8"),
    torch.float64: ("torch.float64", "fp64", "float64", "double"),
}


def _as_dtype(value: Any) -> torch.dtype:
    if isinstance(value, torch.dtype) and value in DTYPE_NAMES:
        return value
    if isinstance(value, str):
        for dtype, names in DTYPE_NAMES.items():
            if value in names:
                return dtype
    names = ", ".join(n for ns in DTYPE_NAMES.values() for n in ns[1:])
    raise PydanticCustomError("fnz_dtype", "must be a torch dtype or one of {names}, got {got}",
                              {"names": names, "got": describe(value) if not isinstance(value, torch.dtype) else str(value)})


DType = Annotated[Any, BeforeValidator(_as_dtype)]
PosInt = Annotated[Int, Field(gt=0)]


class TPConfig(Model):
    """`tensor_parallel` (alias `tp`): DeepSpeed's `DeepSpeedTPConfig`."""

    enabled: Bool = True
    tp_size: Annotated[Int, Field(ge=1)] = 1
    tp_grain_size: Annotated[Int, Field(ge=1)] = 64
    mpu: Any = None
    tp_group: Any = None


class MoEConfig(Model):
    """`moe`: DeepSpeed's `DeepSpeedMoEConfig` (alias `num_experts` for `moe_experts`, `expert_group` for `ep_group`)."""

    enabled: Bool = True
    ep_size: Int = 1
    moe_experts: list[Any] = [1]
    type: Literal["residual", "standard"] = "standard"
    ep_mp_group: Any = None
    ep_group: Any = None


def _moe_flag(value: Any) -> Any:
    """DeepSpeed's `moe_backward_compat`: a boolean `moe` is a MoE section with that `enabled`."""
    return MoEConfig(enabled=value) if isinstance(value, bool) else value


class QuantBits(Model):
    enabled: Bool = True
    num_bits: Int = 8
    q_type: Literal["asymmetric", "symmetric"] = "symmetric"
    q_groups: Int = 1


class WeightQuant(QuantBits):
    quantized_initialization: dict[str, Any] = {}
    post_init_quant: dict[str, Any] = {}


class QKVQuant(Model):
    enabled: Bool = True


class QuantConfig(Model):
    """`quant`: DeepSpeed's `QuantizationConfig` (its engine reads none of it)."""

    enabled: Bool = True
    activation: QuantBits = QuantBits()
    weight: WeightQuant = WeightQuant()
    qkv: QKVQuant = QKVQuant()


class CheckpointPaths(Model):
    """`checkpoint_config` (alias `ckpt_config`): DeepSpeed's `InferenceCheckpointConfig`."""

    checkpoint_dir: Str | None = None
    save_mp_checkpoint_path: Str | None = None
    base_dir: Str | None = None


class InferenceConfig(Model):
    """DeepSpeed 0.19.8's `DeepSpeedInferenceConfig`, key for key (`specs/inference.md` §Keys)."""

    replace_with_kernel_inject: Bool = False
    dtype: DType = torch.float16
    tensor_parallel: TPConfig = TPConfig()
    enable_cuda_graph: Bool = False
    use_triton: Bool = False
    triton_autotune: Bool = False
    zero: dict[str, Any] = {}
    triangular_masking: Bool = True
    moe: Annotated[MoEConfig, BeforeValidator(_moe_flag)] = MoEConfig()
    keep_module_on_host: Bool = False
    quant: QuantConfig = QuantConfig()
    checkpoint: Str | dict[str, Any] | None = None
    base_dir: Str = ""
    set_empty_params: Bool = False
    save_mp_checkpoint_path: Str | None = None
    checkpoint_config: CheckpointPaths = CheckpointPaths()
    return_tuple: Bool = True
    training_mp_size: Int = 1
    replace_method: Str = "auto"
    injection_policy: Any = None
    injection_policy_tuple: Any = None
    config: Any = None
    max_out_tokens: PosInt = 1024
    min_out_tokens: PosInt = 1
    transposed_mode: Bool = False
    # Deprecated by DeepSpeed, which moves them to their new place (`_deprecated`).
    mp_size: Annotated[Int, Field(ge=1)] = 1
    mpu: Any = None
    ep_size: Int = 1
    ep_group: Any = None
    ep_mp_group: Any = None
    moe_experts: list[Any] = [1]
    moe_type: Literal["residual", "standard"] = "standard"

    model_config = {**Model.model_config, "arbitrary_types_allowed": True}

    @property
    def checkpoint_path(self) -> str | None:
        """`checkpoint` joined to `base_dir` (DeepSpeed's root of the checkpoint files)."""
        if self.checkpoint is None or isinstance(self.checkpoint, dict):
            return None
        return os.path.join(self.base_dir, self.checkpoint) if self.base_dir else self.checkpoint


# alias -> field, per section (DeepSpeed's pydantic aliases).
ALIASES: dict[str, dict[str, str]] = {
    "": {"kernel_inject": "replace_with_kernel_inject", "tp": "tensor_parallel", "tm": "triangular_masking",
         "ckpt_config": "checkpoint_config", "injection_dict": "injection_policy", "args": "config",
         "max_tokens": "max_out_tokens", "min_tokens": "min_out_tokens", "expert_group": "ep_group",
         "expert_mp_group": "ep_mp_group"},
    "moe": {"num_experts": "moe_experts", "expert_group": "ep_group"},
}
SECTIONS: dict[str, type[Model]] = {"": InferenceConfig, "tensor_parallel": TPConfig, "moe": MoEConfig,
                                    "quant": QuantConfig, "quant.activation": QuantBits, "quant.weight": WeightQuant,
                                    "quant.qkv": QKVQuant, "checkpoint_config": CheckpointPaths}
SPECIAL = {
    "optimizer": "an inference engine has no optimizer (and dtype int8 weights cannot be trained): train with "
                 "fnzero.shard + fnzero.train_step, then init_inference(fresh model, checkpoint=exported weights)",
    "zero_optimization": "DeepSpeed-Inference's ZeRO section is `zero`",
}


def read_inference_config(config: Any, kwargs: Mapping[str, Any]) -> tuple[InferenceConfig, frozenset[str]]:
    """(the validated config, the dotted keys the user set): `config` and `kwargs` merged as
    DeepSpeed merges them, aliases resolved, "auto" values dropped, deprecated keys moved."""
    merged = _merge(_source(config), dict(kwargs))
    problems = Problems()
    given = _normalise(merged, "", problems)
    cfg = validate_into(InferenceConfig, merged, (), problems)
    problems.raise_if_any("(DeepSpeed-Inference)")
    assert cfg is not None
    return _deprecated(cfg, given), frozenset(given)


def _source(config: Any) -> dict[str, Any]:
    if config is None:
        return {}
    if isinstance(config, Mapping):  # may hold Python objects (torch dtypes, groups): not a JSON tree
        return dict(config)
    if isinstance(config, (str, bytes, os.PathLike)):
        return read_source(config)[0]
    raise ConfigError(f"init_inference's `config` must be None, a dict, a path or JSON text, got a {type(config).__name__}")


def _merge(config: dict[str, Any], kwargs: dict[str, Any]) -> dict[str, Any]:
    for key in config.keys() & kwargs.keys():
        if _differ(config[key], kwargs[key]):
            # DeepSpeed's words (deepspeed/__init__.py, init_inference).
            raise ConfigError(f"Conflicting argument '{key}' in 'config':{config[key]} and kwargs:{kwargs[key]}")
    return {**config, **kwargs}


def _differ(a: Any, b: Any) -> bool:
    try:
        return bool(a != b)
    except Exception:  # tensors and such compare elementwise: two such values are different objects
        return a is not b


def _normalise(node: dict[str, Any], path: str, problems: Problems) -> set[str]:
    """In place: aliases to field names, "auto" values dropped (DeepSpeed's non-strict models drop
    them), unknown keys reported and removed. Returns the dotted keys set, sub-sections' included."""
    given: set[str] = set()
    fields = SECTIONS[path].model_fields
    for alias, name in ALIASES.get(path, {}).items():
        if alias in node:
            if name in node and _differ(node[name], node[alias]):
                problems.add(f"`{join_path(path, alias)}` and `{join_path(path, name)}` are the same key (an alias) "
                             "with two values; keep one")
            node.setdefault(name, node[alias])
            del node[alias]
    unknown: list[str] = []
    for key in list(node):
        dotted = join_path(path, key)
        if isinstance(node[key], str) and node[key] == "auto" and key != "replace_method":
            del node[key]
        elif key not in fields:
            why = SPECIAL.get(key) if not path else None
            if why:
                problems.add(f"`{dotted}` is not a DeepSpeed-Inference key: {why}")
            else:
                unknown.append(key)
            del node[key]
        else:
            given.add(dotted)
            if dotted in SECTIONS and isinstance(node[key], Mapping):
                node[key] = dict(node[key])
                given |= _normalise(node[key], dotted, problems)
    hinted, bare = split_by_hint(path, unknown, fields)
    problems.extend(f"`{where}` is not a DeepSpeed-Inference key{hint}" for where, hint in hinted)
    if bare:  # the valid keys listed once for all of them
        verb = "is not a DeepSpeed-Inference key" if len(bare) == 1 else "are not DeepSpeed-Inference keys"
        problems.add(f"{listed(bare)} {verb}; valid keys here: {', '.join(sorted(fields))}")
    return given


def _deprecated(cfg: InferenceConfig, given: set[str]) -> InferenceConfig:
    """DeepSpeed's deprecated `mp_size` sets `tensor_parallel.tp_size` (both given: its assertion)."""
    if "mp_size" not in given:
        return cfg
    if "tensor_parallel.tp_size" in given:
        raise ConfigError("Cannot provide deprecated parameter 'mp_size' and replacing parameter "
                          "'tensor_parallel.tp_size' together")
    tp = cfg.tensor_parallel.model_copy(update={"tp_size": cfg.mp_size})
    return cfg.model_copy(update={"tensor_parallel": tp})
