"""1-bit Adam, 0/1 Adam and 1-bit LAMB against AdamW on fnzero.testing's GPT: one feature module of
`bench_comm_opt.py`, which calls `measure(comm, steps, warmup)` on every rank.

Each configuration trains the same GPT (fp32, ZeRO stage 0, the same data) for `warmup + steps`
steps on `comm`; the 1-bit optimizers freeze after `warmup` steps (`freeze_step`,
`var_freeze_step`), so the `steps` measured all run compressed. A row per configuration, AdamW
first: `bytes_per_step` (ring-equivalent bytes this rank sends per measured step, the median,
counted by `RecordingCollectives`), `formula_bytes` (specs/collectives.md §Compressed all-reduce
plus the step's norm-and-loss all-reduce of two float64; AdamW: §Traffic's all-reduce of every
unit's padded gradient), `step_s` (median seconds), `loss` (the last step's, mean over ranks).
"""

from __future__ import annotations

import statistics
import time

FEATURE = "onebit"

MODEL = dict(vocab_size=256, seq_len=64, d_model=64, n_layer=2, n_head=4)
MICRO = 4


def _configs(warmup: int) -> list[tuple[str, dict]]:
    common = {"lr": 1e-3, "weight_decay": 0.0}
    return [
        ("AdamW", {"type": "AdamW", "params": common}),
        ("OneBitAdam", {"type": "OneBitAdam", "params": {**common, "freeze_step": warmup}}),
        # 0/1 Adam freezes after the step whose number exceeds var_freeze_step: the same first frozen step.
        ("ZeroOneAdam", {"type": "ZeroOneAdam", "params": {**common, "var_freeze_step": warmup - 1}}),
        ("OneBitLamb", {"type": "OneBitLamb", "params": {**common, "freeze_step": warmup}}),
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


def _batch(rank: int, step: int):
    import torch

    g = torch.Generator().manual_seed(1000 * step + rank)
    ids = torch.randint(0, MODEL["vocab_size"], (MICRO, MODEL["seq_len"] + 1), generator=g)
    return ids[:, :-1], ids[:, 1:]


def _run(name: str, optimizer: dict, comm, steps: int, warmup: int) -> dict:
    import torch

    import fnzero
    from fnzero.sharding import RecordingCollectives
    from fnzero.testing import GPT, seeded

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
    times, sent, loss = [], [], None
    for i in range(warmup + steps):
        batch = _batch(rec.rank, i)
        rec.reset()
        t0 = time.perf_counter()
        state, metrics = step(state, batch)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
            sent.append(rec.ring_bytes_sent())
        loss = metrics["loss"]
    return {"config": name, "bytes_per_step": statistics.median(sent) if sent else 0.0,
            "formula_bytes": _formula(name, sm, comm.world_size),
            "step_s": statistics.median(times) if times else 0.0, "loss": float(loss)}


def measure(comm, steps: int, warmup: int) -> list[dict]:
    """Rows for AdamW (the baseline, first), OneBitAdam, ZeroOneAdam and OneBitLamb on `comm`
    (this rank's collectives). `warmup` >= 2 keeps every measured step after the freeze (the
    first step is the 1-bit optimizers' initialisation step)."""
    warmup = max(warmup, 2)
    return [_run(name, opt, comm, steps, warmup) for name, opt in _configs(warmup)]
