"""Time one pass of each collective over a job's own units (`specs/autotune.md` §Trial report, which
says why passes and not a link alone).
"""

from __future__ import annotations

import statistics
import time

import torch

__all__ = ["measure_passes"]

_REPEATS = 5  # the median of five passes, after one warm-up pass


def measure_passes(state, dtype: torch.dtype, repeats: int = _REPEATS) -> dict[str, float] | None:
    """Seconds of one pass over `state`'s units per collective kind ("all_gather",
    "reduce_scatter", "all_reduce"), and "scalar", one all-reduce of two float64 (the step's
    norm and loss), each the median of `repeats` after a warm-up and the slowest rank's. Every
    rank calls it at the same point; None on one rank. Memory: one buffer of the largest unit."""
    sharding = state.sharding
    comm = sharding.comm
    n = comm.world_size
    if n < 2:
        return None
    # Dense units' buffers, padded to the ranks as ZeRO pads them; at stage 0 the same sizes
    # (an all-reduce of the unit's gradient).
    sizes = [-(-u.numel // n) * n for u in sharding.plan.units]
    if not sizes:
        return None
    full = torch.zeros(max(sizes), dtype=dtype, device=sharding.device)
    scalar = torch.zeros(2, dtype=torch.float64, device=sharding.device)
    ops = {
        "all_gather": lambda: [comm.all_gather(full[:s // n]) for s in sizes],
        "reduce_scatter": lambda: [comm.reduce_scatter(full[:s]) for s in sizes],
        "all_reduce": lambda: [comm.all_reduce(full[:s]) for s in sizes],
        "scalar": lambda: comm.all_reduce(scalar),
    }
    times = {}
    for kind, op in ops.items():
        op()  # warm-up: connections, allocations
        runs = []
        for _ in range(repeats):
            comm.barrier()
            _sync(full)
            t0 = time.perf_counter()
            op()
            _sync(full)
            runs.append(time.perf_counter() - t0)
        times[kind] = statistics.median(runs)
    # Every rank reports the slowest rank's: a collective ends when its last rank does.
    slowest = comm.all_reduce(torch.tensor([times[k] for k in ops], dtype=torch.float64, device=sharding.device),
                              op="max")
    return {k: float(v) for k, v in zip(ops, slowest.tolist())}


def _sync(t: torch.Tensor) -> None:
    if t.is_cuda:
        torch.cuda.synchronize(t.device)
