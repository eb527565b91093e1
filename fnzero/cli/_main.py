"""The `fnzero` command: launch, report, config."""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import sys
import tempfile
import threading

from . import _bench as bench_commands
from . import _autotune as autotune_commands
from . import _checkpoint as checkpoint_commands
from . import _config as config_commands
from . import _plan as plan_commands
from . import _remote as ssh_commands
from .launch._hosts import DEFAULT_HOSTFILE, LaunchError
from .launch._checks import (ignored_flag_warnings, launch_flag_problems, launch_options, scan_launch_args,
                             take_default_hostfile)
from .launch._flags import add_launcher_flags
from .launch._rank_front_args import rank_log_folder

__all__ = ["build_parser", "main", "split_launch_args"]


def _cmd_launch(args: argparse.Namespace, rest: list[str]) -> int:
    if args.autotuning:
        return _autotune_from_launch(args, rest)
    take_default_hostfile(args, DEFAULT_HOSTFILE)
    problems = launch_flag_problems(args)
    for line in problems + [f"warning: {w}" for w in ignored_flag_warnings(args)]:
        print(f"fnzero launch: {line}", file=sys.stderr)
    if problems:
        return 2
    here = bool(args.hostfile and not args.no_ssh)  # a hostfile: its hosts start, unless one host runs here
    if here and (status := _start_hosts(args, rest)) is not None:
        return status
    if not rest:
        print("fnzero launch: name the training script, e.g. `fnzero launch --nproc-per-node 2 train.py`", file=sys.stderr)
        return 2
    from .launch._multinode import machine_slots, this_machine

    try:
        if here:
            pass  # one_host_here said this node's ranks
        elif args.hostfile or args.world_info:  # this node's share of a multi-node job
            _this_node(args)
        elif (args.include or args.exclude) and not ((args.num_nodes or 1) > 1 or args.no_ssh or args.launcher != "ssh"):
            this_machine(args)
        elif args.include or args.exclude or (args.num_nodes or 1) > 1 or args.no_ssh or args.launcher != "ssh":
            print("fnzero launch: --include/--exclude/--num_nodes/--no_ssh/--launcher select and start hosts of a "
                  "--hostfile", file=sys.stderr)
            return 2
        elif args.num_gpus is not None:  # `deepspeed --num_gpus 2 train.py` on one node
            args.nproc_per_node = args.num_gpus
        if args.nproc_per_node is None:  # as DeepSpeed's runner: every device of this machine
            args.nproc_per_node = machine_slots()
        if args.nproc_per_node < 1:
            raise LaunchError(_too_few_ranks(args, args.nproc_per_node))
        argv = _torchrun_argv(args)
        program = _program(args, rest)
    except LaunchError as e:
        print(f"fnzero launch: {e}", file=sys.stderr)
        return 2
    if argv is None:
        return 2
    if args.exit_with_stdin:
        _exit_with_stdin()
    if args.quiet:
        os.environ["LOGLEVEL"] = "ERROR"  # torchrun's own logging
    pid_path = None
    if args.save_pid is not None:  # DeepSpeed's launch.py: named after the front launcher's pid
        from .launch._tool_launch import pid_file

        pid_path = pid_file(os.getpid() if args.save_pid < 0 else args.save_pid)
        if not args.quiet:  # a launcher line, which -q leaves out
            print(f"launcher pid: {os.getpid()}")
        with open(pid_path, "w") as f:
            f.write(str(os.getpid()))
    try:
        return _run_torchrun(argv + program)
    finally:
        if pid_path and os.path.exists(pid_path):
            os.remove(pid_path)


def _autotune_from_launch(args: argparse.Namespace, rest: list[str]) -> int:
    """DeepSpeed's `deepspeed --autotuning tune|run --num_gpus N script ...`: `fnzero autotune` with
    this node's N ranks (--num_gpus, else --nproc-per-node) and the per-rank flags every trial
    takes (`_tune_jobs.launch_flags`). Each trial is its own job on this node on a free port, so
    flags that choose or start other hosts are refused, and the port and restart flags warned of."""
    from ._tune_jobs import launch_flags

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
    from .launch._multinode import machine_slots

    world = next((n for n in (args.num_gpus, args.nproc_per_node) if n is not None), None)
    world = machine_slots() if world is None else world
    if world < 1:
        print(f"fnzero launch: {_too_few_ranks(args, world)}", file=sys.stderr)
        return 2
    run = ["--run"] if args.autotuning == "run" else []
    tune = build_parser().parse_args(["autotune", "--world", str(world), *run, *launch_flags(args), *rest])
    return int(tune.func(tune))


def _too_few_ranks(args: argparse.Namespace, n: int) -> str:
    return f"--{'num_gpus' if args.num_gpus is not None else 'nproc-per-node'} must be at least 1, got {n}"


def _this_node(args: argparse.Namespace) -> None:
    """--no_ssh --node_rank i with a hostfile (each node started by hand), or pdsh's per-host
    `--world_info ... --node_rank N`: this node's ranks, its rank among the nodes, the master."""
    from .launch._launchers import decode_world_info
    from .launch._multinode import run_slots_here, selected_hosts

    active = decode_world_info(args.world_info) if args.world_info else selected_hosts(args)[1]
    hosts = list(active)
    if args.node_rank is None or not 0 <= args.node_rank < len(hosts):
        raise LaunchError(f"--node_rank {args.node_rank}: give this node's rank, 0..{len(hosts) - 1} "
                          f"(hosts: {hosts})")
    run_slots_here(args, active[hosts[args.node_rank]])
    args.nnodes = len(hosts)
    args.master_addr = args.master_addr or hosts[0]


def _start_hosts(args: argparse.Namespace, rest: list[str]) -> int | None:
    """A hostfile's job: the exit status of starting its hosts, or None when the selection is one
    host whose ranks run here (`one_host_here`)."""
    from .launch._multinode import launch_hostfile, one_host_here

    if not rest:
        print("fnzero launch: name the training script, e.g. `fnzero launch --hostfile hosts train.py`",
              file=sys.stderr)
        return 2
    try:
        if one_host_here(args):
            return None
    except LaunchError as e:
        print(f"fnzero launch: {e}", file=sys.stderr)
        return 2
    return launch_hostfile(args, rest)


def _program(args: argparse.Namespace, rest: list[str]) -> list[str]:
    """torchrun's words for what each rank runs: `[-m] SCRIPT ARGS`, `--no-python SCRIPT ARGS`, or,
    with --bind_cores_to_rank or --enable_each_rank_log, fnzero's rank front (`_rank_front.py`)."""
    from .launch._binding import bind_command, check_cores_exist, rank_program
    from .launch._rank_front_args import front_flags, rank_log_prefix

    rank_program(sys.executable, rest[0], [], args.module, args.no_python)  # the flags' checks
    if not (args.module or args.no_python) and not os.path.isfile(rest[0]):
        raise LaunchError(f"script {rest[0]!r} not found (from {os.getcwd()})")
    if args.bind_cores_to_rank:
        bind_command(args.bind_core_list, args.nproc_per_node, 0)  # each rank's step would refuse it: refuse once, here
        check_cores_exist(args.bind_core_list)
    log = rank_log_prefix(args.enable_each_rank_log)
    if args.bind_cores_to_rank or log:
        flags = front_flags(args.bind_cores_to_rank, args.bind_core_list, log, args.module, args.no_python)
        return ["--no-python", sys.executable, "-u", "-m", "fnzero.cli._rank_front", *flags, *rest]
    return (["--module"] if args.module else []) + (["--no-python"] if args.no_python else []) + rest


def _torchrun_argv(args: argparse.Namespace) -> list[str] | None:
    """torchrun's options for this node (None: a usage error, already printed)."""
    from ..sharding.comm._dist import free_port

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
            return None
        argv += ["--node-rank", str(node_rank or 0), "--master-addr", master_addr,
                 "--master-port", str(args.master_port or 29500)]
    if args.max_restarts is not None:
        argv += ["--max-restarts", str(args.max_restarts)]
    # torchrun checks its workers every 0.1 s and stops the others at once when one fails: a rank
    # whose collective failed because a peer died then often has no time to say which (the
    # watchdog looks for up to 1.5 s, and usually needs a few ms). 1 s lets it report under load;
    # a job, failed or finished, ends at most that much later.
    return argv + ["--monitor-interval", "1"]


def _run_torchrun(argv: list[str]) -> int:
    """torchrun's agent on this node; its exit status. When it failed, the last line names the
    rank at fault, from what the ranks left (`sharding/_failure.py`) or else torchrun's own root
    cause."""
    from torch.distributed import run as torchrun

    from .._ext._heap import allocator_env
    from ..sharding.comm._failure import root_cause

    os.environ.update(allocator_env())  # inherited by every worker torchrun starts
    # Each rank leaves its error, or the watchdog's verdict, here (`sharding/_failure.py`), so the
    # last line can name the rank at fault and say what happened.
    failures = tempfile.mkdtemp(prefix="fnzero-launch-")
    os.environ["FNZERO_FAILURE_DIR"] = failures
    # torchrun copies its root cause's error file to its own: there, not a logged complaint that
    # it has none (each worker is given its own path).
    os.environ.setdefault("TORCHELASTIC_ERROR_FILE", os.path.join(failures, "torchrun.error"))
    # torchrun's agent makes a log directory for every run (empty unless asked to redirect the ranks'
    # output, which fnzero does not): without one given it leaves a `torchelastic_*` in the temp
    # directory per launch. In the failures' folder it goes when the launch ends.
    argv = ["--log-dir", os.path.join(failures, "torchelastic"), *argv]
    exits: dict[int, int] = {}
    try:
        torchrun.main(argv)
        code = 0
    except SystemExit as e:  # torchrun exits with the failing worker's code
        code = int(e.code or 0)
    except Exception as e:  # ChildFailedError: its summary names torchrun's root cause
        print(f"fnzero launch: {type(e).__name__}: {e}", file=sys.stderr)
        code = 1
        exits = {int(r): f.exitcode for r, f in getattr(e, "failures", {}).items()}
        if exits:
            first = e.get_first_failure()[0]
            exits = {first: exits[first], **exits}  # torchrun's root cause first
    finally:
        cause = root_cause(failures)
        shutil.rmtree(failures, ignore_errors=True)
    if code and (cause or exits):
        print(f"fnzero launch: root cause: {_blame(cause, exits)}", file=sys.stderr)
    return code


def _blame(cause: tuple[list[int], str, int | None] | None, exits: dict[int, int]) -> str:
    """One line: the rank(s) at fault, how each ended (torchrun's exit status), what happened."""
    def ended(r: int) -> str:
        code = exits.get(r)
        if code is None:
            return ""
        try:
            return f" (ended by {signal.Signals(-code).name})" if code < 0 else f" (exit status {code})"
        except ValueError:
            return f" (exit status {code})"

    if cause is None:  # no rank said anything: a failure before `init_distributed`, say
        r = next(iter(exits))
        return f"rank {r}{ended(r)}, torchrun's first observed failure: see its output above"
    ranks, message, seen_by = cause
    who = ", ".join(f"rank {r}{ended(r)}" for r in ranks)
    return f"{who}: {message}" if seen_by is None else f"{who}, as rank {seen_by} saw it: {message}"


def _exit_with_stdin() -> None:
    """End this launcher (torchrun's agent stops its workers on SIGTERM) when standard input
    closes: started by `fnzero launch --hostfile` over SSH, it so ends with the channel."""
    def watch():  # raw reads: a daemon thread must not hold sys.stdin's lock at interpreter exit
        try:
            while os.read(0, 65536):
                pass
        except OSError:
            pass
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="fnzero-launch-stdin", daemon=True).start()


def _cmd_report(args: argparse.Namespace) -> int:
    from ._report import report_lines

    print("\n".join(report_lines()))
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fnzero", description="ZeRO sharding as pure training steps on PyTorch.")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")

    lp = sub.add_parser("launch", help="start a multi-process run (a front on torchrun)",
                        description="Start one process per rank with torch.distributed.run. Everything after the "
                        "script name is passed to the script.")
    lp.add_argument("--nproc-per-node", type=int, default=None,
                    help="processes on this node (default: one per CUDA device, else one per NUMA node, as DeepSpeed)")
    lp.add_argument("--nnodes", type=int, default=None, help="number of nodes (default 1, or SLURM_NNODES)")
    lp.add_argument("--node-rank", "--node_rank", type=int, default=None, help="this node's rank (multi-node)")
    lp.add_argument("--master-addr", "--master_addr", default=None,
                    help="address of rank 0's node (multi-node; with --hostfile default: the first host's)")
    lp.add_argument("--master-port", "--master_port", type=int, default=None,
                    help="port on the master (default: a free one; 29500 with several nodes)")
    lp.add_argument("--max-restarts", type=int, default=None, help="torchrun restarts on failure (default 0)")
    hp = lp.add_argument_group("multi-node from a DeepSpeed hostfile (ssh to each host)")
    hp.add_argument("-H", "--hostfile", default=None, metavar="FILE",
                    help="'HOST slots=N' lines: start one launcher per host over ssh (passwordless)")
    hp.add_argument("-i", "--include", default=None, metavar="SPEC",
                    help="hosts/slots to use: HOST[:SLOT,...][@HOST...]")
    hp.add_argument("-e", "--exclude", default=None, metavar="SPEC", help="hosts/slots to leave out, same syntax")
    hp.add_argument("--num_nodes", "--num-nodes", type=int, default=None, metavar="N", help="the first N hosts")
    hp.add_argument("--num_gpus", "--num-gpus", "--num_accelerators", type=int, default=None, metavar="N",
                    help="the first N slots of each host")
    hp.add_argument("--ssh_port", "--ssh-port", type=int, default=None, metavar="PORT", help="ssh port of the hosts")
    lp.add_argument("--autotuning", choices=["tune", "run"], default=None,
                    help="tune the script's config (`fnzero autotune`) and, with run, then train with the best")
    lp.add_argument("--exit-with-stdin", action="store_true", help=argparse.SUPPRESS)
    add_launcher_flags(lp)

    sub.add_parser("report", help="environment, devices, backends and native-extension status")

    config_commands.register(sub)
    # Each command family adds its parsers with `set_defaults(func=handler)`, and
    # `handler(args) -> int` is the exit code.
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
    if args.command == "report":
        return _cmd_report(args)
    parser.print_help()
    return 0 if args.command is None else 2


if __name__ == "__main__":
    raise SystemExit(main())
