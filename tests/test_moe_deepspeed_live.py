"""fnzero.moe.MoE against DeepSpeed 0.19.8's own MoE layer, live, as a hypothesis property over shapes
(`specs/moe.md` §DeepSpeed as the oracle).

`tests/test_moe.py` compares 64 recorded cases on one shape and needs no DeepSpeed. This test draws
the shape too (tokens, hidden size, experts, k, capacity factors, min_capacity, dropping, residual,
training or eval) and runs both layers on the same weights and inputs; it needs DeepSpeed importable
(`DS_BUILD_OPS=0 pip install deepspeed==0.19.8`, CPU is enough) and is skipped where it is not, as in
the test extra (DeepSpeed's sdist builds for about a minute).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fnzero.moe import MoE

deepspeed_layer = pytest.importorskip("deepspeed.moe.layer", reason="DeepSpeed is not importable here")


def _expert(hidden: int) -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(hidden, 2 * hidden), torch.nn.GELU(), torch.nn.Linear(2 * hidden, hidden))


# Enough tokens per call that capacity binds (factors below 1 drop tokens at every shape drawn).
def _twin_layers(hidden: int, kw: dict, g: torch.Generator):
    """fnzero's layer and DeepSpeed's, with the same float64 weights drawn from `g`."""
    ours = MoE(hidden, _expert(hidden), **kw).double()
    theirs = deepspeed_layer.MoE(hidden, _expert(hidden), ep_size=1, noisy_gate_policy=None, **kw).double()
    with torch.no_grad():
        for p in ours.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype))
    theirs.load_state_dict(ours.state_dict(), strict=True)
    return ours, theirs


@settings(max_examples=60, deadline=None)
@given(batch=st.integers(1, 3), seq=st.integers(4, 12), hidden=st.integers(1, 8), experts=st.integers(2, 6),
       k=st.sampled_from([1, 2]), factor=st.sampled_from([0.25, 0.5, 1.0, 1.5]), eval_factor=st.sampled_from([0.5, 3.0]),
       min_capacity=st.sampled_from([0, 1, 4]), drop=st.booleans(), residual=st.booleans(), training=st.booleans(),
       seed=st.integers(0, 2**16))
def test_equals_deepspeed_over_shapes(batch, seq, hidden, experts, k, factor, eval_factor, min_capacity, drop, residual,
                                      training, seed):
    tokens = batch * seq
    if k > experts or tokens < min_capacity:
        return  # both refuse these (k > num_experts; DeepSpeed asserts tokens >= min_capacity, fnzero raises)
    kw = dict(num_experts=experts, k=k, capacity_factor=factor, eval_capacity_factor=eval_factor,
              min_capacity=min_capacity, use_residual=residual, drop_tokens=drop, use_rts=False,
              top2_2nd_expert_sampling=False)
    ours, theirs = _twin_layers(hidden, kw, g := torch.Generator().manual_seed(seed))
    ours.train(training)
    theirs.train(training)
    x = torch.randn(batch, seq, hidden, generator=g, dtype=torch.float64)
    up = torch.randn(batch, seq, hidden, generator=g, dtype=torch.float64)
    results = []
    for layer in (ours, theirs):
        xi = x.clone().requires_grad_(True)
        out, l_aux, counts = layer(xi)
        ((out * up).sum() + l_aux).backward()
        results.append((out.detach(), l_aux.detach(), counts, xi.grad, layer.deepspeed_moe.gate.wg.weight.grad))
    (o1, a1, c1, gx1, gw1), (o2, a2, c2, gx2, gw2) = results
    assert torch.equal(c1.long(), c2.long())
    for got, want in ((o1, o2), (a1, a2), (gx1, gx2), (gw1, gw2)):
        torch.testing.assert_close(got, want.to(got.dtype), rtol=1e-12, atol=1e-12)


# DeepSpeed's top-1 without dropping takes its capacity from the float counts a float mask makes and
# hands torch.topk a tensor k (a TypeError): there its bool mask, the same tokens, is the oracle.
@settings(max_examples=30, deadline=None)
@given(tokens=st.integers(4, 16), hidden=st.integers(1, 6), experts=st.integers(2, 5), k=st.sampled_from([1, 2]),
       factor=st.sampled_from([0.5, 1.0, 2.0]), drop=st.booleans(), dtype=st.sampled_from([torch.float32, torch.float64]),
       seed=st.integers(0, 2**16), data=st.data())
def test_a_float_used_token_mask_equals_deepspeed(tokens, hidden, experts, k, factor, drop, dtype, seed, data):
    """specs/moe.md §Gating: a float 0/1 `used_token` masks top-1 routing as DeepSpeed's, top-2 ignores it."""
    if k > experts:
        return
    kw = dict(num_experts=experts, k=k, capacity_factor=factor, min_capacity=0, drop_tokens=drop, use_rts=False,
              top2_2nd_expert_sampling=False)
    ours, theirs = _twin_layers(hidden, kw, g := torch.Generator().manual_seed(seed))
    mask = torch.tensor(data.draw(st.lists(st.sampled_from([0, 1]), min_size=tokens, max_size=tokens)), dtype=dtype)
    x = torch.randn(tokens, hidden, generator=g, dtype=torch.float64)
    results = []
    for layer, used in ((ours, mask), (theirs, mask.bool() if k == 1 and not drop else mask)):
        xi = x.clone().requires_grad_(True)
        out, l_aux, counts = layer(xi, used)
        ((out * x).sum() + l_aux).backward()
        results.append((out.detach(), l_aux.detach(), counts, xi.grad, layer.deepspeed_moe.gate.wg.weight.grad))
    (o1, a1, c1, gx1, gw1), (o2, a2, c2, gx2, gw2) = results
    assert torch.equal(c1, c2.long())
    for got, want in ((o1, o2), (a1, a2), (gx1, gx2), (gw1, gw2)):
        torch.testing.assert_close(got, want.to(got.dtype), rtol=1e-12, atol=1e-12)
