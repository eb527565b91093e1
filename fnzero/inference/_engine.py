"""`InferenceEngine`: what `fnzero.init_inference` returns, DeepSpeed's `InferenceEngine` on fnzero."""

from __future__ import annotations

from typing import Any

import torch

from .._errors import ConfigError
from .._state import TrainState
from ..sharding import ShardedModule
from ._inference_config import InferenceConfig

__all__ = ["InferenceEngine"]


class InferenceEngine:
    """A model laid out for inference: `engine(*args, **kwargs)` runs its forward (DeepSpeed's
    `engine(...)`, `engine.module(...)` there) and `engine.generate(input_ids, ...)` decodes with
    `fnzero.generate`; both without autograd.

    `sharded`: the `ShardedModule`; `state`: this rank's `TrainState` (its parameters, no optimizer
    state: not a state to train); `module`: the model (placeholders: call the engine); `config`: the
    model's own config; `inference_config`: the resolved `InferenceConfig` (`specs/inference.md`
    §The engine)."""

    def __init__(self, sharded: ShardedModule, state: TrainState, inference_config: InferenceConfig):
        self.sharded = sharded
        self.state = state
        self.inference_config = inference_config
        self._config = inference_config  # DeepSpeed's attribute name
        self.module = sharded.module
        self.config = getattr(sharded.module, "config", None)

    @property
    def params(self) -> dict[str, torch.Tensor]:
        """The state's parameters (unit name -> flat buffer or this rank's shard)."""
        return self.state.params

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """The model's output for these inputs (`ShardedModule.apply` with the engine's parameters)."""
        with torch.no_grad():
            return self.sharded.apply(self.state.params, *args, **kwargs)

    forward = __call__

    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, **gen_kwargs: Any):
        """`fnzero.generate(sharded, params, input_ids, attention_mask, **gen_kwargs)`, after
        DeepSpeed's check that a prompt is not longer than `max_out_tokens`; fnzero also refuses a
        prompt plus `max_new_tokens` (given, or in `generation_config`) above it, before decoding."""
        self.check_length(input_ids, gen_kwargs)
        from ._generate import generate

        with torch.no_grad():
            return generate(self.sharded, self.state.params, input_ids, attention_mask, **gen_kwargs)

    def check_length(self, input_ids: torch.Tensor, gen_kwargs: dict[str, Any]) -> None:
        """A ConfigError when the prompt, or the prompt and the new tokens, exceed `max_out_tokens`."""
        limit = self.inference_config.max_out_tokens
        length = int(input_ids.shape[-1])
        if length > limit:  # DeepSpeed's words (inference/engine.py, _generate)
            raise ConfigError(f"Input with size {length} exceeds maximum length of {limit}. Please increase "
                              "max_tokens in the DeepSpeed Inference Config.")
        new = gen_kwargs.get("max_new_tokens")
        if new is None and gen_kwargs.get("generation_config") is not None:
            new = getattr(gen_kwargs["generation_config"], "max_new_tokens", None)
        if new is not None and length + int(new) > limit:
            raise ConfigError(f"Input with size {length} and max_new_tokens {int(new)} ({length + int(new)} tokens) "
                              f"exceed the maximum length of {limit}. Please increase max_tokens in the DeepSpeed "
                              "Inference Config.")
