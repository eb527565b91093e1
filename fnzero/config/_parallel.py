"""`tensor_parallel` and `pipeline`: DeepSpeed 0.19.8's AutoTP training and pipeline blocks, with their
defaults (specs/config.md §tensor_parallel, §pipeline say which keys fnzero reads; of the rest, those
marked W warn through `_noop.py`)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field

from ._types import Bool, Int, Model, Str, StrList

__all__ = ["PipelineConfig", "TensorParallelConfig", "LayerSpec", "PartitionConfig", "TPSizeConfig", "PRESET_MODELS"]

# DeepSpeed's presets (module_inject/autotp_config.py), accepted as DeepSpeed accepts them; a preset
# fnzero has no built-in plan for (`sharding/tp/_autotp.py` PLANS) is refused by `shard`, naming the ones it has.
PRESET_MODELS = ("llama", "bloom", "chatglm", "mixtral", "deepseek_v2", "qwen2", "phi3")


class TPSizeConfig(Model):
    """`tensor_parallel.tp` (alias `tensor_parallel.tensor_parallel`): DeepSpeed's inference-side sizes."""

    tp_size: Annotated[Int, Field(ge=1)] = Field(1, description="Inference AutoTP size; training reads autotp_size.")
    tp_grain_size: Annotated[Int, Field(ge=1)] = Field(1, description="AutoTP parser granularity; no effect in training.")
    mpu: Any = Field(None, description="A model-parallel unit object; not a JSON value, must be null.")
    tp_group: Any = Field(None, description="A process group; not a JSON value, must be null.")


class LayerSpec(Model):
    """One rule of `partition_config.layer_specs`: parameters whose name matches any of
    `patterns` (Python regular expressions, searched) are split `row` or `column` (of the torch
    Linear convention: column splits the outputs, row the inputs), or `skip` (replicated).
    `shape` views a fused output dimension as blocks (e.g. [3, -1] for q|k|v), each block split
    alike; `partition_dim` picks which of `shape`'s dimensions is split (default: the last)."""

    patterns: StrList = Field(description="Regular expressions over parameter names.")
    partition_type: Literal["row", "column", "skip"] = Field(description="How matching parameters are split.")
    shape: list[Int] | None = Field(None, description="Blocks of the split dimension, e.g. [3, -1] for fused q|k|v.")
    partition_dim: Int | None = Field(None, description="Which entry of `shape` is split.")
    model_types: StrList | None = Field(None, description="Apply only to these model types (config.model_type).")


class PartitionConfig(Model):
    """`tensor_parallel.partition_config`: explicit AutoTP rules, tried before the built-in plans."""

    use_default_specs: Bool = Field(True, description="Also use fnzero's built-in plan for known models.")
    layer_specs: list[LayerSpec] = Field(default_factory=list, description="Rules, first match wins.")


class TensorParallelConfig(Model):
    """`tensor_parallel`: split each layer's weights over `autotp_size` ranks (Megatron-style
    column/row-parallel linears); ZeRO shards what remains over the data-parallel ranks."""

    autotp_size: Annotated[Int, Field(ge=0)] = Field(0, description="Tensor-parallel ranks; 0 (or 1) = off.")
    tp_overlap_comm: Bool = Field(False, description="Overlap TP all-reduces with compute; no effect in fnzero.")
    vocab_parallel_lm_head: Bool | None = Field(
        None, description="Split the LM head (and tied embedding) over the vocabulary and use a cross-entropy that "
        "never gathers the logits; null = where the model's plan supports it.")
    vocab_parallel_ce_backend: Literal["torch"] = Field("torch", description="Vocab-parallel CE implementation.")
    tensor_parallel: TPSizeConfig = Field(default_factory=TPSizeConfig, description="Inference-side sizes (alias: tp).")
    injection_policy_tuple: Any = Field(None, description="Inference injection policy; must be null.")
    partition_config: PartitionConfig | None = Field(None, description="Explicit per-parameter split rules.")
    preset_model: Literal[PRESET_MODELS] | None = Field(None, description="Use a built-in plan by model name.")  # type: ignore[valid-type]
    keep_module_on_host: Bool = Field(False, description="Keep loaded weights on the host; no effect in fnzero.")
    replace_with_kernel_inject: Literal[False] = Field(
        False, description="Inference kernels (alias: kernel_inject); not implemented, must be false.")
    dtype: Str = Field("fp16", description="DeepSpeed converts the model to this dtype for inference; training "
                       "uses the config's precision blocks, so fnzero ignores it.")

    @property
    def size(self) -> int:
        """The tensor-parallel degree (1 when off)."""
        return max(1, int(self.autotp_size))


class PipelineConfig(Model):
    """`pipeline`: how a `fnzero.pipeline.PipelineModule` is run (`specs/mesh.md` §Pipeline)."""

    stages: Annotated[Int, Field(ge=1)] | Literal["auto"] = Field(
        "auto", description="Pipeline stages; auto = the PipelineModule's num_stages (else 1). The batch triad "
        "counts data-parallel ranks, world / (stages x autotp_size), when this is a number.")
    partition: Str = Field("best", description="DeepSpeed does not read it either (PipelineModule's "
                           "partition_method decides); no effect.")
    seed_layers: Bool = Field(False, description="Build LayerSpec i from torch seed base_seed + i (1234 + i).")
    activation_checkpoint_interval: Annotated[Int, Field(ge=0)] = Field(
        0, description="Rematerialise every this many layers of a stage (0: the PipelineModule's own setting).")
    pipe_partitioned: Bool = Field(True, description="Split stage-boundary activations over tp ranks; fnzero "
                                   "sends them whole.")
    grad_partitioned: Bool = Field(True, description="Split stage-boundary gradients over tp ranks; fnzero "
                                   "sends them whole.")
    use_reentrant: Bool | None = Field(None, description="Checkpointing flavour (DeepSpeed: true when unset); "
                                       "fnzero's remat is non-reentrant, with the same numbers.")

    @property
    def size(self) -> int | None:
        """The stage count, or None for "auto"."""
        return None if self.stages == "auto" else int(self.stages)
