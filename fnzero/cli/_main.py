"""The `fnzero` command: its parser, and each command's handler (`specs/cli.md`)."""

from __future__ import annotations

import argparse
import os
import sys

from . import _bench as bench_commands
from . import _checkpoint as checkpoint_commands
from . import _config as config_commands
from . import _plan as plan_commands
from . import _remote as ssh_commands
from . import _report as report_commands
from . import autotune as autotune_commands
from .launch import add_launch_parser, launch_main, launch_options, scan_launch_args

__all__ = ["build_parser", "main", "split_launch_args"]


def _cmd_launch(args: argparse.Namespace, rest: list[str]) -> int:
    if args.autotuning:  # DeepSpeed's `deepspeed --autotuning tune|run`: the autotuner, given this node's ranks
        return autotune_commands.autotune_from_launch(args, rest)
    return launch_main(args, rest)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fnzero", description="ZeRO sharding as pure training steps on PyTorch.")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    add_launch_parser(sub)  # run by `_cmd_launch`: the script's own arguments are split off first
    # Each other command family adds its parsers with `set_defaults(func=handler)`, and
    # `handler(args) -> int` is the exit code.
    report_commands.register(sub)
    config_commands.register(sub)
    checkpoint_commands.register(sub)
    plan_commands.register(sub)
    bench_commands.register(sub)
    ssh_commands.register(sub)
    autotune_commands.register(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    """Run one command; its exit status. Output cut short by a closed pipe (`fnzero config show
    f | head`) ends quietly with 141, as a Unix tool killed by SIGPIPE, not with a traceback."""
    try:
        return _dispatch(list(sys.argv[1:] if argv is None else argv))
    except BrokenPipeError:
        # Python flushes stdout again at exit and would print a second error: point it at /dev/null.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 141


def split_launch_args(argv: list[str]) -> tuple[list[str], list[str]]:
    """`launch`'s own options, and the script with its arguments (passed through untouched): the
    script is the first word that is neither an option nor an option's value."""
    head, rest, _ = scan_launch_args(argv, launch_options(build_parser()))
    return head, rest


def _dispatch(argv: list[str]) -> int:
    parser = build_parser()
    if argv and argv[0] == "launch":
        head, rest, unknown = scan_launch_args(argv[1:], launch_options(parser))
        for option in unknown:
            print(f"fnzero launch: unknown option {option}: `fnzero launch --help` lists the options, DeepSpeed's "
                  "runner flags among them (specs/cli.md §Launcher flags)", file=sys.stderr)
        if unknown:
            return 2
        args = parser.parse_args(["launch", *head])
        return _cmd_launch(args, rest)
    args = parser.parse_args(argv)
    if getattr(args, "func", None) is not None:
        return int(args.func(args) or 0)
    parser.print_help()
    return 0 if args.command is None else 2


if __name__ == "__main__":
    raise SystemExit(main())
