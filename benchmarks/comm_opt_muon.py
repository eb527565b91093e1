"""Muon at ZeRO stages 0-3 on fnzero's GPT (specs/optim.md §Muon at ZeRO stages 1-3): one feature
of the communication-and-optimizer benchmark (its driver, bench_comm_opt.py, runs `measure` on each
rank of a simulated or gloo world and prints the rows).

Each configuration trains the same small GPT (fp32, one micro-batch a step, the config's Muon with
DeepSpeed's grouping) for `warmup + steps` steps and reports, for this rank: the logical bytes of
every collective of the last step (the comms logger's records, `specs/collectives.md`), the same by
formula (`stage_bytes`: ZeRO's own traffic for the stage, plus the whole-matrix partition's two
all-to-alls, `WholeTensorPartition.exchange_numel`), the median step time and the final loss.
The first row is the baseline: Muon at stage 0 (every rank orthogonalises every matrix).

    python -c "import sys; sys.path.insert(0, 'benchmarks'); import comm_opt_muon as m; \\
        from fnzero.testing import simulated_world; print(simulated_world(2).run(lambda c: m.measure(c, 2, 1))[0])"
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))

from _common import median  # noqa: E402

FEATURE = "muon"
MODEL = dict(vocab_size=256, seq_len=32, d_model=64, n_layer=2, n_head=4)
MICRO = 4
STAGES = (0, 1, 2, 3)
SMALL = 16  # the norm-and-loss all-reduce: two float64 numbers


def stage_bytes(plan, stage: int, rank: int, itemsize: int = 4) -> int:
    """Logical bytes rank `rank` issues in one step of one micro-batch, fp32, by `specs/collectives.md`'s
    counting: stage 0 all-reduces every unit's gradients; stages 1-2 reduce-scatter them and
    all-gather the new parameters; stage 3 gathers each sharded unit once (forward; backward reuses
    it, the reuse distance being DeepSpeed's default 1e9) and reduce-scatters, its persistent units
    as stages 1-2: 2x the padded units in all; every stage all-reduces the norm and the loss; and
    Muon's exchange at stages 1-3."""
    from fnzero.optim import uses_muon
    from fnzero.sharding.zero._owners import whole_tensor_partition

    padded = sum(u.padded_numel for u in plan.units)
    zero = (padded if stage == 0 else 2 * padded) * itemsize + SMALL
    if stage == 0:
        return zero
    muon = frozenset(s.name for u in plan.units for s in u.slots if uses_muon(s.name, s.shape))
    return zero + itemsize * whole_tensor_partition(plan, muon).exchange_numel(rank)


def _run(comm, stage: int, steps: int, warmup: int) -> dict:
    import torch
    import torch.nn.functional as F

    import fnzero
    from fnzero.testing import GPT, seeded

    cfg = fnzero.load_config({
        "train_micro_batch_size_per_gpu": MICRO, "optimizer": {"type": "Muon", "params": {"lr": 0.02, "adam_lr": 3e-3}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        "comms_logger": {"enabled": True}}, world_size=comm.world_size)
    with seeded(0):
        model = GPT(**MODEL)
    sm = fnzero.shard(model, config=cfg, comm=comm)
    state = sm.init_state()
    g = torch.Generator().manual_seed(comm.rank)
    batches = [torch.randint(0, MODEL["vocab_size"], (MICRO, MODEL["seq_len"] + 1), generator=g) for _ in range(4)]
    step = fnzero.train_step(
        lambda p, b: F.cross_entropy(sm.apply(p, b[:, :-1]).flatten(0, 1), b[:, 1:].flatten()), cfg, donate=True)
    times = []
    for i in range(warmup + steps):
        sm.comm.reset()
        comm.barrier()
        t = time.perf_counter()
        state, metrics = step(state, batches[i % 4])
        times.append(time.perf_counter() - t)
    return {"config": f"muon-zero{stage}", "bytes_per_step": sum(r.bytes for r in sm.comm.records),
            "formula_bytes": stage_bytes(sm.plan, stage, comm.rank), "step_s": median(times[warmup:]),
            "loss": float(metrics["loss"])}


def measure(comm, steps: int, warmup: int) -> list[dict]:
    """One row per ZeRO stage on this rank, stage 0 (the baseline) first."""
    return [_run(comm, stage, steps, warmup) for stage in STAGES]
