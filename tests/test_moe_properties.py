"""fnzero.moe.MoE's invariants over shapes, its randomness and its refusals (`specs/moe.md`)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fnzero import ConfigError
from fnzero.moe import MoE, capacity_for


def _layer(hidden, experts, k, **kw) -> MoE:
    g = torch.Generator().manual_seed(7)
    expert = torch.nn.Sequential(torch.nn.Linear(hidden, 2 * hidden), torch.nn.Tanh(),
                                 torch.nn.Linear(2 * hidden, hidden))
    layer = MoE(hidden, expert, num_experts=experts, k=k, generator=torch.Generator().manual_seed(1), **kw).double()
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype))
    return layer


def _per_token(layer: MoE, x: torch.Tensor, routes) -> torch.Tensor:
    """The layer's output computed token by token: no buffers, slots or capacity, only the routes."""
    experts = layer.deepspeed_moe.experts.deepspeed_experts
    rows = []
    for t in range(x.shape[0]):
        row = torch.zeros_like(x[t])
        for e, w in zip(routes.experts[:, t].tolist(), routes.weights[:, t]):
            if e >= 0:
                row = row + w * experts[e](x[t])
        rows.append(row)
    return torch.stack(rows)


@settings(max_examples=25, deadline=None)
@given(tokens=st.integers(1, 24), hidden=st.integers(1, 6), experts=st.integers(2, 6), k=st.sampled_from([1, 2]),
       factor=st.sampled_from([0.25, 0.5, 1.0, 1.5, 3.0]), drop=st.booleans(), seed=st.integers(0, 2**16))
def test_routing_invariants(tokens, hidden, experts, k, factor, drop, seed):
    """Counts sum to tokens x k before dropping; no expert past capacity, each slot used once; nothing
    dropped without drop_tokens; kept weights sum to 1 (top-2) or are the chosen probability (top-1);
    the output is the per-token weighted sum of its experts; gradients reach the gate and every expert used."""
    layer = _layer(hidden, experts, k, capacity_factor=factor, min_capacity=0, drop_tokens=drop, use_rts=True)
    x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    state = layer.generator.get_state()
    routes = layer.deepspeed_moe.gate(x, layer.generator)
    layer.generator.set_state(state)
    out, l_aux, exp_counts = layer(x)
    assert int(exp_counts.sum()) == tokens * k
    if drop:
        assert routes.capacity == capacity_for(tokens, experts, factor * k, 0)
    else:
        assert bool((routes.experts >= 0).all()) and routes.capacity == int(exp_counts.max())
    for e in range(experts):
        slots = routes.slots[routes.experts == e]
        assert len(slots) <= routes.capacity and len(set(slots.tolist())) == len(slots)
        assert bool((slots >= 0).all() and (slots < routes.capacity).all())
    kept = routes.experts >= 0
    assert bool((routes.weights[~kept] == 0).all())
    if k == 2:
        any_kept = kept.any(dim=0)
        torch.testing.assert_close(routes.weights.sum(0)[any_kept], torch.ones(int(any_kept.sum())), rtol=0, atol=1e-6)
    else:
        probs = torch.softmax(x.float() @ layer.deepspeed_moe.gate.wg.weight.float().T, dim=1)
        chosen = probs.gather(1, routes.experts.clamp(min=0).T).T
        torch.testing.assert_close(routes.weights[kept], chosen[kept], rtol=0, atol=0)
    torch.testing.assert_close(out, _per_token(layer, x, routes), rtol=1e-12, atol=1e-12)
    (out.sum() + l_aux).backward()
    assert layer.deepspeed_moe.gate.wg.weight.grad.abs().sum() > 0
    for e, expert in enumerate(layer.deepspeed_moe.experts.deepspeed_experts):
        used = bool((routes.experts == e).any())
        assert (expert[0].weight.grad is not None and expert[0].weight.grad.abs().sum() > 0) == used


RANDOM_CASES = {
    "rts": dict(k=1, capacity_factor=0.5, min_capacity=0, use_rts=True),
    "jitter": dict(k=1, noisy_gate_policy="Jitter", use_rts=False, min_capacity=0),
    "rsample": dict(k=1, noisy_gate_policy="RSample", use_rts=False, min_capacity=0),
    "top2_second_sampling": dict(k=2, top2_2nd_expert_sampling=True),
}


@pytest.mark.parametrize("case", RANDOM_CASES)
def test_randomness_comes_from_the_generator(case):
    """specs/moe.md §Randomness: the same generator state gives the same result, another seed another;
    torch's global RNG is neither read nor advanced."""
    layer = _layer(4, 4, **RANDOM_CASES[case])
    x = torch.randn(32, 4, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    global_rng = torch.get_rng_state()
    runs = []
    for seed in (5, 5, 6):
        layer.generator = torch.Generator().manual_seed(seed)
        runs.append(layer(x)[0])
    assert torch.equal(torch.get_rng_state(), global_rng)
    assert torch.equal(runs[0], runs[1]) and not torch.equal(runs[0], runs[2])


@pytest.mark.parametrize("policy", ["Jitter", "RSample"])
def test_noisy_gate_policies_act_in_training_only(policy):
    x = torch.randn(16, 4, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    noisy = _layer(4, 4, 1, noisy_gate_policy=policy, use_rts=False).eval()
    plain = _layer(4, 4, 1, use_rts=False).eval()
    assert torch.equal(noisy(x)[0], plain(x)[0])


@pytest.mark.parametrize("kwargs, words", [
    (dict(ep_size=3, num_experts=4), "num_experts=4 is not divisible by ep_size=3"),
    (dict(ep_size=0, num_experts=4), "ep_size=0 must be a positive integer"),
    (dict(enable_expert_tensor_parallelism=True), "expert tensor parallelism is not built yet"),
    (dict(k=3, num_experts=4), "k=3"),
    (dict(k=2, num_experts=1), "k=2 exceeds num_experts=1"),
    (dict(capacity_factor=0.0), "capacity_factor=0.0"),
    (dict(eval_capacity_factor=-1.0), "eval_capacity_factor=-1.0"),
    (dict(min_capacity=-1), "min_capacity=-1"),
    (dict(noisy_gate_policy="Gaussian"), "noisy_gate_policy='Gaussian'"),
])
def test_bad_arguments_are_refused(kwargs, words):
    with pytest.raises(ConfigError, match=words.replace("(", r"\(")):
        MoE(4, torch.nn.Linear(4, 4), **{"num_experts": 2, **kwargs})


def test_bad_inputs_are_refused():
    layer = MoE(4, torch.nn.Linear(4, 4), num_experts=2, min_capacity=4)
    with pytest.raises(ConfigError, match="3 tokens, fewer than min_capacity=4"):
        layer(torch.randn(3, 4))
    with pytest.raises(ConfigError, match="last dimension is 5, hidden_size is 4"):
        layer(torch.randn(8, 5))


def test_parameter_names_are_deepspeeds():
    """specs/moe.md §Parameters: DeepSpeed's state_dict names; the residual MLP is the module passed in."""
    expert = torch.nn.Linear(4, 4)
    layer = MoE(4, expert, num_experts=2, use_residual=True)
    assert sorted(layer.state_dict()) == sorted([
        "deepspeed_moe.gate.wg.weight", "coefficient.weight", "coefficient.bias", "mlp.weight", "mlp.bias",
        *(f"deepspeed_moe.experts.deepspeed_experts.{i}.{p}" for i in range(2) for p in ("weight", "bias"))])
    assert layer.mlp is expert and layer.deepspeed_moe.experts.deepspeed_experts[0] is not expert
    assert torch.equal(layer.deepspeed_moe.experts.deepspeed_experts[1].weight, expert.weight)


@pytest.mark.parametrize("reentrant", [False, True])
def test_checkpointing_a_layer_that_draws_is_refused_and_one_that_does_not_is_exact(reentrant):
    """specs/moe.md §Randomness: a recomputation would draw other routes, so it is refused; with the
    randomness off the checkpointed layer's gradients equal the plain ones."""
    from torch.utils.checkpoint import checkpoint

    def grads(layer, x, ckpt):
        x = x.clone().requires_grad_(True)
        out = checkpoint(lambda t: layer(t)[0], x, use_reentrant=reentrant) if ckpt else layer(x)[0]
        out.square().sum().backward()
        return [x.grad] + [p.grad for p in layer.parameters()]

    x = torch.randn(8, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    with pytest.raises(ConfigError, match="run again inside backward"):
        grads(_layer(6, 4, 1, use_rts=True), x, True)
    plain, ckpt = (_layer(6, 4, 1, use_rts=False) for _ in range(2))
    ckpt.load_state_dict(plain.state_dict())
    for g, h in zip(grads(plain, x, False), grads(ckpt, x, True)):
        torch.testing.assert_close(h, g, rtol=0, atol=0)
