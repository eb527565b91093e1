"""Counting a model's expert and dense parameters, for the expert-parallel memory formula and
`fnzero plan` (`specs/mesh.md §Expert parallelism memory`, which says what counts as an expert)."""

from __future__ import annotations

from typing import Any

from torch import nn

from ..sharding import ExpertGroup

__all__ = ["expert_param_counts", "experts_per_layer", "hf_config", "hf_expert_param_counts"]

# Hugging Face configs name a layer's routed expert count one of these ways.
_EXPERT_COUNT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts")


def _expert_paths(model: nn.Module) -> list[str]:
    return [p for p, m in model.named_modules() if isinstance(m, ExpertGroup) or p.rsplit(".", 1)[-1] == "experts"]


def expert_param_counts(model: nn.Module) -> tuple[int, int]:
    """(dense, expert) element counts of `model`'s parameters, each tensor once (tied names share
    it). Meta tensors count as well, so a model built on the meta device costs nothing to count.

    >>> import torch, fnzero
    >>> moe = fnzero.moe.MoE(4, torch.nn.Linear(4, 4), num_experts=2)
    >>> fnzero.memory.expert_param_counts(moe)          # the router (4 x 2), two experts (4 x 4 + 4)
    (8, 40)
    """
    prefixes = tuple(p + "." for p in _expert_paths(model))
    dense = expert = 0
    for name, p in model.named_parameters():  # named_parameters yields each tensor once
        if name.startswith(prefixes):
            expert += p.numel()
        else:
            dense += p.numel()
    return dense, expert


def experts_per_layer(hf_config: Any) -> int | None:
    """A Hugging Face config's routed experts per MoE layer (`num_local_experts`, `num_experts` or
    `n_routed_experts`, also in a `text_config`); None for a dense model."""
    for cfg in (hf_config, getattr(hf_config, "text_config", None)):
        for key in _EXPERT_COUNT_KEYS:
            value = getattr(cfg, key, None) if cfg is not None else None
            if isinstance(value, int) and value > 0:
                return value
    return None


def hf_config(path: str):
    """The transformers config whose `config.json` is `path` (or lies in the folder `path`)."""
    import os

    from transformers import AutoConfig

    return AutoConfig.from_pretrained(os.path.dirname(path) if os.path.isfile(path) else path)


def hf_expert_param_counts(path: str) -> tuple[int, int, int | None, str]:
    """(dense, expert, experts per layer, model type) of the Hugging Face model whose `config.json`
    is `path` (or lies in the folder `path`), built on the meta device: nothing is allocated or read
    but the config."""
    import torch
    from transformers import AutoModelForCausalLM

    config = hf_config(path)
    with torch.device("meta"):
        try:
            model = AutoModelForCausalLM.from_config(config)
        except ValueError:  # not a causal LM (an encoder, a vision-language model): the base model
            from transformers import AutoModel

            model = AutoModel.from_config(config)
    dense, expert = expert_param_counts(model)
    return dense, expert, experts_per_layer(config), config.model_type
