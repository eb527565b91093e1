"""`used_token`, the MoE layer's mask of the tokens that take part in routing, in every dtype
DeepSpeed's layer takes it (`specs/moe.md` §Gating, `used_token`).

DeepSpeed multiplies its top-1 route mask by the mask, so a bool, integer or float mask of zeros and
ones masks the same tokens; fnzero gives the same outputs and gradients, to the bit, whatever the
mask's dtype (a float mask is what a bf16/fp16 `ShardedModule.apply` hands the layer: it casts every
floating argument to the compute dtype). Other values are refused. Top-2 ignores the mask, as there.
"""

from __future__ import annotations

import pytest
import torch

from fnzero import ConfigError
from fnzero.moe import MoE
from fnzero.testing import simulated_world

HIDDEN, EXPERTS, TOKENS = 4, 4, 12
MASK = [1, 0, 1, 1, 0, 1, 1, 1, 0, 1, 1, 0]
DTYPES = [torch.bool, torch.int32, torch.int64, torch.float32, torch.float64, torch.bfloat16, torch.float16]


def _layer(k: int, drop: bool, ep_size: int = 1) -> MoE:
    """Experts that differ, random token selection on (its generator reseeded per run, so every
    run draws the same), float64."""
    g = torch.Generator().manual_seed(7)
    expert = torch.nn.Sequential(torch.nn.Linear(HIDDEN, 2 * HIDDEN), torch.nn.Tanh(), torch.nn.Linear(2 * HIDDEN, HIDDEN))
    layer = MoE(HIDDEN, expert, num_experts=EXPERTS, ep_size=ep_size, k=k, capacity_factor=0.5, min_capacity=0,
                drop_tokens=drop, use_rts=True, generator=torch.Generator()).double()
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype))
    return layer


def _run(layer: MoE, x: torch.Tensor, used_token: torch.Tensor | None):
    """Output, l_aux, exp_counts and every gradient (input and parameters) of one forward and backward."""
    layer.generator.manual_seed(3)
    layer.zero_grad(set_to_none=True)
    xi = x.clone().requires_grad_(True)
    out, l_aux, counts = layer(xi, used_token)
    up = torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)
    ((out * up).sum() + l_aux).backward()
    grads = {n: p.grad for n, p in layer.named_parameters() if p.grad is not None}
    return out.detach(), l_aux.detach(), counts, xi.grad, grads


def _assert_same(got, want) -> None:
    (o1, a1, c1, gx1, gp1), (o2, a2, c2, gx2, gp2) = got, want
    assert c1.dtype == torch.int64 and torch.equal(c1, c2)
    assert torch.equal(o1, o2) and torch.equal(a1, a2) and torch.equal(gx1, gx2)
    assert gp1.keys() == gp2.keys() and all(torch.equal(gp1[n], gp2[n]) for n in gp1)


@pytest.mark.parametrize("drop", [True, False])
@pytest.mark.parametrize("k", [1, 2])
def test_a_mask_of_any_dtype_routes_as_the_bool_mask(k, drop):
    x = torch.randn(2, TOKENS // 2, HIDDEN, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    layer = _layer(k, drop)
    want = _run(layer, x, torch.tensor(MASK, dtype=torch.bool))
    for dtype in DTYPES:
        _assert_same(_run(layer, x, torch.tensor(MASK, dtype=dtype)), want)
    unmasked = _run(layer, x, None)
    if k == 1:  # the mask acts: masked tokens get no expert's output
        assert int(want[2].sum()) == sum(MASK) and int(unmasked[2].sum()) == TOKENS
        assert not want[0].reshape(TOKENS, HIDDEN)[torch.tensor(MASK) == 0].any()
    else:  # DeepSpeed's top-2 ignores used_token
        _assert_same(want, unmasked)


@pytest.mark.parametrize("k", [1, 2])
def test_a_float_mask_routes_as_the_bool_mask_with_experts_split_over_two_ranks(k):
    """At ep 2 each rank routes its own tokens under its own mask; the float mask's run is the bool
    mask's on every rank, the all-to-alls included."""
    def rank(comm):
        layer = _layer(k, drop=False, ep_size=2)
        layer.deepspeed_moe.experts.split_experts(comm)
        g = torch.Generator().manual_seed(10 + comm.rank)
        x = torch.randn(TOKENS, HIDDEN, generator=g, dtype=torch.float64)
        mask = torch.tensor(MASK[comm.rank:] + MASK[:comm.rank])  # the ranks mask different tokens
        want = _run(layer, x, mask.bool())
        _assert_same(_run(layer, x, mask.float()), want)
        _assert_same(_run(layer, x, mask.to(torch.bfloat16)), want)
        return want[2]

    counts = simulated_world(2).run(rank)
    if k == 1:
        assert [int(c.sum()) for c in counts] == [sum(MASK)] * 2


@pytest.mark.parametrize("ranks_masking_all", [(0,), (0, 1)])
@pytest.mark.parametrize("drop", [True, False])
def test_a_mask_that_leaves_out_every_token_gives_zeros(drop, ranks_masking_all):
    """Without dropping, such a call's capacity is 0 (DeepSpeed's too, whose layer returns zeros); at ep 2
    the other rank may still route its tokens, or have none either (the group's capacity then 0 as well)."""
    def rank(comm):
        layer = _layer(1, drop=drop, ep_size=2)
        layer.deepspeed_moe.experts.split_experts(comm)
        x = torch.randn(TOKENS, HIDDEN, generator=torch.Generator().manual_seed(10 + comm.rank), dtype=torch.float64)
        none = comm.rank in ranks_masking_all
        out, _, counts, grad_x, _ = _run(layer, x, torch.zeros(TOKENS) if none else torch.ones(TOKENS))
        assert out.shape == x.shape and grad_x.shape == x.shape
        assert (int(counts.sum()), bool(out.any())) == ((0, False) if none else (TOKENS, True))

    simulated_world(2).run(rank)
    layer = _layer(1, drop=drop)
    out, _, counts, _, _ = _run(layer, torch.ones(TOKENS, HIDDEN, dtype=torch.float64), torch.zeros(TOKENS))
    assert not out.any() and not counts.any()


@pytest.mark.parametrize("values, words", [
    ([0.5] * TOKENS, "used_token must hold only 0 and 1"),
    ([2] * TOKENS, "used_token must hold only 0 and 1"),
    ([-1.0] * TOKENS, "used_token must hold only 0 and 1"),
    ([float("nan")] * TOKENS, "used_token must hold only 0 and 1"),
    ([1] * (TOKENS - 1), "used_token has 11 elements, one per token: 12"),
])
def test_a_mask_that_is_not_zeros_and_ones_per_token_is_refused(values, words):
    """DeepSpeed multiplies its one-hot route mask by the mask: other values give fractional or
    colliding capacity slots (a mask of 0.5 puts two tokens in one slot, one of 2 indexes past the
    buffer), so fnzero refuses them rather than route by a meaningless mask."""
    layer = _layer(1, drop=True)
    with pytest.raises(ConfigError, match=words):
        layer(torch.zeros(TOKENS, HIDDEN, dtype=torch.float64), torch.tensor(values))
