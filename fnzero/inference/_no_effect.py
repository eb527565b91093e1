"""DeepSpeed-Inference keys fnzero accepts without acting on them, and the ones it refuses.

Most of DeepSpeed-Inference's keys tune its CUDA kernels (kernel injection, CUDA graphs, Triton,
the fused attention's masking and workspace) or its checkpoint formats; fnzero runs the model's
own modules through `ShardedModule.apply` and has none of those, so a key that would change
something there warns once (`ConfigWarning`), naming the key, its value and why it does nothing.
A default value never warns. Keys whose value is a Python object fnzero would have to use
(DeepSpeed's process groups, its injection policies) are refused, since ignoring them would run
something other than what was asked. `specs/inference.md` §Keys lists them all.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

from .._errors import ConfigError
from ..config import ConfigWarning, describe
from ._inference_config import InferenceConfig

__all__ = ["warn_no_effect", "refuse_objects", "NO_EFFECT"]

KERNELS = "fnzero has no DeepSpeed inference kernels: the model's own modules run, through ShardedModule.apply"
MOE = ("fnzero has no expert parallelism or MoE kernels: a MoE model's layers run as the model defines them "
       "(split by AutoTP where its plan says so)")
CKPT = ("fnzero reads safetensors files and save_pretrained directories (`checkpoint`), sliced for any "
        "tensor-parallel size, and writes none here (fnzero.checkpoint.export does)")

# dotted key -> (the value when it would change something in DeepSpeed, else None; why nothing here).
NO_EFFECT: dict[str, tuple[Callable[[InferenceConfig], Any], str]] = {
    "replace_with_kernel_inject": (lambda c: c.replace_with_kernel_inject or None,
                                   f"{KERNELS} (the same numbers, without DeepSpeed's fused kernels)"),
    "enable_cuda_graph": (lambda c: c.enable_cuda_graph or None,
                          "fnzero does not capture CUDA graphs: every forward runs eagerly (collectives and "
                          "parameter gathers included)"),
    "use_triton": (lambda c: c.use_triton or None, KERNELS),
    "triton_autotune": (lambda c: c.triton_autotune or None, KERNELS),
    "triangular_masking": (lambda c: None if c.triangular_masking else False,
                           "it selects the mask of DeepSpeed's fused attention kernel; the model's own attention "
                           "masks as the model defines"),
    "return_tuple": (lambda c: None if c.return_tuple else False,
                     "it shapes the output of DeepSpeed's injected transformer layers; the model's own layers run"),
    "min_out_tokens": (lambda c: c.min_out_tokens if c.min_out_tokens != 1 else None,
                       "it sizes DeepSpeed's kernel workspace; fnzero allocates no workspace ahead"),
    "transposed_mode": (lambda c: c.transposed_mode or None, KERNELS),
    "keep_module_on_host": (lambda c: c.keep_module_on_host or None,
                            "fnzero already keeps the weights on the host until each rank's slice is placed on "
                            "the device"),
    "set_empty_params": (lambda c: c.set_empty_params or None,
                         "a model built on the meta device is recognised as such, and filled from `checkpoint`"),
    "save_mp_checkpoint_path": (lambda c: c.save_mp_checkpoint_path, CKPT),
    "checkpoint_config": (lambda c: _set(c.checkpoint_config.model_dump(exclude_defaults=True)), CKPT),
    "training_mp_size": (lambda c: c.training_mp_size if c.training_mp_size != 1 else None,
                         "fnzero slices whole tensors for any tensor-parallel size, whatever the training size was"),
    "replace_method": (lambda c: c.replace_method if c.replace_method != "auto" else None,
                       "DeepSpeed deprecates it: 'This parameter is no longer needed'"),
    "config": (lambda c: "an object" if c.config is not None else None,
               "it describes the model to DeepSpeed's kernel injection; fnzero reads the model's own config"),
    "quant": (lambda c: _set(c.quant.model_dump(exclude_defaults=True)),
              "DeepSpeed 0.19.8's engine does not read it either; fnzero's dtype int8 is always symmetric 8-bit "
              "weights with one scale per output channel"),
    "moe": (lambda c: _moe(c.moe), MOE),
    "ep_size": (lambda c: c.ep_size if c.ep_size != 1 else None, f"(deprecated: moe.ep_size) {MOE}"),
    "ep_group": (lambda c: "an object" if c.ep_group is not None else None, f"(deprecated: moe.ep_group) {MOE}"),
    "ep_mp_group": (lambda c: "an object" if c.ep_mp_group is not None else None,
                    f"(deprecated: moe.ep_mp_group) {MOE}"),
    "moe_experts": (lambda c: c.moe_experts if c.moe_experts != [1] else None, f"(deprecated: moe.moe_experts) {MOE}"),
    "moe_type": (lambda c: c.moe_type if c.moe_type != "standard" else None, f"(deprecated: moe.type) {MOE}"),
    "tensor_parallel.enabled": (lambda c: None if c.tensor_parallel.enabled else False,
                                "DeepSpeed does not read it either: tensor_parallel.tp_size alone decides"),
    "tensor_parallel.tp_grain_size": (
        lambda c: c.tensor_parallel.tp_grain_size if c.tensor_parallel.tp_grain_size != 64 else None,
        "fnzero splits the MLP and LM head as evenly as their sizes allow (uneven by at most one row)"),
}

# dotted key -> (the value when it is set, what fnzero cannot do with it).
REFUSED: dict[str, tuple[Callable[[InferenceConfig], Any], str]] = {
    "tensor_parallel.mpu": (lambda c: c.tensor_parallel.mpu, "fnzero builds its tensor-parallel groups from the "
                            "world (fnzero.make_mesh: consecutive ranks); remove it"),
    "tensor_parallel.tp_group": (lambda c: c.tensor_parallel.tp_group, "fnzero builds its tensor-parallel groups "
                                 "from the world (fnzero.make_mesh: consecutive ranks); remove it"),
    "mpu": (lambda c: c.mpu, "(deprecated: tensor_parallel.mpu) fnzero builds its tensor-parallel groups from the "
            "world; remove it"),
    "injection_policy": (lambda c: c.injection_policy, "fnzero's AutoTP splits the model by its built-in plan for "
                         "the model's architecture (or fnzero.shard's tp_plan=, a list of fnzero.TPRule); remove it"),
    "injection_policy_tuple": (lambda c: c.injection_policy_tuple, "it is DeepSpeed's internal form of "
                               "injection_policy; remove it"),
}


def _set(dumped: dict[str, Any]) -> Any:
    return dumped or None


def _moe(moe: Any) -> Any:
    return None if not moe.enabled else _set(moe.model_dump(exclude_defaults=True))


def refuse_objects(cfg: InferenceConfig) -> None:
    """One ConfigError for the keys whose objects fnzero cannot honour."""
    bad = [f"`{key}` is {describe(value_of(cfg))}: {why}" for key, (value_of, why) in REFUSED.items()
           if value_of(cfg) is not None]
    if isinstance(cfg.checkpoint, dict):
        bad.append("`checkpoint` is a dict (DeepSpeed's checkpoint description: type, checkpoints, version), which "
                   "fnzero does not read: pass a safetensors file or a save_pretrained directory")
    if bad:
        raise ConfigError("invalid DeepSpeed-Inference config: " + "; ".join(bad))


def warn_no_effect(cfg: InferenceConfig, given: frozenset[str], stacklevel: int) -> list[str]:
    """One ConfigWarning per key of NO_EFFECT the user set to a value that would change something
    in DeepSpeed (and DeepSpeed's deprecation of `mp_size`); returns the messages."""
    messages: list[str] = []
    if "mp_size" in given:
        messages.append("Config parameter mp_size is deprecated use tensor_parallel.tp_size instead (DeepSpeed's "
                        "words); fnzero read it as tensor_parallel.tp_size")
    for key, (value_of, why) in NO_EFFECT.items():
        value = value_of(cfg) if key in given else None
        if value is not None:
            messages.append(f"`{key}` is {describe(value)}, which has no effect in fnzero: {why}; remove the key "
                            "(or set DeepSpeed's default) to silence this warning")
    for message in messages:
        warnings.warn(message, ConfigWarning, stacklevel=stacklevel + 1)
    return messages
