"""MiCS and ZeRO++'s hpZ against plain ZeRO-3, for the communication benchmark's driver
(`specs/mesh.md §MiCS`, `§hpZ`).

`measure(comm, steps, warmup)` runs on every rank of a 4-rank world (`comm`: this rank's
collectives, a gloo process group or a simulated world's) and returns this rank's rows, one per
configuration, each training fnzero.testing's GPT (fp32 AdamW, `stage3_max_reuse_distance` 0 so
backward re-gathers what autograd saved) for `warmup + steps` steps:

* `z3`: plain ZeRO-3 over the 4 ranks (the baseline);
* `mics2`: MiCS, shard groups of 2 adjacent ranks (`fnzero.make_mesh(comm, mics=2)`);
* `hpz2`: ZeRO-3 with hpZ groups of 2 (`fnzero.make_mesh(comm, hpz=2)`).

The ranks are read as two nodes of 2 adjacent ranks. Per row: `bytes_per_step` (ring-equivalent
bytes this rank sends per step, counted by the comms logger on every group, averaged over the
measured steps), split into `bytes_intra` (groups inside a node: MiCS's shard group, hpZ's group) and
`bytes_cross` (groups spanning the nodes: the dp group, MiCS's replica group); `formula_bytes`, the
same from the spec's formulas (Ψ each unit padded as the run pads it, Ψ_r the elements the run's
backward re-gathered, b = a = 4 bytes); `step_s` (median over the measured steps); `loss` (the final
step's, mean over every rank's batch), and `state_bytes` (this rank's model state, exact).
"""

from __future__ import annotations

import statistics
import time

FEATURE = "mics"
MODEL = dict(vocab_size=256, seq_len=32, d_model=64, n_layer=2, n_head=4)
MICRO = 4
CONFIGS = {"z3": {}, "mics2": {"mics": 2}, "hpz2": {"hpz": 2}}


def _config(world: int):
    import fnzero

    return fnzero.load_config({
        "train_micro_batch_size_per_gpu": MICRO, "gradient_clipping": 1.0, "comms_logger": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-3}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, "stage3_max_reuse_distance": 0},
    }, world_size=world)


def _batch(step: int, rank: int):
    import torch

    g = torch.Generator().manual_seed(7919 * step + rank)
    return torch.randint(0, MODEL["vocab_size"], (MICRO, MODEL["seq_len"] + 1), generator=g)


def _groups(sm) -> list[tuple[str, object]]:
    """(where, collectives) of each group the run uses: "intra" inside a node of 2, "cross" spanning them."""
    mesh = sm.sharding.mesh
    out = [("intra" if mesh.replicas is not None else "cross", sm.comm)]
    if mesh.replicas is not None:
        out.append(("cross", mesh.replicas))
    if mesh.hpz is not None:
        out.append(("intra", mesh.hpz))
    return out


def _formula(name: str, plan, world: int, regathered: float) -> float:
    """specs/mesh.md §MiCS and §hpZ: ring-equivalent bytes per rank and step, 4-byte elements."""
    psi = plan.num_padded
    n = plan.world_size
    ring, twice = (n - 1) / n, 2 * (n - 1) / n
    base = 4 * psi * 2 * ring + 16 * twice  # forward gather, reduce-scatter; [norm², loss] as float64
    if name == "hpz2":
        return base + 4 * regathered * (2 - 1) / 2
    base += 4 * regathered * ring
    if name == "mics2":
        r = world // n
        base += (4 * psi / n + 8) * 2 * (r - 1) / r  # each shard, and the loss, all-reduced across replicas
    return base


def _run(comm, name: str, mesh_args: dict, steps: int, warmup: int) -> dict:
    import torch
    import torch.nn.functional as F

    import fnzero
    from fnzero.testing import GPT, seeded

    cfg = _config(comm.world_size)
    with seeded(0):
        model = GPT(**MODEL)
    sm = fnzero.shard(model, config=cfg, comm=comm, mesh=fnzero.make_mesh(comm, **mesh_args))
    state = sm.init_state()
    step = fnzero.train_step(
        lambda p, b: F.cross_entropy(sm.apply(p, b[:, :-1]).flatten(0, 1), b[:, 1:].flatten()), cfg)
    groups = _groups(sm)
    sent = {"intra": 0.0, "cross": 0.0}
    regathered, times, loss = 0.0, [], float("nan")
    for i in range(warmup + steps):
        for _, c in groups:
            c.reset()
        t0 = time.perf_counter()
        state, metrics = step(state, _batch(i, comm.rank))
        times.append(time.perf_counter() - t0)
        loss = metrics["loss"]
        if i >= warmup:
            for where, c in groups:
                sent[where] += c.ring_bytes_sent()
            gathered = sum(r.bytes for _, c in groups for r in c.records if r.op == "all_gather") / 4
            regathered += gathered - sm.plan.num_padded  # every unit gathered once in forward, the rest in backward
    measured = max(steps, 1)
    total = sent["intra"] + sent["cross"]
    return {
        "config": name, "bytes_per_step": total / measured, "bytes_intra": sent["intra"] / measured,
        "bytes_cross": sent["cross"] / measured,
        "formula_bytes": _formula(name, sm.plan, comm.world_size, regathered / measured),
        "step_s": statistics.median(times[warmup:] or times), "loss": loss,
        "state_bytes": fnzero.memory.model_state_bytes(state).total,
    }


def measure(comm, steps: int, warmup: int) -> list[dict]:
    """This rank's rows: plain ZeRO-3 first (the baseline), then MiCS with shard groups of 2, then hpZ
    with groups of 2, each `warmup + steps` steps of the GPT on `comm`'s 4 ranks."""
    if comm.world_size != 4:
        raise ValueError(f"comm_opt_mics measures a world of 4 ranks (two nodes of 2), got {comm.world_size}")
    return [_run(comm, name, mesh_args, steps, warmup) for name, mesh_args in CONFIGS.items()]
