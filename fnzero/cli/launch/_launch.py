"""`fnzero launch` in three steps: the flags, parsed (`_flags.py`) and checked (`_checks.py`); a
`LaunchPlan` built from them, which leaves them as parsed (`plan_launch`); the plan run by the
executor of its kind (`EXECUTORS`)."""

from __future__ import annotations

import argparse
import sys

from ._checks import ignored_flag_warnings, launch_flag_problems, launch_hostfile
from ._hosts import DEFAULT_HOSTFILE, LaunchError
from ._multinode import plan_ssh, run_over_ssh
from ._node import plan_here, selected_hosts
from ._plan import LaunchPlan
from ._tool_launch import plan_tool, run_tool
from ._torchrun import run_here

__all__ = ["EXECUTORS", "launch_main", "plan_launch"]

# How each kind of plan runs: this node's ranks under torchrun here, one `fnzero launch` per host
# over ssh, or the launcher tool (pdsh, mpirun, srun) run here.
EXECUTORS = {"torchrun": run_here, "ssh": run_over_ssh, "tool": run_tool}


def launch_main(args: argparse.Namespace, rest: list[str]) -> int:
    """`fnzero launch` with its flags `args` and the script with its arguments `rest`: its exit
    status (2, a line per problem, when it cannot start as asked)."""
    try:
        plan = plan_launch(args, rest)
    except LaunchError as e:
        for line in str(e).splitlines():
            print(f"fnzero launch: {line}", file=sys.stderr)
        return 2
    return EXECUTORS[plan.kind](plan)


def plan_launch(args: argparse.Namespace, rest: list[str]) -> LaunchPlan:
    """What the launch runs, or LaunchError (a line per problem) when it cannot start as asked.
    Starts nothing; reads the hostfile and asks the hosts over ssh, as DeepSpeed's runner checks
    them, and says which warnings apply (stderr) and when one host of a hostfile runs here (stdout)."""
    hostfile = launch_hostfile(args, DEFAULT_HOSTFILE)
    problems = launch_flag_problems(args, hostfile)
    warnings = [f"warning: {w}" for w in ignored_flag_warnings(args, hostfile)]
    if problems:
        raise LaunchError("\n".join(problems + warnings))
    for line in warnings:
        print(f"fnzero launch: {line}", file=sys.stderr)
    here = bool(hostfile and not args.no_ssh)  # a hostfile: its hosts start, unless one host runs here
    if not rest:
        example = "--hostfile hosts" if here else "--nproc-per-node 2"
        raise LaunchError(f"name the training script, e.g. `fnzero launch {example} train.py`")
    if not here:
        return plan_here(args, rest, hostfile)
    hosts, active = selected_hosts(args, hostfile)
    if len(active) != 1 or args.force_multi:
        return (plan_ssh if args.launcher == "ssh" else plan_tool)(args, rest, hostfile, hosts, active)
    # DeepSpeed's runner: one host left by the filters, without --force_multi, runs here, with
    # neither ssh nor the launcher tool (its slots, a subset as CUDA_VISIBLE_DEVICES).
    (host, slots), = active.items()
    if not args.quiet:
        print(f"fnzero launch: one host selected ({host}): its {len(slots)} rank(s) run here, as DeepSpeed's runner "
              f"does (--force_multi starts it with --launcher {args.launcher})", flush=True)
    return plan_here(args, rest, hostfile, slots)
