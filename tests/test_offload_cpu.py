"""ZeRO-Offload (specs/offload.md §CPU): the optimizer step on the host through the C kernels,
with unscale, clip coefficient and 16-bit copy-out fused, equals the in-memory step."""

import pytest
import torch

import _worlds as W
import fnzero
from fnzero._ext import _lib
from fnzero.testing._threads import simulated_world


def _run(stage, precision, offload, donate=False, world=2, steps=4):
    extra = {"zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}
    if offload:
        extra["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    return simulated_world(world).run(
        lambda comm: W.train_fnzero("gpt", stage, steps, comm, k=2, dtype=torch.float32, precision=precision,
                                    extra=extra, donate=donate)
    )[0]


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_offloaded_step_equals_in_memory_step(stage, precision):
    ref = _run(stage, precision, offload=False)
    got = _run(stage, precision, offload=True)
    # Same math, two fp32 Adam kernels (torch's fused and fnzero's C): a few ulp per step, which
    # Adam turns into at most ~1e-5 absolute on near-zero-gradient parameters over 4 steps at lr 1e-2.
    assert got["losses"] == pytest.approx(ref["losses"], rel=1e-5)
    # In fp16 the key bias, whose gradient is rounding noise, moves with the kernels' roundings.
    W.assert_close_tree(W.without_key_bias(got["params"]), W.without_key_bias(ref["params"]), rtol=1e-4, atol=5e-5,
                        what=f"offload stage {stage} {precision}")


@pytest.mark.parametrize("stage", [1, 3])
def test_offload_donated_equals_pure_and_fallback_equals_c(stage, monkeypatch):
    pure = _run(stage, "bf16", offload=True)
    donated = _run(stage, "bf16", offload=True, donate=True)
    W.assert_close_tree(donated["params"], pure["params"], rtol=0, atol=0, what="donate")
    monkeypatch.setattr(_lib, "available", lambda: False)  # the pure-torch kernels, same numbers
    fallback = _run(stage, "bf16", offload=True)
    W.assert_close_tree(fallback["params"], pure["params"], rtol=0, atol=0, what="fallback")


def test_offload_rejects_optimizers_without_a_host_kernel():
    cfg = fnzero.load_config({
        "train_micro_batch_size_per_gpu": 1,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
    })
    with pytest.raises(fnzero.ConfigError, match="Adam, AdamW, Adagrad and Lion"):
        fnzero.train_step(lambda p, b: None, cfg)
