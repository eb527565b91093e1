"""The bytes that cross the link between two hosts while plain ZeRO-3, hpZ and MiCS train the same
model (tests/test_launch_hostfile.py, specs/mesh.md §hpZ): every rank of a 2-host x 2-rank job calls
`measure(path)`; the first rank reads its host's end of the link (`/proc/net/dev`, which shows the
rank's own network namespace) between barriers and writes what it saw as JSON to `path`.

Each configuration trains a float64 MLP one step (not counted: the first step may differ), then
STEPS counted steps; an empty phase (the same barriers, no step) measures what crosses anyway."""

import json
import time
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F

import fnzero
from fnzero.testing import MLP, seeded

SIZES, MICRO, STEPS, LINK = [128, 256, 256, 128], 2, 3, "fnz0"
CONFIGS = {"zero3": {}, "hpz2": {"zero_hpz_partition_size": 2}, "mics2": {"mics_shard_size": 2}}


def link_bytes() -> int:
    """Bytes received + sent on this host's end of the veth pair: every byte crossing it, either way."""
    with open("/proc/net/dev") as f:
        for line in f:
            name, _, counters = line.partition(":")
            if name.strip() == LINK:
                fields = counters.split()
                return int(fields[0]) + int(fields[8])
    raise RuntimeError(f"no {LINK} in /proc/net/dev")


def _quiet_link_bytes() -> int:
    """`link_bytes()` between two barriers, so that no rank sends the next phase's bytes before the
    first rank has read (a barrier lets its ranks go at different moments)."""
    dist.barrier()
    seen = link_bytes() if dist.get_rank() == 0 else 0
    dist.barrier()
    return seen


def _counted(run) -> tuple[int, float]:
    before, t0 = _quiet_link_bytes(), time.perf_counter()
    run()
    return _quiet_link_bytes() - before, time.perf_counter() - t0


def _config(zero: dict):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # MiCS's key: DeepSpeed 0.19.8 removed it (specs/mesh.md §MiCS)
        return fnzero.load_config({
            "train_micro_batch_size_per_gpu": MICRO, "comms_logger": {"enabled": True},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                  "stage3_max_reuse_distance": 0, **zero}})


def _batch(step: int, rank: int):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return (torch.randn(MICRO, SIZES[0], generator=g, dtype=torch.float64),
            torch.randn(MICRO, SIZES[-1], generator=g, dtype=torch.float64))


def _one(zero: dict) -> dict:
    cfg = _config(zero)
    with seeded(0):
        sm = fnzero.shard(MLP(SIZES).double(), config=cfg)
    step = fnzero.train_step(lambda p, b: F.mse_loss(sm.apply(p, b[0]), b[1]), cfg)
    box = {"state": sm.init_state()}

    def train(first: int, n: int):
        for i in range(first, first + n):
            box["state"], box["metrics"] = step(box["state"], _batch(i, dist.get_rank()))

    train(0, 1)
    sm.comm.reset()
    crossed, seconds = _counted(lambda: train(1, STEPS))
    gathered = sum(r.bytes for r in sm.comm.records if r.op == "all_gather") // 8 // STEPS
    return {"crossed": crossed, "seconds": seconds, "loss": float(box["metrics"]["loss"]),
            "padded": sm.plan.num_padded, "gathered_per_step": gathered}


def measure(path: str) -> None:
    t0 = time.perf_counter()
    rows = {"empty": dict(zip(("crossed", "seconds"), _counted(lambda: None)))}
    for name, zero in CONFIGS.items():
        rows[name] = _one(zero)
    rows["params"] = sum(a * b + b for a, b in zip(SIZES[:-1], SIZES[1:]))
    rows["steps"], rows["measure_s"] = STEPS, time.perf_counter() - t0
    if dist.get_rank() == 0:
        with open(path, "w") as f:
            json.dump(rows, f)
