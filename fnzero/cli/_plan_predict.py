"""`fnzero plan --predict`: the autotuner's step-time model for clusters this machine cannot run
(`specs/autotune.md` §Clusters on paper).

    fnzero plan --params 7B --world-size 64 --predict --predict-world-sizes 64,256,1024
"""

from __future__ import annotations

import argparse

from ._common import arg_type, whole_numbers

__all__ = ["add_predict_options", "predict_rows", "print_predictions"]

# Stated defaults (specs/autotune.md §Clusters on paper): an H100 SXM node of 8 GPUs.
DEFAULTS = {"flops_per_device": 400e12, "nvlink_bandwidth": 300e9, "ib_bandwidth": 25e9, "nvlink_latency": 5e-6,
            "ib_latency": 10e-6, "hbm_bandwidth": 3.35e12, "seq_len": 4096, "micro_batch": 1, "units": 32}


def add_predict_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("step-time prediction (--predict; the autotuner's model_based tuner uses the same model)")
    g.add_argument("--predict", action="store_true", help="also print each stage's predicted step time")
    g.add_argument("--predict-world-sizes", type=arg_type(whole_numbers, too_small="give world sizes of at least 1"), default=None, metavar="N[,N...]",
                   help="world sizes to predict for (default: --world-size)")
    for key, what in (("flops_per_device", "achieved FLOP/s per device (6 FLOPs per parameter and token)"),
                      ("nvlink_bandwidth", "bytes/s per GPU inside a node"),
                      ("ib_bandwidth", "bytes/s per GPU between nodes (the node's NICs / GPUs per node)"),
                      ("nvlink_latency", "seconds per ring hop inside a node"),
                      ("ib_latency", "seconds per ring hop between nodes"),
                      ("hbm_bandwidth", "device memory bytes/s (the optimizer's update is memory-bound)"),
                      ("seq_len", "tokens per sample (also --sp's)"), ("micro_batch", "samples per rank per step (also --sp's)"),
                      ("units", "ZeRO units (transformer layers): collectives per stage")):
        kind = int if key in ("seq_len", "micro_batch", "units") else float
        g.add_argument("--" + key.replace("_", "-"), type=kind, default=DEFAULTS[key], metavar="X",
                       help=f"{what} (default {DEFAULTS[key]:g})")


def predict_rows(args) -> list[dict]:
    """One row per (world size, stage): the model's step time and its parts, for args.params."""
    from ..memory import Link, predict_step

    rows = []
    b = 2 if (args.precision or "bf16") != "fp32" else 4
    # Adam's update reads and writes about 30 bytes per parameter with fp32 master and moments
    # (16-bit gradient and parameter), 32 in fp32.
    opt_s_per_param = (30 if b == 2 else 32) / args.hbm_bandwidth
    for n in args.predict_world_sizes or [args.world_size]:
        inside = n <= args.gpus_per_node
        link = (Link(args.nvlink_latency, args.nvlink_bandwidth) if inside else
                Link(args.ib_latency, min(args.ib_bandwidth, args.nvlink_bandwidth)))
        for stage in (0, 1, 2, 3):
            p = predict_step(args.params, stage=stage, world_size=n, micro=args.micro_batch, gas=1, units=args.units,
                             compute_s_per_sample=6 * args.params * args.seq_len / args.flops_per_device,
                             optimizer_s_per_param=opt_s_per_param, link=link, comm_bytes=b)
            tokens = args.micro_batch * args.seq_len
            rows.append({"world_size": n, "stage": stage, "step_s": p.total_s, "overlapped_step_s": p.overlapped_s,
                         "compute_s": p.compute_s, "comm_s": p.comm_s, "optimizer_s": p.optimizer_s,
                         "comm_bytes_per_rank": p.comm_bytes, "tokens_per_s_per_gpu": tokens / p.total_s,
                         "link": "nvlink" if inside else "infiniband"})
    return rows


def print_predictions(args, rows: list[dict], stream) -> None:
    print(f"\npredicted step time (specs/autotune.md §Step-time model): {args.micro_batch} x {args.seq_len} tokens "
          f"per rank, {args.units} units, {args.flops_per_device / 1e12:g} TFLOP/s achieved; links: NVLink "
          f"{args.nvlink_bandwidth / 1e9:g} GB/s {args.nvlink_latency * 1e6:g} us/hop inside a node of "
          f"{args.gpus_per_node}, InfiniBand {args.ib_bandwidth / 1e9:g} GB/s {args.ib_latency * 1e6:g} us/hop between",
          file=stream)
    print(f"  {'ranks':>6} {'link':<10} {'stage':>5} {'step':>9} {'overlapped':>10} {'compute':>9} {'comm':>9} "
          f"{'optimizer':>9} {'comm/rank':>10} {'tok/s/GPU':>10}", file=stream)
    for r in rows:
        print(f"  {r['world_size']:>6} {r['link']:<10} {r['stage']:>5} {r['step_s']:>8.3f}s {r['overlapped_step_s']:>9.3f}s "
              f"{r['compute_s']:>8.3f}s {r['comm_s']:>8.3f}s {r['optimizer_s']:>8.4f}s "
              f"{r['comm_bytes_per_rank'] / 1e9:>8.2f}GB {r['tokens_per_s_per_gpu']:>10,.0f}", file=stream)
    print("  step: compute + collectives + optimizer, nothing overlapped; overlapped: every collective hidden behind "
          "compute. Flat rings (NCCL's trees would cut the latency term at scale); no activation recompute.",
          file=stream)
