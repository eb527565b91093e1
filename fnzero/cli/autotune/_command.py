"""`fnzero autotune` (and `fnzero launch --autotuning tune|run`): run candidate configs as their own
jobs and keep the fastest that fits (`specs/autotune.md`).

    fnzero autotune --world 2 --time-budget 600 train.py --deepspeed_config ds.json
    fnzero launch --nproc-per-node 2 --autotuning run train.py --deepspeed_config ds.json
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings

from .._common import arg_type, fail, whole_numbers
from ..launch import LaunchError, add_rank_flags, machine_slots, rank_log_folder, rank_program, too_few_ranks
from ._jobs import config_arg_index, launch_flags
from ._results import DEFAULT_TRIAL_S as _DEFAULT_TRIAL_S

__all__ = ["register", "autotune_main", "autotune_from_launch", "add_tuning_options"]


_ints = arg_type(whole_numbers)


def _choices(allowed):
    def conv(text: str) -> list[str]:
        out = [t.strip() for t in text.split(",") if t.strip()]
        bad = [t for t in out if t not in allowed]
        if bad:
            raise argparse.ArgumentTypeError(f"{bad[0]!r} is not one of {', '.join(allowed)}")
        return out
    return conv


def _bytes(text: str) -> int:
    from ...memory import parse_bytes  # imports torch: not while building the parser

    return parse_bytes(text)


def add_tuning_options(p: argparse.ArgumentParser) -> None:
    """The autotuner's options (shared by `fnzero autotune`)."""
    g = p.add_argument_group("autotuning (the config's `autotuning` block sets the rest)")
    g.add_argument("--time-budget", type=float, default=None, metavar="S",
                   help=f"seconds for all trials (default {_DEFAULT_TRIAL_S:g} per planned trial); printed up front")
    g.add_argument("--memory-limit", type=arg_type(_bytes), default=None, metavar="BYTES",
                   help="bytes one rank may hold (default: the GPU's memory; on CPU, this machine's memory over "
                   "the trial's ranks)")
    g.add_argument("--params", type=int, default=None, metavar="N",
                   help="trainable parameters (default autotuning.model_info.num_params, else the first trial's)")
    g.add_argument("--stages", type=_ints, default=[0, 1, 2, 3], help="ZeRO stages to try (default 0,1,2,3)")
    g.add_argument("--micro-batch-sizes", type=_ints, default=None, metavar="LIST",
                   help="micro-batch sizes to try (default: autotuning's min..max, num_tuning_micro_batch_sizes)")
    g.add_argument("--offload", type=_choices(("none", "cpu", "nvme")), default=["none", "cpu"],
                   help="optimizer offload devices to try (default none,cpu)")
    g.add_argument("--tensor-parallel", type=_ints, default=None, metavar="LIST",
                   help="tensor-parallel sizes to try, e.g. 1,2 (default: the config's tensor_parallel.autotp_size)")
    g.add_argument("--pipeline-stages", type=_ints, default=None, metavar="LIST",
                   help="pipeline stage counts to try, e.g. 1,2 (default: the config's pipeline.stages)")
    g.add_argument("--link-bandwidth", type=float, default=None, metavar="B/S",
                   help="data-parallel link bytes/s per rank (default: measured by the first trial)")
    g.add_argument("--link-latency", type=float, default=None, metavar="S",
                   help="seconds per ring hop (default: measured by the first trial)")
    g.add_argument("--host-bandwidth", type=float, default=None, metavar="B/S",
                   help="host<->device bytes/s for offload (default 25e9 on GPUs; none on CPU)")
    g.add_argument("--trial-timeout", type=float, default=None, metavar="S", help="seconds per trial (default: the "
                   "budget left)")
    g.add_argument("--rounds", type=int, default=1, metavar="N",
                   help="run every successful candidate in N separate jobs, round-robin, and keep each one's fastest "
                   "(default 1; on a shared or noisy machine, 2-3 steady the measurements)")
    g.add_argument("--confirm", type=int, default=None, metavar="N",
                   help="at most N more jobs, for candidates measured more than 15%% slower than the model fitted to "
                   "the others predicts; each keeps its fastest job (default: a fifth of the successful candidates; 0: none)")
    g.add_argument("--seed", type=int, default=0, help="the random tuner's shuffle (default 0)")
    j = p.add_argument_group("each trial's launch (`fnzero launch`'s flags, given to every trial and to the optimal "
                             "command)")
    add_rank_flags(j)


def _script_problem(args) -> str | None:
    """Why the script cannot run, where that can be told before any trial and without running
    user code: a missing file, a module not found from here, a program not on PATH."""
    try:
        rank_program(sys.executable, args.script, [], args.module, args.no_python)  # the flags' own checks
    except LaunchError as e:
        return str(e)
    if args.module:
        from importlib.machinery import PathFinder

        path, parts = [os.getcwd(), *sys.path], args.script.split(".")  # `python -m` looks in the working directory first
        for k, part in enumerate(parts):  # found, never imported: a package's __init__ is user code
            spec = PathFinder.find_spec(part, path) if part else None
            if spec is None or (k < len(parts) - 1 and spec.submodule_search_locations is None):
                return f"module {args.script!r} not found (--module; from {os.getcwd()})"
            path = list(spec.submodule_search_locations or [])
        return None
    if args.no_python:
        import shutil

        return None if shutil.which(args.script) or os.path.isfile(args.script) else \
            f"program {args.script!r} not found (--no_python)"
    return None if os.path.isfile(args.script) else f"script {args.script!r} not found"


def _option_problems(args) -> list[str]:
    """The autotuner's own options out of range, one line each."""
    bad = [f"--stages: ZeRO stage {s} does not exist (0-3)" for s in args.stages if s not in (0, 1, 2, 3)]
    bad += [f"--micro-batch-sizes: {m} is not a micro-batch size (at least 1)"
            for m in args.micro_batch_sizes or [] if m < 1]
    for flag, sizes in (("--tensor-parallel", args.tensor_parallel), ("--pipeline-stages", args.pipeline_stages)):
        bad += [f"{flag}: {n} is not a size (at least 1)" for n in sizes or [] if n < 1]
    for flag, value in (("--time-budget", args.time_budget), ("--trial-timeout", args.trial_timeout)):
        if value is not None and not value > 0:
            bad.append(f"{flag} must be more than 0 seconds, got {value:g}")
    if args.world < 1:
        bad.append(f"--world must be at least 1, got {args.world}")
    if args.rounds < 1:
        bad.append(f"--rounds must be at least 1, got {args.rounds}")
    if args.confirm is not None and args.confirm < 0:
        bad.append(f"--confirm must be at least 0, got {args.confirm}")
    return bad


def register(sub) -> None:
    p = sub.add_parser("autotune", help="run candidate ZeRO configs as jobs and write the fastest that fits",
                       description="Explore ZeRO stage x micro-batch x optimizer offload: prune what the memory planner "
                       "says cannot fit, run the rest a few steps each as its own job, and write the results table "
                       "and the optimal config (DeepSpeed's --autotuning). Options come before the script; the "
                       "script's arguments must name its config (--deepspeed_config, --deepspeed or --config).")
    p.add_argument("--world", "--nproc-per-node", type=int, default=None, metavar="N",
                   help="ranks per trial (default: one per CUDA device, else one per NUMA node, as DeepSpeed)")
    p.add_argument("--run", action="store_true", help="then train with the optimal config (--autotuning run)")
    add_tuning_options(p)
    p.add_argument("script", help="the training script")
    p.add_argument("script_args", nargs=argparse.REMAINDER, help="its arguments, with --deepspeed_config PATH")
    p.set_defaults(func=autotune_main)


def autotune_main(args) -> int:
    """Validate, then tune; the command's exit status."""
    if args.world is None:  # as DeepSpeed's autotuner: every device of this machine
        args.world = machine_slots()
    i = config_arg_index(args.script_args)
    problems = [p for p in [_script_problem(args)] if p] + _option_problems(args)
    if i < 0:
        problems.append("the script's arguments name no config: pass `--deepspeed_config ds.json` (or --deepspeed, "
                        "--config) after the script")
    for p in problems:  # every one, a line each
        fail("autotune", p)
    if problems:
        return 2
    path = args.script_args[i].split("=", 1)[1] if args.script_args[i].startswith("--") else args.script_args[i]
    from ...config import read_source
    from .._common import load_config_or_report

    with warnings.catch_warnings():  # the block's "enabled has no effect in a training run": this is the tuner
        warnings.filterwarnings("ignore", message="`autotuning.enabled`")
        cfg = load_config_or_report(path, args.world, prefix="fnzero autotune: ")
    if cfg is None:
        return 2
    raw, _ = read_source(path)
    from ._loop import Tuning

    return Tuning(args, cfg, raw).run()


def autotune_from_launch(args: argparse.Namespace, rest: list[str]) -> int:
    """DeepSpeed's `deepspeed --autotuning tune|run --num_gpus N script ...`: `fnzero autotune` with
    this node's N ranks and the per-rank flags every trial takes (specs/autotune.md §Command)."""
    refused = [flag for flag, given in (
        ("--hostfile", args.hostfile), ("--include", args.include), ("--exclude", args.exclude),
        ("--num_nodes", (args.num_nodes or 1) > 1), ("--nnodes", (args.nnodes or 1) > 1),
        ("--node_rank", args.node_rank is not None), ("--no_ssh", args.no_ssh), ("--launcher", args.launcher != "ssh"),
        ("--launcher_args", args.launcher_args), ("--ssh_port", args.ssh_port is not None)) if given]
    for flag in refused:
        print(f"fnzero launch: {flag} cannot be used with --autotuning: the autotuner runs each trial as its own "
              "job on this node; tune on one node, then launch the hosts with its ds_config_optimal.json",
              file=sys.stderr)
    if refused:
        return 2
    for flag, given in (("--master_addr", args.master_addr), ("--master_port", args.master_port is not None),
                        ("--max-restarts", args.max_restarts is not None), ("--save_pid", args.save_pid is not None),
                        ("--comment", args.comment), ("--account", args.account),
                        ("--enable_each_rank_log", rank_log_folder(args.enable_each_rank_log))):
        if given:
            print(f"fnzero launch: warning: {flag} has no effect with --autotuning (each trial is its own job on "
                  "this node, on a free port, its output in exps_dir)", file=sys.stderr)
    world = next((n for n in (args.num_gpus, args.nproc_per_node) if n is not None), None)
    world = machine_slots() if world is None else world
    if world < 1:
        return fail("launch", too_few_ranks(args, world))
    run = ["--run"] if args.autotuning == "run" else []
    tune = _parser().parse_args(["autotune", "--world", str(world), *run, *launch_flags(args), *rest])
    return int(tune.func(tune))


def _parser() -> argparse.ArgumentParser:
    """`fnzero autotune`'s parser alone, as the `fnzero` command builds it: the same usage and errors."""
    p = argparse.ArgumentParser(prog="fnzero")
    register(p.add_subparsers(dest="command", metavar="COMMAND"))
    return p
