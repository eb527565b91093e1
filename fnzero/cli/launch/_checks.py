"""`fnzero launch`'s flags checked before anything starts (`specs/cli.md` §Launcher flags): which
words are its options, which it does not know, and flags given together where one would silently
win over the other."""

from __future__ import annotations

import argparse
import os
import shlex

__all__ = ["ignored_flag_warnings", "launch_options", "scan_launch_args", "launch_flag_problems", "launch_hostfile",
           "too_few_ranks"]


def launch_options(parser: argparse.ArgumentParser) -> dict[str, bool]:
    """`launch`'s option strings (from `parser`, fnzero's), each with whether it takes a value."""
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return {o: a.nargs not in (0, "?") for a in sub.choices["launch"]._actions for o in a.option_strings}


def _known(option: str, options: dict[str, bool]) -> str | None:
    """The launch option `option` names (exactly, or as argparse's unique prefix), else None."""
    if option in options:
        return option
    hits = [o for o in options if o.startswith(option) and option.startswith("--")]
    return hits[0] if len(hits) == 1 else None


def scan_launch_args(argv: list[str], options: dict[str, bool]) -> tuple[list[str], list[str], list[str]]:
    """(options, script and its arguments, the options `launch` does not know; `options` from
    `launch_options`). An unknown option takes no value here, so that the error names it, not the
    option after it."""
    head: list[str] = []
    unknown: list[str] = []
    i = 0
    while i < len(argv):
        a = argv[i]
        if not a.startswith("-"):
            return head, argv[i:], unknown
        head.append(a)
        name = _known(a.split("=", 1)[0], options)
        if name is None:
            unknown.append(a.split("=", 1)[0])
        elif "=" not in a and options[name] and i + 1 < len(argv):
            head.append(argv[i + 1])
            i += 1
        i += 1
    return head, [], unknown


def launch_hostfile(args: argparse.Namespace, default: str) -> str | None:
    """The hostfile a launch reads: --hostfile, else DeepSpeed's runner's `/job/hostfile` (`default`)
    where it exists and the launch is no node's own (specs/cli.md §`fnzero launch --hostfile FILE`)."""
    if (args.hostfile is None and args.nnodes is None and args.node_rank is None and args.world_info is None
            and args.nproc_per_node is None and os.path.isfile(default)):
        return default
    return args.hostfile


def too_few_ranks(args: argparse.Namespace, n: int) -> str:
    """The line refusing `n` ranks on this node, naming the flag that gave it."""
    return f"--{'num_gpus' if args.num_gpus is not None else 'nproc-per-node'} must be at least 1, got {n}"


def launch_flag_problems(args: argparse.Namespace, hostfile: str | None) -> list[str]:
    """What is wrong with `launch`'s flags as given, one line each (nothing started yet); `hostfile`
    the one the launch reads (`launch_hostfile`)."""
    out = []
    try:
        shlex.split(args.launcher_args)
    except ValueError as e:  # split again where each launcher builds its command
        out.append(f"--launcher_args {args.launcher_args!r}: {e}")
    if args.master_port is not None and not 0 < args.master_port < 65536:
        out.append(f"--master_port {args.master_port}: a TCP port is 1-65535")
    return out + _conflicting_flags(args, hostfile)


def ignored_flag_warnings(args: argparse.Namespace, hostfile: str | None) -> list[str]:
    """Flags accepted, as DeepSpeed's runner accepts them, that this launch does not act on."""
    slurm = bool(hostfile) and args.launcher == "slurm" and not args.no_ssh
    return [f"{flag} has no effect without --hostfile and --launcher slurm (it is srun's {flag})"
            for flag, given in (("--comment", args.comment), ("--account", args.account)) if given and not slurm]


def _conflicting_flags(args: argparse.Namespace, hostfile: str | None) -> list[str]:
    """Flags given together where one would silently win over the other, one line each."""
    out = []
    if hostfile:
        slots = "the hostfile's slots (--num_gpus, --include and --exclude select among them)"
        if args.nproc_per_node is not None:
            out.append(f"--nproc-per-node cannot be used with --hostfile: each host runs {slots}")
        if args.nnodes is not None:
            out.append("--nnodes cannot be used with --hostfile: the hosts are the hostfile's (--num_nodes selects "
                       "among them)")
        if args.node_rank is not None and not args.no_ssh:
            out.append("--node_rank needs --no_ssh with --hostfile (this node's share, started by hand); without it "
                       "every host is started")
        if args.no_ssh and args.launcher != "ssh":
            out.append(f"--launcher {args.launcher} cannot be used with --no_ssh: each node is then started by hand")
    elif None not in (args.num_gpus, args.nproc_per_node) and args.num_gpus != args.nproc_per_node:
        out.append(f"--num_gpus {args.num_gpus} and --nproc-per-node {args.nproc_per_node} disagree: give one")
    return out
