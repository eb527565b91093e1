"""Top-1 and top-2 routing as functions of the router's logits (`specs/moe.md` §Gating): `Routes`
gives each token's experts, capacity slots and combine weights (a dropped route: expert -1, weight
0). The float32 arithmetic follows DeepSpeed 0.19.8's `top1gating` / `top2gating` step for step, so
the same operations in the same order give the same bits (§DeepSpeed as the oracle)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .._errors import ConfigError

__all__ = ["Routes", "capacity_for", "top1_routes", "top2_routes", "uniform_noise", "gumbel_noise", "used_token_mask"]


@dataclass(frozen=True)
class Routes:
    """Where each token's k routes go. `experts`, `slots`, `weights`: [k, tokens]; a dropped route
    has expert -1, slot 0 and weight 0. `capacity`: slots per expert. `exp_counts`: [num_experts]
    int64, the routes each expert was chosen for before any was dropped (DeepSpeed's `exp_counts`)."""

    experts: torch.Tensor
    slots: torch.Tensor
    weights: torch.Tensor
    capacity: int
    l_aux: torch.Tensor
    exp_counts: torch.Tensor


def capacity_for(num_tokens: int, num_experts: int, capacity_factor: float, min_capacity: int) -> int:
    """ceil(tokens / experts * factor), at least `min_capacity`. The product is taken in float32, as
    DeepSpeed's `_capacity` does (a python float times a float32 scalar tensor), so ties at an integer
    round the same way."""
    product = (num_tokens / num_experts) * torch.tensor(capacity_factor)
    return max(int(torch.ceil(product)), int(min_capacity))


def uniform_noise(shape, generator: torch.Generator, device: torch.device, low: float = 0.0,
                  high: float = 1.0) -> torch.Tensor:
    """float32 uniform [low, high) drawn from `generator` (on its own device), moved to `device`."""
    u = torch.rand(shape, generator=generator, device=generator.device, dtype=torch.float32)
    return (low + (high - low) * u).to(device)


def gumbel_noise(shape, generator: torch.Generator, device: torch.device) -> torch.Tensor:
    """Standard Gumbel(0, 1) samples, -log(-log(u)), with u kept inside (0, 1) so both logs are finite."""
    finfo = torch.finfo(torch.float32)
    u = uniform_noise(shape, generator, device).clamp(min=finfo.tiny, max=1.0 - finfo.eps)
    return -torch.log(-torch.log(u))


def used_token_mask(used_token: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """`used_token` as a bool [tokens, 1] column: which tokens take part in top-1 routing.

    DeepSpeed multiplies its one-hot route mask by `used_token`, so a bool, integer or float mask of
    zeros and ones means the same whatever its dtype (a float one arrives from a bf16/fp16
    `ShardedModule.apply`, which casts floating arguments). Any other value there gives fractional slots
    that collide or index past the buffer, so it is refused instead of followed. The mask is data: no
    gradient flows into it. Checking the values reads one flag on the host, so it is left out while
    torch.compile traces the layer (a host read there would break the graph)."""
    if used_token.numel() != num_tokens:
        raise ConfigError(f"MoE used_token has {used_token.numel()} elements, one per token: {num_tokens} "
                          "(the input flattened to [tokens, hidden])")
    if used_token.dtype != torch.bool and not torch.compiler.is_compiling():
        bad = ~((used_token == 0) | (used_token == 1))
        if bool(bad.any()):
            raise ConfigError(f"MoE used_token must hold only 0 and 1 (1 routes the token, 0 leaves it out); it holds "
                              f"{used_token[bad].flatten()[0].item()!r} ({used_token.dtype}): DeepSpeed multiplies its "
                              "route mask by it, and other values give colliding capacity slots")
    return used_token.reshape(-1, 1).to(torch.bool)


def _no_drop_capacity(exp_counts: torch.Tensor) -> int:
    # ep_size 1: no all-reduce of the maximum over the expert group, no tensor-parallel padding.
    return int(exp_counts.max())


def top1_routes(logits: torch.Tensor, *, capacity_factor: float, min_capacity: int, drop_tokens: bool,
                use_rts: bool, rsample: bool, used_token: torch.Tensor | None,
                generator: torch.Generator) -> Routes:
    """Each token to its most probable expert (by noisy logits under RSample); at most `capacity`
    tokens per expert, chosen at random (`use_rts`) or by torch.topk's order among equals."""
    num_tokens, num_experts = logits.shape
    gates = F.softmax(logits, dim=1)
    capacity = capacity_for(num_tokens, num_experts, capacity_factor, min_capacity)
    chooser = logits + gumbel_noise(logits.shape, generator, logits.device) if rsample else gates
    first = torch.argmax(chooser, dim=1)
    mask = F.one_hot(first, num_classes=num_experts)
    if used_token is not None:
        mask = mask * used_token_mask(used_token, num_tokens)
    exp_counts = mask.sum(dim=0).detach()
    if not drop_tokens:
        capacity = min(_no_drop_capacity(exp_counts), num_tokens)
    # Switch-style balance loss: experts' mean probability times their share of tokens, times E.
    l_aux = torch.sum(gates.mean(dim=0) * mask.float().mean(dim=0)) * num_experts
    if num_tokens < min_capacity:
        raise ConfigError(f"MoE top-1 gating got {num_tokens} tokens, fewer than min_capacity={min_capacity}; "
                          "set min_capacity to 0 or route more tokens per call (DeepSpeed asserts the same)")
    scores = mask * uniform_noise(mask.shape, generator, logits.device) if use_rts else mask
    keep = torch.topk(scores, k=min(capacity, num_tokens), dim=0).indices
    mask = mask * torch.zeros_like(mask).scatter_(0, keep, 1)
    locations = torch.cumsum(mask, dim=0) - 1
    kept = mask.sum(dim=1) > 0
    experts = torch.where(kept, first, torch.full_like(first, -1))
    slots = (locations * mask).sum(dim=1)
    weights = (gates * mask).sum(dim=1)
    return Routes(experts[None], slots[None], weights[None], capacity, l_aux, exp_counts)


def top2_routes(logits: torch.Tensor, *, capacity_factor: float, min_capacity: int, drop_tokens: bool,
                second_sampling: bool, generator: torch.Generator) -> Routes:
    """Each token to its two most probable experts (the second drawn by Gumbel-max when
    `second_sampling`); first choices fill the buffers before second ones, in token order, and a
    route past capacity is dropped. The two weights are renormalised to sum to 1 over kept routes."""
    num_tokens, num_experts = logits.shape
    gates = F.softmax(logits, dim=1)
    first = torch.argmax(gates, dim=1)
    mask1 = F.one_hot(first, num_classes=num_experts)
    chooser = logits + gumbel_noise(logits.shape, generator, logits.device) if second_sampling else logits
    second = torch.argmax(chooser.masked_fill(mask1.bool(), float("-inf")), dim=1)
    mask2 = F.one_hot(second, num_classes=num_experts)
    locations1 = torch.cumsum(mask1, dim=0) - 1
    locations2 = torch.cumsum(mask2, dim=0) - 1 + mask1.sum(dim=0, keepdim=True)
    # DeepSpeed's top-2 loss counts first choices only, scaled by E^2 over the mean.
    l_aux = torch.mean(gates.mean(dim=0) * mask1.float().mean(dim=0)) * num_experts * num_experts
    exp_counts = (mask1 + mask2).sum(dim=0).detach()
    if drop_tokens:
        capacity = capacity_for(num_tokens, num_experts, capacity_factor * 2, min_capacity)
        mask1 = mask1 * torch.lt(locations1, capacity)
        mask2 = mask2 * torch.lt(locations2, capacity)
    else:
        capacity = _no_drop_capacity(exp_counts)
    slots = torch.stack([(locations1 * mask1).sum(dim=1), (locations2 * mask2).sum(dim=1)])
    weight1 = (gates * mask1.float()).sum(dim=1)
    weight2 = (gates * mask2.float()).sum(dim=1)
    denom = torch.clamp(weight1 + weight2, min=torch.finfo(weight1.dtype).eps)
    weights = torch.stack([weight1 / denom, weight2 / denom])
    experts = torch.stack([torch.where(mask1.any(dim=1), first, torch.full_like(first, -1)),
                           torch.where(mask2.any(dim=1), second, torch.full_like(second, -1))])
    return Routes(experts, slots, weights, capacity, l_aux, exp_counts)
