"""The prompt `generate` is given, checked: its attention mask (left padding only), its length
against the model's positions, and the same prompt on every rank (`specs/generation.md` §Bad input)."""

from __future__ import annotations

import torch

from .._errors import ShardingError
from ._model_calls import ModelCalls
from ._settings import GenerationSettings

__all__ = ["attention_mask_for", "check_length", "agree_on_prompt"]


def check_length(prompt_len: int, new_tokens: int, limit: int | None, model_name: str) -> None:
    if limit is not None and prompt_len + new_tokens > limit:
        raise ShardingError(
            f"generate: a prompt of {prompt_len} tokens plus max_new_tokens={new_tokens} is {prompt_len + new_tokens} "
            f"positions, more than {model_name} has (max_position_embeddings / n_positions = {limit}); shorten the "
            "prompt or ask for fewer new tokens"
        )


def attention_mask_for(ids: torch.Tensor, mask: torch.Tensor | None, settings: GenerationSettings,
                       calls: ModelCalls) -> torch.Tensor | None:  # fmt: skip
    """The (batch, prompt) 0/1 mask of the prompt, None when every token counts. Without one it is
    inferred as transformers does: from `pad_token_id` where the prompt holds it and it is not an
    end-of-sequence token."""
    if mask is None:
        pad = settings.pad_token_id
        if calls.attention_mask and pad is not None and pad not in settings.eos_token_ids and bool((ids == pad).any()):
            mask = (ids != pad).long()
        else:
            return None
    elif not isinstance(mask, torch.Tensor) or tuple(mask.shape) != tuple(ids.shape):
        got = f"shape {tuple(mask.shape)}" if isinstance(mask, torch.Tensor) else type(mask).__name__
        raise ShardingError(f"generate: attention_mask must have input_ids' shape {tuple(ids.shape)}, got {got}")
    elif bool(((mask != 0) & (mask != 1)).any()):
        raise ShardingError("generate: attention_mask must hold 0 (padding) and 1 (token) only")
    mask = mask.long()
    if bool((mask == 1).all()):
        return mask
    if not calls.attention_mask:
        raise ShardingError("generate: attention_mask has padding, but the model's forward takes no attention_mask; "
                            "generate unpadded prompts of one length (one call per length)")
    empty = (mask.sum(-1) == 0).nonzero().flatten().tolist()
    if empty:
        raise ShardingError(f"generate: rows {empty[:5]} of attention_mask are all padding; each row needs a token")
    right = (mask[:, -1] == 0).nonzero().flatten().tolist()
    if right:
        # transformers only warns; its output for such rows continues after the padding, which the
        # model never saw: a wrong answer, so fnzero refuses.
        raise ShardingError(
            f"generate: rows {right[:5]} of attention_mask end in padding (right padding); a decoder-only model "
            "continues from the last position, so pad on the left (tokenizer.padding_side = 'left')"
        )
    return mask


def agree_on_prompt(groups: list, ids: torch.Tensor, mask: torch.Tensor | None, new_tokens: int) -> None:
    """One small all-gather per group: every rank was given the same prompt, mask and length, or
    every rank raises the same error naming the ranks that differ (instead of mismatched
    collectives, a hang, or tokens of a mixture of prompts)."""
    weights = torch.arange(1, ids.numel() + 1, device=ids.device).view(ids.shape)
    mask_sum = int((mask * weights).sum()) if mask is not None else -1
    mine = torch.tensor([ids.shape[0], ids.shape[1], new_tokens, int((ids * weights).sum()), mask_sum],
                        dtype=torch.long, device=ids.device)  # fmt: skip
    for g in groups:
        if g.world_size == 1:
            continue
        every = g.all_gather(mine).view(g.world_size, -1)
        differ = [r for r in range(g.world_size) if not torch.equal(every[r], every[0])]
        if differ:
            raise ShardingError(
                f"generate: ranks {differ} (of a group of {g.world_size}) were given another prompt, attention_mask "
                f"or max_new_tokens than its rank 0 (batch, length, new tokens: {every[0, :3].tolist()} there, "
                f"{every[differ[0], :3].tolist()} on rank {differ[0]}); every rank generates from the same prompt"
            )
