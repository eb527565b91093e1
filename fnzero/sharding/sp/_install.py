"""`split_for_sp`: a model's attention and loss routed over its sequence-parallel ranks, checked
before any step runs (`specs/mesh.md` §Sequence)."""

from __future__ import annotations

from typing import Any

from torch import nn

from ..._errors import ShardingError
from ._attention import ATTENTION_KEY, CausalAttention, hf_attention, hf_mask, route
from ._layout import SPLayout
from ._loss import causal_lm_loss_share

__all__ = ["split_for_sp"]


def split_for_sp(model: nn.Module, comm: Any, cross_entropy=None, pipeline: bool = False) -> SPLayout:
    """The sequence axis over `comm`: `model`'s attention runs over the group's tokens (a transformers
    model through its attention interface, fnzero's `CausalAttention` modules directly), its
    transformers loss becomes this rank's share (summed by `cross_entropy(logits, targets,
    ignore_index)` where given: a vocabulary-split head's), and calls without `position_ids` are
    refused. A pipeline stage (`pipeline`) holds transformers layers (their configs are routed) or
    fnzero's; its layers count positions from the rank's run (`token_positions`) and the pipeline
    makes its loss the share. A ShardingError names a model whose attention cannot be reached."""
    layout = SPLayout(comm)
    configs = _transformers_configs(model) if pipeline else []
    if hasattr(model, "set_attn_implementation") and hasattr(model, "config"):
        _route_transformers(model, layout, cross_entropy)
    elif configs:
        _register()
        for config in configs:  # the configs the stage's transformers layers read their attention from
            config._attn_implementation = ATTENTION_KEY
    elif not any(isinstance(m, CausalAttention) for m in model.modules()):
        raise ShardingError(f"sequence parallelism cannot reach {type(model).__name__}'s attention: it is neither a "
                            "transformers model (whose attention goes through its attention interface) nor built "
                            "with fnzero.CausalAttention modules; use one of those for its attention")
    route(model, layout)
    if not pipeline:  # a pipeline's layers take their positions from the rank's run
        model.register_forward_pre_hook(_needs_position_ids(layout), with_kwargs=True)
    return layout


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    # Registering the same functions again is harmless: the tables map the key to them.
    AttentionInterface.register(ATTENTION_KEY, hf_attention)
    AttentionMaskInterface.register(ATTENTION_KEY, hf_mask)


def _transformers_configs(model: nn.Module) -> list:
    """The distinct transformers configs a pipeline stage's modules hold (`config`, or fnzero's
    pipeline layers' `_config`)."""
    found = {}
    for m in model.modules():
        for c in (getattr(m, "config", None), getattr(m, "_config", None)):
            if hasattr(c, "_attn_implementation_internal"):
                found[id(c)] = c
    return list(found.values())


def _route_transformers(model: nn.Module, layout: SPLayout, cross_entropy) -> None:
    _register()
    was = model.config._attn_implementation
    model.set_attn_implementation(ATTENTION_KEY)
    if model.config._attn_implementation != ATTENTION_KEY:
        raise ShardingError(f"sequence parallelism cannot reach {type(model).__name__}'s attention: transformers "
                            f"keeps it at {was!r} (the model does not call its attention through AttentionInterface)")
    if hasattr(model, "loss_function"):  # transformers' own extension point for the loss
        model.loss_function = causal_lm_loss_share(layout, cross_entropy)


def _needs_position_ids(layout: SPLayout):
    def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
        if kwargs.get("position_ids") is None:
            raise ShardingError(f"{type(module).__name__} is sharded over {layout.size} sequence-parallel ranks: each "
                                "holds a run of the tokens, so the call needs position_ids= (the tokens' places in the "
                                "whole sequence; fnzero.shard_sequence adds them)")

    return hook
