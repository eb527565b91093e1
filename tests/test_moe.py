"""fnzero.moe.MoE against DeepSpeed 0.19.8's recorded outputs, and its invariants (`specs/moe.md`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from fnzero import ConfigError
from fnzero.moe import MoE

ORACLE = Path(__file__).parent / "data" / "moe_deepspeed.safetensors"
HIDDEN, FFN, EXPERTS = 8, 12, 4


def _oracle():
    with safe_open(str(ORACLE), "pt") as f:
        meta = f.metadata()
    return load_file(str(ORACLE)), json.loads(meta["cases"])


TENSORS, CASES = _oracle()


def _expert_mlp() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(HIDDEN, FFN), torch.nn.GELU(), torch.nn.Linear(FFN, HIDDEN))


def _layer_from_oracle(case) -> MoE:
    layer = MoE(HIDDEN, _expert_mlp(), num_experts=EXPERTS, k=case["k"], capacity_factor=case["capacity_factor"],
                eval_capacity_factor=case["eval_capacity_factor"], min_capacity=case["min_capacity"],
                use_residual=case["use_residual"], drop_tokens=case["drop_tokens"], use_rts=False,
                top2_2nd_expert_sampling=False).double()
    state = {"deepspeed_moe.gate.wg.weight": TENSORS["gate"]}
    keys = ("0.weight", "0.bias", "2.weight", "2.bias")
    for e in range(EXPERTS):
        state.update({f"deepspeed_moe.experts.deepspeed_experts.{e}.{k}": TENSORS[f"expert{e}.{k}"] for k in keys})
    if case["use_residual"]:
        state.update({f"mlp.{k}": TENSORS[f"mlp.{k}"] for k in keys})
        state.update({k: TENSORS[k] for k in ("coefficient.weight", "coefficient.bias")})
    layer.load_state_dict(state, strict=True)  # DeepSpeed's parameter names, unchanged
    return layer.train(case["training"])


def test_oracle_covers_dropping():
    """The recorded grid drops tokens in some cases and not in others, so capacity is exercised."""
    routed = [int(TENSORS[f"{i}.exp_counts"].max()) for i in range(len(CASES))]
    assert len(CASES) == 64 and max(routed) > 4


@pytest.mark.parametrize("i", range(len(CASES)), ids=lambda i: "-".join(f"{k}={v}" for k, v in CASES[i].items()))
def test_equals_deepspeed(i):
    """specs/moe.md §DeepSpeed as the oracle: outputs, l_aux, exp_counts and gradients as DeepSpeed's."""
    case = CASES[i]
    layer = _layer_from_oracle(case)
    x = TENSORS["x"].clone().requires_grad_(True)
    out, l_aux, exp_counts = layer(x)
    ((out * TENSORS["upstream"]).sum() + l_aux).backward()
    assert torch.equal(exp_counts, TENSORS[f"{i}.exp_counts"])
    # The router computes in float32, as DeepSpeed's: its matmul's summation order is the CPU's SIMD
    # kernel's, so on another processor than the recording one the gates (and everything they
    # weigh) move by float32 rounding, 1e-7 here. 1e-6 is that noise; a wrong route, capacity or
    # weight is O(0.1). On one machine the live test (test_moe_deepspeed_live.py) holds 1e-12.
    tol = dict(rtol=0, atol=1e-6)
    torch.testing.assert_close(out, TENSORS[f"{i}.out"], **tol)
    torch.testing.assert_close(l_aux.reshape(1), TENSORS[f"{i}.l_aux"], **tol)
    torch.testing.assert_close(x.grad, TENSORS[f"{i}.x_grad"], **tol)
    torch.testing.assert_close(layer.deepspeed_moe.gate.wg.weight.grad, TENSORS[f"{i}.gate_grad"], **tol)
