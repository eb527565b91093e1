"""Communication-saving features against their uncompressed baselines, in one invocation: Muon at
ZeRO 1-3 (whole-matrix optimizer partition), 1-bit Adam / 0/1 Adam / 1-bit LAMB, MiCS and hpZ,
ZeRO++'s quantized weights and gradients (CPU: a spawned gloo world of 4, or a simulated one).

    python benchmarks/bench_comm_opt.py                                  # every feature, 4 gloo ranks
    python benchmarks/bench_comm_opt.py --features onebit --steps 300     # the issue's loss check
    python benchmarks/bench_comm_opt.py --simulated --steps 2 --warmup 0  # seconds: threads, no spawn

Each feature is a module `benchmarks/comm_opt_<feature>.py` with `FEATURE` and
`measure(comm, steps, warmup) -> list[dict]`: it trains the example GPT with its baseline first and
then each of its configurations, all on the same data, and returns one row per configuration:
`config`, `bytes_per_step` (what this rank sent per step, counted by the collectives), `formula_bytes`
(the spec's formula for it), `step_s` (median step time) and `loss` (after the last step).

The table prints, per feature, each row's bytes against its formula and against the baseline's,
its step time against the baseline's, and its final loss against the baseline's (the issue's
acceptance: within 2 % after 300 steps). Across ranks a row keeps the slower rank's step time and
the largest byte count (ranks differ only by padding and by which matrices they own).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

from _common import CpuMonitor, machine  # noqa: E402

FEATURES = ("muon", "onebit", "mics", "zeropp")


def _module(feature: str):
    return importlib.import_module(f"comm_opt_{feature}")


def measure_all(comm, features: list[str], steps: int, warmup: int) -> dict[str, list[dict]]:
    return {f: _module(f).measure(comm, steps, warmup) for f in features}


def worker(features: list[str], steps: int, warmup: int) -> dict[str, list[dict]]:
    """One spawned rank (torch.distributed initialised by run_world)."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from fnzero.sharding import default_collectives

    return measure_all(default_collectives(), features, steps, warmup)


def merge_ranks(per_rank: list[dict[str, list[dict]]]) -> dict[str, list[dict]]:
    """The slower rank's step time, the largest byte counts, rank 0's loss (the ranks agree)."""
    merged = {}
    for feature, rows in per_rank[0].items():
        out = []
        for i, row in enumerate(rows):
            others = [r[feature][i] for r in per_rank]
            out.append(dict(row, step_s=max(o["step_s"] for o in others),
                            bytes_per_step=max(o["bytes_per_step"] for o in others),
                            formula_bytes=max(o["formula_bytes"] for o in others)))
        merged[feature] = out
    return merged


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.3f}" if b else "-"


def print_table(merged: dict[str, list[dict]]) -> None:
    print(f"{'feature':<8} {'config':<28} {'KB/step':>10} {'formula':>10} {'=form':>6} {'vs base':>8} "
          f"{'step s':>8} {'vs base':>8} {'loss':>8} {'vs base':>8}")
    for feature, rows in merged.items():
        base = rows[0]
        for r in rows:
            print(f"{feature:<8} {r['config']:<28} {r['bytes_per_step'] / 1e3:>10.1f} {r['formula_bytes'] / 1e3:>10.1f} "
                  f"{'yes' if r['bytes_per_step'] == r['formula_bytes'] else 'NO':>6} "
                  f"{_ratio(r['bytes_per_step'], base['bytes_per_step']):>8} {r['step_s']:>8.4f} "
                  f"{_ratio(r['step_s'], base['step_s']):>8} {r['loss']:>8.4f} {_ratio(r['loss'], base['loss']):>8}")
    print("\nKB/step: bytes one rank sends per step (the largest over ranks), counted by the collectives; formula: the "
          "spec's (specs/collectives.md, specs/optim.md, specs/mesh.md); vs base: against the feature's first row, "
          "its uncompressed or unsharded baseline. step s: the slower rank's median step time. loss: after the "
          "last step, same data for every row.")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--features", default=",".join(FEATURES))
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--simulated", action="store_true", help="ranks as threads of this process (no spawn)")
    ap.add_argument("--json", default=None, help="also write the rows to this file")
    args = ap.parse_args(argv)
    features = args.features.split(",")
    bad = [f for f in features if f not in FEATURES]
    if bad:
        ap.error(f"features {bad}: choose from {', '.join(FEATURES)}")
    print(f"machine: {machine()}")
    print(f"{args.world} {'simulated' if args.simulated else 'gloo'} ranks, {args.steps} steps after "
          f"{args.warmup} warm-up\n")
    with CpuMonitor() as mon:
        if args.simulated:
            from fnzero.testing import simulated_world

            per_rank = simulated_world(args.world, timeout=3600).run(
                lambda comm: measure_all(comm, features, args.steps, args.warmup))
        else:
            from fnzero.testing import run_world

            per_rank = run_world(worker, args.world, features, args.steps, args.warmup, timeout=3600)
    merged = merge_ranks(per_rank)
    print_table(merged)
    print(f"other cores busy during the run: {mon.other_cores:.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": machine(), "world": args.world, "rows": merged}, f, indent=1)
    return merged


if __name__ == "__main__":
    main()
