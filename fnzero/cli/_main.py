"""The `fnzero` command: launch, report, config."""

from __future__ import annotations

import argparse
import os
import sys

from . import _checkpoint as checkpoint_commands
from ._common import load_config_or_report
from . import _plan as plan_commands

__all__ = ["build_parser", "main"]


def _cmd_launch(args: argparse.Namespace, rest: list[str]) -> int:
    from torch.distributed import run as torchrun

    from ..sharding._dist import free_port

    argv = ["--nproc-per-node", str(args.nproc_per_node)]
    nnodes = args.nnodes
    node_rank = args.node_rank
    master_addr = args.master_addr
    # Under SLURM (one `fnzero launch` per node) the node count and rank come from the allocation.
    if nnodes is None and "SLURM_NNODES" in os.environ:
        nnodes = int(os.environ["SLURM_NNODES"])
        node_rank = int(os.environ.get("SLURM_NODEID", "0")) if node_rank is None else node_rank
        master_addr = master_addr or os.environ.get("MASTER_ADDR")
    nnodes = nnodes or 1
    argv += ["--nnodes", str(nnodes)]
    if nnodes == 1 and master_addr is None:
        argv += ["--master-addr", "127.0.0.1", "--master-port", str(args.master_port or free_port())]
    else:
        if master_addr is None:
            print("fnzero launch: --master-addr is required with --nnodes > 1", file=sys.stderr)
            return 2
        argv += ["--node-rank", str(node_rank or 0), "--master-addr", master_addr,
                 "--master-port", str(args.master_port or 29500)]
    if args.max_restarts is not None:
        argv += ["--max-restarts", str(args.max_restarts)]
    if not rest:
        print("fnzero launch: name the training script, e.g. `fnzero launch --nproc-per-node 2 train.py`", file=sys.stderr)
        return 2
    argv += rest
    from .._ext._heap import allocator_env

    os.environ.update(allocator_env())  # inherited by every worker torchrun starts
    try:
        torchrun.main(argv)
    except SystemExit as e:  # torchrun exits with the failing worker's code
        return int(e.code or 0)
    except Exception as e:  # ChildFailedError: the failing rank's error was already printed above
        print(f"fnzero launch: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    return 0


def _cmd_report(args: argparse.Namespace) -> int:
    from ._report import report_lines

    print("\n".join(report_lines()))
    return 0


def _cmd_config(args: argparse.Namespace) -> int:
    cfg = load_config_or_report(args.file, args.world_size)
    if cfg is None:
        return 1
    if args.action == "show":
        print(cfg.to_json(indent=2))
    else:
        print(f"{args.file}: valid (ZeRO stage {cfg.zero_optimization.stage}, world size {cfg.world_size})")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fnzero", description="ZeRO sharding as pure training steps on PyTorch.")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")

    lp = sub.add_parser("launch", help="start a multi-process run (a front on torchrun)",
                        description="Start one process per rank with torch.distributed.run. Everything after the "
                        "script name is passed to the script.")
    lp.add_argument("--nproc-per-node", type=int, default=1, help="processes on this node (default 1)")
    lp.add_argument("--nnodes", type=int, default=None, help="number of nodes (default 1, or SLURM_NNODES)")
    lp.add_argument("--node-rank", type=int, default=None, help="this node's rank (multi-node)")
    lp.add_argument("--master-addr", default=None, help="address of rank 0's node (multi-node)")
    lp.add_argument("--master-port", type=int, default=None, help="port on the master (default: a free one)")
    lp.add_argument("--max-restarts", type=int, default=None, help="torchrun restarts on failure (default 0)")

    sub.add_parser("report", help="environment, devices, backends and native-extension status")

    cp = sub.add_parser("config", help="validate or show a DeepSpeed-style JSON config")
    cp.add_argument("action", choices=["show", "validate"], help="show: the resolved config as JSON; validate: every error at once")
    cp.add_argument("file", help="path to the JSON config")
    cp.add_argument("--world-size", type=int, default=1, help="world size used to resolve the batch triad (default 1)")

    # Each command family adds its parsers with `set_defaults(func=handler)`, and
    # `handler(args) -> int` is the exit code.
    checkpoint_commands.register(sub)
    plan_commands.register(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    # `launch` passes everything after the script through untouched.
    if argv and argv[0] == "launch":
        head, rest = [], []
        i = 1
        while i < len(argv):
            a = argv[i]
            if a.startswith("-"):
                head.append(a)
                if "=" not in a and a not in ("-h", "--help") and i + 1 < len(argv):
                    head.append(argv[i + 1])
                    i += 1
            else:
                rest = argv[i:]
                break
            i += 1
        args = parser.parse_args(["launch", *head])
        return _cmd_launch(args, rest)
    args = parser.parse_args(argv)
    if getattr(args, "func", None) is not None:
        return int(args.func(args) or 0)
    if args.command == "report":
        return _cmd_report(args)
    if args.command == "config":
        return _cmd_config(args)
    parser.print_help()
    return 0 if args.command is None else 2


if __name__ == "__main__":
    raise SystemExit(main())
