"""ZeRO++'s quantized communication measured: fnzero.testing's GPT at ZeRO stage 3 in bf16, trained
unquantized (the baseline, first row), with qwZ (`zero_quantized_weights`), with qgZ
(`zero_quantized_gradients`) and with both (specs/collectives.md §Quantized collectives).

`measure(comm, steps, warmup)` runs on every rank of a world (`comm` is this rank's `Collectives`)
and returns one row per configuration:

* `bytes_per_step`: ring-equivalent bytes this rank sent per step, counted by a `RecordingCollectives`
  around `comm` over the `steps` measured steps (after `warmup` steps, which also teach stage 3 its
  gather order);
* `formula_bytes`: the same from the plan: per unit of shard s elements, one gather and one gradient
  reduce-scatter per step (every unit of this model stays gathered for its backward at DeepSpeed's
  default `stage3_max_reuse_distance`), `(N−1)·s·2` bytes each in bf16, `(N−1)·(s + 4⌈s/4096⌉)`
  quantized, plus the step's float64 [norm², loss] all-reduce, `16·2(N−1)/N`;
* `step_s`: the median wall time of a measured step; `loss`: the mean training loss of the last
  ten steps (the same batches in every configuration).

Also runnable by hand: `python benchmarks/comm_opt_zeropp.py [steps] [world]` (a simulated world).
"""

from __future__ import annotations

import math
import statistics
import sys
import time

import torch

import fnzero
from fnzero.testing import GPT, seeded, token_batches

FEATURE = "zeropp"

MODEL = dict(vocab_size=256, seq_len=64, d_model=128, n_layer=4, n_head=4)
MICRO = 4
BLOCK = 4096  # BlockQuantizer's default block (the config's keys use it)
CONFIGS = (
    ("stage3 bf16 (unquantized)", {}),
    ("stage3 bf16 + qwZ", {"zero_quantized_weights": True}),
    ("stage3 bf16 + qgZ", {"zero_quantized_gradients": True}),
    ("stage3 bf16 + qwZ + qgZ", {"zero_quantized_weights": True, "zero_quantized_gradients": True}),
)


def _config(world: int, zero: dict):
    return fnzero.load_config({
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_clipping": 1.0,
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.0}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, **zero},
    }, world_size=world)


def formula_bytes(plan, world: int, weights: bool, gradients: bool, itemsize: int = 2) -> float:
    """Ring-equivalent bytes one rank sends per step (see the module docstring)."""
    def moved(s: int, quantized: bool) -> int:
        return (world - 1) * ((s + 4 * math.ceil(s / BLOCK)) if quantized else s * itemsize)

    if world == 1:
        return 0.0
    units = [u.shard_numel for u in plan.units]
    return float(sum(moved(s, weights) + moved(s, gradients) for s in units) + 16 * 2 * (world - 1) / world)


def _run(comm, zero: dict, steps: int, warmup: int) -> dict:
    cfg = _config(comm.world_size, zero)
    rec = fnzero.RecordingCollectives(comm)
    with seeded(0):  # the same initial model in every configuration and on every rank
        model = GPT(**MODEL)
    sm = fnzero.shard(model, config=cfg, comm=rec)
    state = sm.init_state()
    device = sm.sharding.device

    def loss_fn(params, batch):
        logits = sm.apply(params, batch["x"].to(device))
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), batch["y"].to(device).flatten())

    step = fnzero.train_step(loss_fn, cfg, donate=True)
    batches = token_batches(MICRO, MODEL["seq_len"], seed=1000 + comm.rank)
    times, losses, sent = [], [], 0.0
    for i in range(warmup + steps):
        batch = next(batches)
        rec.reset()
        t0 = time.perf_counter()
        state, metrics = step(state, batch)
        loss = float(metrics["loss"])  # a host value: the step is done
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        dt = time.perf_counter() - t0
        records = rec.reset()
        losses.append(loss)
        if i >= warmup:
            times.append(dt)
            sent += rec.ring_bytes_sent(records)
    return {
        "bytes_per_step": sent / max(steps, 1),
        "formula_bytes": formula_bytes(sm.plan, comm.world_size, bool(zero.get("zero_quantized_weights")),
                                       bool(zero.get("zero_quantized_gradients"))),
        "step_s": statistics.median(times) if times else float("nan"),
        "loss": statistics.fmean(losses[-10:]),
    }


def measure(comm, steps: int, warmup: int) -> list[dict]:
    """One row per configuration, the unquantized baseline first (see the module docstring)."""
    return [{"config": name, **_run(comm, zero, steps, warmup)} for name, zero in CONFIGS]


if __name__ == "__main__":
    from fnzero.testing import simulated_world

    n_steps = int(sys.argv[1]) if len(sys.argv) > 1 else 20
    world = int(sys.argv[2]) if len(sys.argv) > 2 else 2
    rows = simulated_world(world).run(lambda comm: measure(comm, n_steps, 2))[0]
    base = rows[0]
    for r in rows:
        print(f"{r['config']:28s} bytes/step {r['bytes_per_step']:>12,.0f} (formula {r['formula_bytes']:>12,.0f}, "
              f"{r['bytes_per_step'] / base['bytes_per_step']:.3f} of baseline)  step {r['step_s'] * 1e3:7.1f} ms  "
              f"loss {r['loss']:.4f} ({(r['loss'] / base['loss'] - 1) * 100:+.2f} %)")
