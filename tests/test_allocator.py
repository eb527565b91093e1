"""The host allocator policy (`fnzero.memory.return_freed_memory`, specs/sharding.md §Memory):
applied by `init_distributed`, and under it CPU steps trim the heap between forward and backward."""

import dataclasses
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import fnzero
from fnzero._ext import _heap as heap
from fnzero.testing import GPT

glibc_only = pytest.mark.skipif(heap._glibc() is None, reason="the policy is glibc's mallopt/malloc_trim")


@glibc_only
@pytest.mark.parametrize("threshold, applied", [("4 << 20", True), ("None", False), ("0", False)])
def test_init_distributed_applies_the_policy_unless_opted_out(threshold, applied):
    code = (
        "import fnzero\nfrom fnzero._ext._heap import heap_is_tuned\n"
        f"fnzero.init_distributed(malloc_mmap_threshold={threshold})\n"
        "print(heap_is_tuned())\n"
    )
    # A world of one, whatever launched the test suite.
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK") and not k.startswith("SLURM_")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str(applied)


@pytest.mark.parametrize("stage, trim_heap", [(0, True), (3, True), (3, False)])
def test_cpu_step_trims_between_forward_and_backward(monkeypatch, stage, trim_heap):
    events = []
    monkeypatch.setattr(heap, "_TUNED", True)
    monkeypatch.setattr(heap, "trim_freed_memory", lambda: events.append("trim"))
    torch.manual_seed(0)
    cfg = fnzero.load_config({
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
    })
    sm = fnzero.shard(GPT(vocab_size=50, seq_len=8, d_model=16, n_layer=2, n_head=2), config=cfg)
    state = sm.init_state()
    events.clear()

    def loss_fn(p, b):
        logits = sm.apply(p, b[:, :-1])
        events.append("forward")
        logits.register_hook(lambda g: events.append("backward"))
        return F.cross_entropy(logits.flatten(0, 1), b[:, 1:].flatten())

    step = fnzero.train_step(loss_fn, cfg)
    step.policy = dataclasses.replace(step.policy, trim_heap=trim_heap)  # the policy's opt-out
    step(state, torch.randint(0, 50, (4, 9)))
    assert events == (["forward", "trim", "backward"] if trim_heap else ["forward", "backward"]) * 2  # per micro-batch


def test_no_trim_without_the_policy(monkeypatch):
    calls = []
    monkeypatch.setattr(heap, "_TUNED", False)
    monkeypatch.setattr(heap, "trim_freed_memory", lambda: calls.append(1))
    heap.trim_between_passes()
    assert calls == []
