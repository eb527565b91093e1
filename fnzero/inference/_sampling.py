"""Choosing the next token from the last position's logits: greedy, or sampled after temperature,
top-k and top-p in the order and arithmetic of transformers' logits warpers, then softmax and
`torch.multinomial`, so a run seeded like transformers' draws exactly its tokens
(`specs/generation.md` §Choosing a token)."""

from __future__ import annotations

import torch

from ._settings import GenerationSettings

__all__ = ["warp_scores", "choose_tokens"]


def warp_scores(scores: torch.Tensor, settings: GenerationSettings) -> torch.Tensor:
    """(batch, vocab) float32 scores with temperature, top-k and top-p applied, each only where
    it changes something (as transformers builds its warpers); removed entries are -inf."""
    if settings.temperature != 1.0:
        scores = scores / settings.temperature
    if settings.top_k != 0:
        k = min(settings.top_k, scores.shape[-1])
        kth = torch.topk(scores, k)[0][..., -1, None]
        scores = scores.masked_fill(scores < kth, -float("inf"))
    if settings.top_p < 1.0:
        ascending, order = torch.sort(scores, descending=False)
        cumulative = ascending.softmax(dim=-1).cumsum(dim=-1)
        drop_sorted = cumulative <= (1 - settings.top_p)
        drop_sorted[..., -1:] = False  # the most likely token always stays
        drop = drop_sorted.scatter(1, order, drop_sorted)
        scores = scores.masked_fill(drop, -float("inf"))
    return scores


def choose_tokens(logits: torch.Tensor, settings: GenerationSettings, generator: torch.Generator | None) -> torch.Tensor:
    """The next token of each row from (batch, vocab) logits of the last position."""
    scores = logits.to(dtype=torch.float32, copy=True)
    if not settings.do_sample:
        return torch.argmax(scores, dim=-1)
    probs = torch.nn.functional.softmax(warp_scores(scores, settings), dim=-1)
    return torch.multinomial(probs, num_samples=1, generator=generator).squeeze(1)
