"""DeepSpeed-Inference keys fnzero accepts without acting on them (W: the training config's no-effect
warning, for the keys the user set) and the ones it refuses (E), `specs/inference.md` §Keys. A key whose
value is a Python object fnzero would have to use is refused: ignoring it would run something other
than what was asked.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

from .._errors import ConfigError
from ..config import ConfigWarning, describe, no_effect_table, warn_no_effect as warn_config_no_effect
from ._inference_config import InferenceConfig

__all__ = ["warn_no_effect", "refuse_objects", "NO_EFFECT"]

KERNELS = "fnzero has no DeepSpeed inference kernels: the model's own modules run, through ShardedModule.apply"
MOE = ("fnzero has no expert parallelism or MoE kernels: a MoE model's layers run as the model defines them "
       "(split by AutoTP where its plan says so)")
CKPT = ("fnzero reads safetensors files and save_pretrained directories (`checkpoint`), sliced for any "
        "tensor-parallel size, and writes none here (fnzero.checkpoint.export does)")

# dotted key -> why it has no effect: it warns when set to a value other than its default; or
# (the value when it would change something in DeepSpeed, else None; why nothing here).
NO_EFFECT = no_effect_table({
    "replace_with_kernel_inject": f"{KERNELS} (the same numbers, without DeepSpeed's fused kernels)",
    "enable_cuda_graph": "fnzero does not capture CUDA graphs: every forward runs eagerly (collectives and parameter "
                         "gathers included)",
    "use_triton": KERNELS,
    "triton_autotune": KERNELS,
    "triangular_masking": "it selects the mask of DeepSpeed's fused attention kernel; the model's own attention masks "
                          "as the model defines",
    "return_tuple": "it shapes the output of DeepSpeed's injected transformer layers; the model's own layers run",
    "min_out_tokens": "it sizes DeepSpeed's kernel workspace; fnzero allocates no workspace ahead",
    "transposed_mode": KERNELS,
    "keep_module_on_host": "fnzero already keeps the weights on the host until each rank's slice is placed on the "
                           "device",
    "set_empty_params": "a model built on the meta device is recognised as such, and filled from `checkpoint`",
    "save_mp_checkpoint_path": CKPT,
    "checkpoint_config": (lambda c: _set(c.checkpoint_config.model_dump(exclude_defaults=True)), CKPT),
    "training_mp_size": "fnzero slices whole tensors for any tensor-parallel size, whatever the training size was",
    "replace_method": "DeepSpeed deprecates it: 'This parameter is no longer needed'",
    "config": (lambda c: "an object" if c.config is not None else None,
               "it describes the model to DeepSpeed's kernel injection; fnzero reads the model's own config"),
    "quant": (lambda c: _set(c.quant.model_dump(exclude_defaults=True)),
              "DeepSpeed 0.19.8's engine does not read it either; fnzero's dtype int8 is always symmetric 8-bit "
              "weights with one scale per output channel"),
    "moe": (lambda c: _moe(c.moe), MOE),
    "ep_size": f"(deprecated: moe.ep_size) {MOE}",
    "ep_group": (lambda c: "an object" if c.ep_group is not None else None, f"(deprecated: moe.ep_group) {MOE}"),
    "ep_mp_group": (lambda c: "an object" if c.ep_mp_group is not None else None,
                    f"(deprecated: moe.ep_mp_group) {MOE}"),
    "moe_experts": f"(deprecated: moe.moe_experts) {MOE}",
    "moe_type": f"(deprecated: moe.type) {MOE}",
    "tensor_parallel.enabled": "DeepSpeed does not read it either: tensor_parallel.tp_size alone decides",
    "tensor_parallel.tp_grain_size": "fnzero splits the MLP and LM head as evenly as their sizes allow (uneven by at "
                                     "most one row)",
})

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


def warn_no_effect(cfg: InferenceConfig, given: frozenset[str], stacklevel: int) -> None:
    """The training config's warning for each key of NO_EFFECT the user set (and DeepSpeed's deprecation
    of `mp_size`)."""
    if "mp_size" in given:
        warnings.warn("Config parameter mp_size is deprecated use tensor_parallel.tp_size instead (DeepSpeed's "
                      "words); fnzero read it as tensor_parallel.tp_size", ConfigWarning, stacklevel=stacklevel + 1)
    warn_config_no_effect(cfg, stacklevel + 1, {key: entry for key, entry in NO_EFFECT.items() if key in given})
