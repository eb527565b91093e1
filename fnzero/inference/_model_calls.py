"""How `generate` calls a model's forward through `ShardedModule.apply`: the keywords a Hugging Face
causal LM takes (its KV cache, position ids, attention mask, `logits_to_keep`), read from the
forward's signature, or a plain `forward(ids) -> logits` model re-run on the whole sequence
(`specs/generation.md` §Models).
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any

import torch
from torch import nn

__all__ = ["ModelCalls", "model_calls", "max_positions"]

# Where a model's config keeps its context length: transformers' two spellings, fnzero's GPT's.
_POSITION_KEYS = ("max_position_embeddings", "n_positions", "seq_len")


def max_positions(module: nn.Module) -> int | None:
    """The longest sequence the model's position embeddings cover, when its config says."""
    config = getattr(module, "config", None)
    for key in _POSITION_KEYS:
        value = getattr(config, key, None)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


@dataclasses.dataclass(frozen=True)
class ModelCalls:
    """Which of generation's keyword inputs the model's forward takes. `keywords`: a Hugging Face
    style forward (`input_ids=`, a ModelOutput with `.logits`); otherwise `forward(ids)` returns
    the logits. `cache_key`: the name of its KV-cache argument (`cache` in transformers 5.x after
    the rename, `past_key_values` before), None when it has none."""

    keywords: bool
    cache_key: str | None
    position_ids: bool
    attention_mask: bool
    use_cache: bool
    logits_to_keep: bool

    def new_cache(self, module: nn.Module) -> Any:
        """An empty cache as transformers' `generate` makes one: a `DynamicCache` laid out by the
        model's decoder config (sliding-window layers where the config has them)."""
        from transformers import DynamicCache  # a transformers model: transformers is installed

        config = module.config
        if hasattr(config, "get_text_config"):
            config = config.get_text_config(decoder=True)
        return DynamicCache(config=config)

    def inputs(self, ids: torch.Tensor, mask: torch.Tensor | None, positions: torch.Tensor | None,
               cache: Any) -> dict[str, Any]:  # fmt: skip
        """The keyword inputs of one forward over `ids` (the whole sequence, or the new token when
        `cache` holds the rest); `mask` and `positions` cover the whole sequence."""
        kw: dict[str, Any] = {"input_ids": ids}
        if mask is not None and self.attention_mask:
            kw["attention_mask"] = mask
        if positions is not None and self.position_ids:
            kw["position_ids"] = positions[:, -ids.shape[1]:]
        if self.cache_key is not None and cache is not None:
            kw[self.cache_key] = cache
        if self.use_cache:
            kw["use_cache"] = cache is not None
        if self.logits_to_keep:
            kw["logits_to_keep"] = 1
        return kw

    def last_logits(self, out: Any) -> torch.Tensor:
        """(batch, vocab) logits of the last position from the forward's output."""
        logits = out.logits if hasattr(out, "logits") else out[0] if isinstance(out, tuple) else out
        return logits[:, -1, :]


def model_calls(module: nn.Module) -> ModelCalls:
    taken = set(inspect.signature(_forward_of(module).forward).parameters)
    keywords = "input_ids" in taken
    cache_key = next((k for k in ("cache", "past_key_values") if k in taken), None) if keywords else None
    return ModelCalls(keywords=keywords, cache_key=cache_key, position_ids=keywords and "position_ids" in taken,
                      attention_mask=keywords and "attention_mask" in taken, use_cache=keywords and "use_cache" in taken,
                      logits_to_keep=keywords and "logits_to_keep" in taken)  # fmt: skip


def _forward_of(module: nn.Module) -> nn.Module:
    """The module whose forward's signature says what the model takes. A PEFT wrapper's forward
    (`forward(*args, **kwargs)`, or a few named inputs and `**kwargs`) hands its keywords on to
    the model it wraps (`get_base_model()`), whose forward names them all."""
    base = getattr(module, "get_base_model", None)
    if callable(base):
        inner = base()
        if isinstance(inner, nn.Module) and inner is not module:
            return inner
    return module
