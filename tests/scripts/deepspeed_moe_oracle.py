"""Record DeepSpeed's MoE layer as the oracle for `tests/test_moe.py` (`specs/moe.md` §DeepSpeed as the oracle).

Run under a venv with DeepSpeed 0.19.8 and torch (CPU is enough; no process group is needed at ep_size 1):

    DS_BUILD_OPS=0 pip install deepspeed==0.19.8
    python tests/scripts/deepspeed_moe_oracle.py tests/data/moe_deepspeed.safetensors

The weights, inputs and upstream gradient are drawn here once (float64) and stored beside DeepSpeed's
outputs, `l_aux`, `exp_counts` and the gradients of the input and the gate, so the test needs no DeepSpeed.
Randomness is off (use_rts=False, no noisy gate policy, top2_2nd_expert_sampling=False): the cases are
deterministic.
"""

from __future__ import annotations

import itertools
import json
import sys

import torch
from safetensors.torch import save_file

HIDDEN, FFN, EXPERTS, BATCH, SEQ = 8, 12, 4, 2, 6


def expert_mlp() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(HIDDEN, FFN), torch.nn.GELU(), torch.nn.Linear(FFN, HIDDEN))


def cases():
    for k, drop, use_residual, training in itertools.product((1, 2), (True, False), (False, True), (True, False)):
        for cf, min_cap in itertools.product((1.0, 1.5, 2.0) if drop else (1.0,), (0, 4)):
            # The factor of the other mode is set apart, so a layer that reads the wrong one differs.
            train_cf, eval_cf = (cf, 3.0) if training else (3.0, cf)
            yield dict(k=k, drop_tokens=drop, use_residual=use_residual, training=training,
                       capacity_factor=train_cf, eval_capacity_factor=eval_cf, min_capacity=min_cap)


def main(out_path: str) -> None:
    from deepspeed.moe.layer import MoE

    g = torch.Generator().manual_seed(1234)
    tensors = {
        "x": torch.randn(BATCH, SEQ, HIDDEN, generator=g, dtype=torch.float64),
        "upstream": torch.randn(BATCH, SEQ, HIDDEN, generator=g, dtype=torch.float64),
        # Uneven load on these inputs (top-1 counts 3, 1, 5, 3), so capacity factor 1.0 drops tokens;
        # 12 tokens over 4 experts make min_capacity 4 exceed the top-1 capacity 3 at factor 1.0.
        "gate": torch.randn(EXPERTS, HIDDEN, generator=g, dtype=torch.float64)
        + torch.tensor([1.0, 0.0, -0.3, 0.2], dtype=torch.float64)[:, None],
        "coefficient.weight": torch.randn(2, HIDDEN, generator=g, dtype=torch.float64) * 0.3,
        "coefficient.bias": torch.randn(2, generator=g, dtype=torch.float64) * 0.3,
    }
    for name in ("mlp", *(f"expert{i}" for i in range(EXPERTS))):
        shapes = (("0.weight", (FFN, HIDDEN)), ("0.bias", (FFN,)), ("2.weight", (HIDDEN, FFN)), ("2.bias", (HIDDEN,)))
        for key, shape in shapes:
            tensors[f"{name}.{key}"] = torch.randn(*shape, generator=g, dtype=torch.float64) * 0.4
    meta = []
    for i, case in enumerate(cases()):
        torch.manual_seed(0)
        layer = MoE(HIDDEN, expert_mlp(), num_experts=EXPERTS, ep_size=1, k=case["k"],
                    capacity_factor=case["capacity_factor"], eval_capacity_factor=case["eval_capacity_factor"],
                    min_capacity=case["min_capacity"], use_residual=case["use_residual"], noisy_gate_policy=None,
                    drop_tokens=case["drop_tokens"], use_rts=False, top2_2nd_expert_sampling=False).double()
        state = {"deepspeed_moe.gate.wg.weight": tensors["gate"]}
        for e in range(EXPERTS):
            for key in ("0.weight", "0.bias", "2.weight", "2.bias"):
                state[f"deepspeed_moe.experts.deepspeed_experts.{e}.{key}"] = tensors[f"expert{e}.{key}"]
        if case["use_residual"]:
            for key in ("0.weight", "0.bias", "2.weight", "2.bias"):
                state[f"mlp.{key}"] = tensors[f"mlp.{key}"]
            state["coefficient.weight"] = tensors["coefficient.weight"]
            state["coefficient.bias"] = tensors["coefficient.bias"]
        layer.load_state_dict(state, strict=True)
        layer.train(case["training"])
        x = tensors["x"].clone().requires_grad_(True)
        out, l_aux, exp_counts = layer(x)
        ((out * tensors["upstream"]).sum() + l_aux).backward()
        tensors[f"{i}.out"] = out.detach()
        tensors[f"{i}.l_aux"] = l_aux.detach().reshape(1)
        tensors[f"{i}.exp_counts"] = exp_counts.detach()
        tensors[f"{i}.x_grad"] = x.grad
        tensors[f"{i}.gate_grad"] = layer.deepspeed_moe.gate.wg.weight.grad
        meta.append(case)
    save_file({k: v.contiguous() for k, v in tensors.items()}, out_path,
              metadata={"cases": json.dumps(meta), "deepspeed": __import__("deepspeed").__version__,
                        "torch": torch.__version__})
    print(f"{len(meta)} cases -> {out_path}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "tests/data/moe_deepspeed.safetensors")
