"""fnzero: ZeRO sharding as pure, testable transforms of an explicit training state, on PyTorch.

Training is a pure function `step(state, batch) -> (state, metrics)` over an explicit pytree
(`TrainState`); ZeRO stages 0-3 are sharding transforms of that state.

    import fnzero, torch.nn.functional as F

    fnzero.init_distributed()                          # torchrun's env; a world of one without it
    cfg   = fnzero.load_config("ds_config.json")       # path | dict | JSON text | base64 JSON
    sm    = fnzero.shard(model, config=cfg)            # stage from cfg, or stage=N
    state = sm.init_state()                            # this rank's TrainState

    def loss_fn(params, batch):
        logits = sm.apply(params, batch["x"])
        return F.cross_entropy(logits.flatten(0, 1), batch["y"].flatten())

    step = fnzero.train_step(loss_fn, cfg)
    state, metrics = step(state, batch)                # loss, lr, grad_norm, loss_scale, skipped

Public API
----------
load_config, Config         DeepSpeed JSON configs, validated strictly (`specs/config.md`).
hf_auto_values, AutoValues  fill a Hugging Face-style config's "auto" keys from the Trainer's numbers.
ConfigWarning               a config key fnzero accepts but does not act on (warned once at load).
shard, ShardedModule        a model laid out by a ShardPlan; `.apply` (`.call`: any function of the
    model), `.init_state` (`pretrained=`, `adapters=`: `specs/peft.md`), `.gather`, `.causal_lm_loss`
    (tiled); `PretrainedWarning`: tensors missing.
ShardPlan, UnitPlan         the sharding as data (`specs/sharding.md`).
Placement                   what of a unit is sharded; a ZeRO stage names one of four presets.
train_step, TrainStep       the pure training step.
jit, JittedStep, JitWarning compile a step with torch.compile, per unit, loss or whole step (`specs/jit.md`).
TrainState, LossScaleState, Sharding   the state pytree and its static metadata.
init_distributed            join torchrun's process group (gloo on CPU, NCCL on CUDA).
make_mesh, Mesh             the ranks as a pipeline x data x tensor-parallel grid, with ep, MiCS and hpZ
    groups on the dp axis (`specs/mesh.md`); the config's keys build one inside `shard`.
TPRule, TPLayout            tensor parallelism (AutoTP): which modules are split and how each parameter is.
vocab_parallel_cross_entropy  cross-entropy of logits split over the vocabulary, never gathered.
CausalAttention, shard_sequence, SPLayout, tile_mlp   sequence parallelism (Ulysses and ring,
    `sequence_parallel_size`): attention a sequence axis reaches, a batch cut along the sequence for
    this rank, the axis; MLPs run a few tokens at a time (`ShardedModule.causal_lm_loss`: the loss).
pipeline, PipelineModule, LayerSpec, pipeline_loss   pipeline parallelism: layers cut into stages, run by
    a GPipe or 1F1B schedule inside `train_step`.
init_inference, InferenceEngine   DeepSpeed-Inference's `deepspeed.init_inference` (`specs/inference.md`).
optim, schedules            optax-style optimizers and DeepSpeed-exact lr schedules.
moe                         Mixture of Experts as DeepSpeed's `deepspeed.moe.layer.MoE` (`specs/moe.md`).
checkpoint                  save/load at any world size and stage, export (`specs/checkpoint-format.md`);
    DeepSpeed's checkpoints load too, and `deepspeed_to_fnzero` rewrites one as fnzero's without the model.
testing                     (import fnzero.testing) worlds, strategies and assertions for property tests.
memory                      exact per-rank model-state bytes, the ZeRO formulas and the planner's estimates.
Collectives, RecordingCollectives   the communication interface and its byte-counting wrapper;
    CollectivesBase derives the async and option-taking forms for a custom backend.
CommQuantization, BlockQuantizer, IdentityCodec   ZeRO++ quantized communication (`specs/collectives.md`).
remat                       activation checkpointing as a function transform (jax.checkpoint-like).
generate                    text from a sharded model, as transformers' `generate()` (`specs/generation.md`).
tree_clone                  a deep copy of a pytree of tensors (e.g. before a donated step).
FnzeroError, ConfigError, ShardingError, CheckpointError, DistributedError   error types.
"""

from __future__ import annotations

import importlib as _importlib
from typing import TYPE_CHECKING

from ._errors import CheckpointError, ConfigError, DistributedError, FnzeroError, ShardingError
from .config import AutoValues, Config, ConfigWarning

__version__ = "0.1.0"

# The rest is imported on first use (PEP 562): `import fnzero` does not import torch, so the
# `fnzero` command answers `--help` and checks configs at once (torch takes seconds to import).
# Every name below is public all the same: `fnzero.shard`, `from fnzero import shard`, `dir()`.
_LAZY = {
    **dict.fromkeys(("checkpoint", "memory", "moe", "optim", "pipeline", "schedules"), ""),
    **dict.fromkeys(("LayerSpec", "PipelineModule", "pipeline_loss"), ".pipeline"),
    **dict.fromkeys(("LossScaleState", "Sharding", "TrainState"), "._state"),
    **dict.fromkeys((
        "Collectives", "CollectivesBase", "DistInfo", "LocalCollectives", "Placement", "PretrainedWarning",
        "ProcessGroupCollectives", "RecordingCollectives", "ShardedModule", "ShardPlan", "UnitPlan",
        "init_distributed", "Mesh", "make_mesh", "TPRule", "TPLayout", "vocab_parallel_cross_entropy",
        "BlockQuantizer", "CommQuantization", "IdentityCodec", "hf_auto_values", "load_config",
        "CausalAttention", "SPLayout", "shard_sequence", "tile_mlp",
    ), ".sharding"),
    **dict.fromkeys(("shard", "deepspeed_to_fnzero"), ".state"),
    **dict.fromkeys(("InferenceEngine", "generate", "init_inference"), ".inference"),
    **dict.fromkeys((
        "CompileRecord", "JittedStep", "JitWarning", "TrainStep", "jit", "remat", "split_micro_batches", "train_step",
    ), ".train"),
}


def __getattr__(name: str):
    where = _LAZY.get(name)
    if where is None:
        raise AttributeError(f"module 'fnzero' has no attribute {name!r}")
    value = _importlib.import_module(f".{name}" if where == "" else where, __name__)
    if where != "":
        value = getattr(value, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


def tree_clone(tree):
    """A copy of `tree` whose tensors share no storage with the original."""
    import optree
    import torch

    return optree.tree_map(lambda x: x.clone() if isinstance(x, torch.Tensor) else x, tree, none_is_leaf=True)


if TYPE_CHECKING:  # what the lazy names are, for type checkers and editors
    from . import checkpoint, memory, moe, optim, pipeline, schedules
    from .pipeline import LayerSpec, PipelineModule, pipeline_loss
    from ._state import LossScaleState, Sharding, TrainState
    from .sharding import (
        Collectives, CollectivesBase, DistInfo, LocalCollectives, Placement, PretrainedWarning,
        Mesh, ProcessGroupCollectives, RecordingCollectives, ShardedModule, ShardPlan, TPLayout, TPRule, UnitPlan,
        init_distributed, make_mesh, vocab_parallel_cross_entropy, BlockQuantizer, CommQuantization,
        IdentityCodec, hf_auto_values, load_config, CausalAttention, SPLayout, shard_sequence, tile_mlp,
    )
    from .state import deepspeed_to_fnzero, shard
    from .inference import InferenceEngine, generate, init_inference
    from .train import CompileRecord, JittedStep, JitWarning, TrainStep, jit, remat, split_micro_batches, train_step


__all__ = [
    "AutoValues", "BlockQuantizer", "CausalAttention", "SPLayout", "shard_sequence", "tile_mlp",
    "CommQuantization", "IdentityCodec", "CheckpointError", "CompileRecord",
    "checkpoint", "deepspeed_to_fnzero", "Collectives", "CollectivesBase", "Config", "ConfigError", "ConfigWarning",
    "DistInfo", "DistributedError", "FnzeroError", "generate", "hf_auto_values", "InferenceEngine", "init_inference",
    "JitWarning", "JittedStep", "LayerSpec", "LocalCollectives", "LossScaleState", "Mesh", "Placement",
    "PretrainedWarning", "ProcessGroupCollectives", "RecordingCollectives", "ShardPlan", "ShardedModule", "Sharding",
    "ShardingError", "TrainState", "TrainStep", "TPLayout", "TPRule", "UnitPlan", "init_distributed", "jit",
    "load_config", "make_mesh", "memory", "moe", "optim", "pipeline", "pipeline_loss", "PipelineModule", "remat",
    "schedules", "shard", "split_micro_batches", "train_step", "tree_clone", "vocab_parallel_cross_entropy",
]
