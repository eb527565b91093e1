"""1-bit Adam, 0/1 Adam and 1-bit LAMB against AdamW on fnzero.testing's GPT: one feature module of
`bench_comm_opt.py`, which calls `measure(comm, steps, warmup)` on every rank.

Each configuration trains the same GPT (fp32, ZeRO stage 0, the same data) for `warmup + steps`
steps on `comm`; the 1-bit optimizers freeze after half of them (`freeze_step`,
`var_freeze_step`; at least `warmup`), and the steps after the freeze are measured. A row per
configuration, AdamW first: `bytes_per_step` (ring-equivalent bytes this rank sends per measured
step, the median, counted by `RecordingCollectives`), `formula_bytes` (specs/collectives.md
§Compressed all-reduce plus the step's norm-and-loss all-reduce of two float64; AdamW: §Traffic's
all-reduce of every unit's padded gradient), `step_s` (median seconds), `loss` (the final loss:
the mean over ranks of the last 10 steps' training loss, on byte-level text from
`fnzero.testing.token_batches`, each rank its own).

Measured once (`measure(comm, 299, 1)` on 2 simulated ranks on CPU: 300 steps, freeze after 150):
loss AdamW 2.4321; OneBitAdam 2.4284 (−0.2 %), ZeroOneAdam 2.4333 (+0.05 %), OneBitLamb 2.3848
(−1.9 %); bytes per step after
the freeze 547,856 (AdamW) against 17,368 (1-bit and 0/1 Adam) and 17,144 (1-bit LAMB): 1/31.5
and 1/32.0.
"""

from __future__ import annotations

import statistics
import time

FEATURE = "onebit"

MODEL = dict(vocab_size=256, seq_len=64, d_model=64, n_layer=2, n_head=4)
MICRO = 4


def _configs(freeze: int) -> list[tuple[str, dict]]:
    """AdamW, then the three 1-bit optimizers freezing after `freeze` steps. Short-run settings of
    theirs: betas (0.9, 0.99), since DeepSpeed's versions do not correct bias and a variance frozen
    after F steps at beta2 0.999 holds 1 - 0.999^F of its value (0.14 at F = 150); 1-bit LAMB at lr
    1e-2 (LAMB's trust ratio wants it: fnzero's Lamb at 1e-3 ends 2x AdamW's loss at 300 steps);
    0/1 Adam updating its variance 64 times before each doubling of the interval (16: too few
    updates before a freeze this early)."""
    adamw = {"lr": 1e-3, "weight_decay": 0.0}
    onebit = {**adamw, "betas": [0.9, 0.99]}
    return [
        ("AdamW", {"type": "AdamW", "params": adamw}),
        ("OneBitAdam", {"type": "OneBitAdam", "params": {**onebit, "freeze_step": freeze}}),
        # 0/1 Adam freezes after the step whose number exceeds var_freeze_step: the same first frozen step.
        ("ZeroOneAdam", {"type": "ZeroOneAdam", "params": {**onebit, "var_freeze_step": freeze - 1,
                                                          "var_update_scaler": 64}}),
        ("OneBitLamb", {"type": "OneBitLamb", "params": {**onebit, "lr": 1e-2, "freeze_step": freeze}}),
    ]


def _formula(name: str, sm, world: int) -> float:
    from fnzero.sharding import compressed_bytes

    scalars = 2 * (world - 1) / world * 16  # the norm-and-loss all-reduce: two float64
    if world == 1:
        return 0.0
    numels = [s.numel for u in sm.plan.units for s in u.slots]
    if name == "AdamW":
        return 2 * (world - 1) / world * 4 * sum(u.padded_numel for u in sm.plan.units) + scalars
    if name == "OneBitLamb":  # one flat buffer of every momentum
        return compressed_bytes([sum(numels)], world, 4) + scalars
    return compressed_bytes(numels, world, 4) + scalars  # 0/1 Adam: one exchange a step (local_step_interval 1)


LAST = 10  # the loss reported: the mean of the last steps' (one batch's loss is noisy)


def _run(name: str, optimizer: dict, comm, total: int, freeze: int) -> dict:
    import torch

    import fnzero
    from fnzero.sharding import RecordingCollectives
    from fnzero.testing import GPT, seeded, token_batches

    rec = RecordingCollectives(comm)
    cfg = fnzero.load_config({"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": 1,
                              "gradient_clipping": 0.0, "zero_optimization": {"stage": 0},
                              "optimizer": optimizer}, world_size=comm.world_size)
    with seeded(0):
        model = GPT(**MODEL)
    sm = fnzero.shard(model, config=cfg, comm=rec)
    state = sm.init_state()

    def loss_fn(params, batch):
        logits = sm.apply(params, batch[0])
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), batch[1].reshape(-1))

    step = fnzero.train_step(loss_fn, cfg)
    batches = token_batches(MICRO, MODEL["seq_len"], seed=rec.rank)  # text, each rank its own, every config the same
    times, sent, losses = [], [], []
    for i in range(total):
        b = next(batches)
        batch = (b["x"], b["y"])
        rec.reset()
        t0 = time.perf_counter()
        state, metrics = step(state, batch)
        if i >= freeze:  # step i + 1 > freeze: compressed
            times.append(time.perf_counter() - t0)
            sent.append(rec.ring_bytes_sent())
        losses.append(metrics["loss"])
    return {"config": name, "bytes_per_step": statistics.median(sent) if sent else 0.0,
            "formula_bytes": _formula(name, sm, comm.world_size),
            "step_s": statistics.median(times) if times else 0.0, "loss": statistics.fmean(losses[-LAST:])}


def measure(comm, steps: int, warmup: int) -> list[dict]:
    """Rows for AdamW (the baseline, first), OneBitAdam, ZeroOneAdam and OneBitLamb on `comm`
    (this rank's collectives), each trained `warmup + steps` steps. The 1-bit optimizers freeze
    after half of them (at least `warmup`, and 2: the first step is their initialisation step);
    bytes and times are counted over the steps after the freeze, for AdamW too."""
    total = warmup + steps
    freeze = min(max(2, warmup, total // 2), total - 1)
    return [_run(name, opt, comm, total, freeze) for name, opt in _configs(freeze)]
