"""This node's ranks under torchrun (`specs/cli.md` §fnzero launch): how many, which devices, the
nodes and this node's rank among them, the rendezvous, and what each rank runs; a `LaunchPlan` of
kind `torchrun`."""

from __future__ import annotations

import dataclasses
import os
import sys

from ._binding import bind_command, check_cores_exist, rank_program
from ._checks import too_few_ranks
from ._hosts import LaunchError, read_hostfile, select
from ._launchers import decode_world_info
from ._plan import LaunchPlan, pid_file
from ._rank_front import front_flags, rank_log_prefix

__all__ = ["plan_here", "selected_hosts", "machine_slots", "torchrun_argv", "Share"]


@dataclasses.dataclass(frozen=True)
class Share:
    """This node's part of the job: its ranks, the nodes (None: one, or SLURM's), its rank among
    them, the rendezvous address, and its devices when a subset of its slots (CUDA_VISIBLE_DEVICES)."""

    nproc: int | None
    nnodes: int | None = None
    node_rank: int | None = None
    master_addr: str | None = None
    devices: str | None = None


def plan_here(args, rest: list[str], hostfile: str | None, slots: list[int] | None = None) -> LaunchPlan:
    """The launch of this node's ranks: `slots`, a hostfile's one selected host, else what the
    flags say of this node (`_share`)."""
    share = _share(args, hostfile, slots)
    if share.nproc is None:  # as DeepSpeed's runner: every device of this machine
        share = dataclasses.replace(share, nproc=machine_slots())
    if share.nproc < 1:
        raise LaunchError(too_few_ranks(args, share.nproc))
    argv = torchrun_argv(share, args.master_port, args.max_restarts)
    missing = [] if argv is not None else ["--master-addr is required with --nnodes > 1"]
    try:
        program = _program(args, rest, share.nproc)
    except LaunchError as e:  # each check says its own line
        raise LaunchError("\n".join([*missing, str(e)])) from None
    if missing:
        raise LaunchError(missing[0])
    setenv = {**({"CUDA_VISIBLE_DEVICES": share.devices} if share.devices else {}),
              **({"LOGLEVEL": "ERROR"} if args.quiet else {})}  # -q: torchrun's own logging
    saved = args.save_pid is not None  # DeepSpeed's launch.py: named after the front launcher's pid
    return LaunchPlan(kind="torchrun", launcher="torchrun", command=(*argv, *program), setenv=setenv,
                      pid_file=pid_file(os.getpid() if args.save_pid < 0 else args.save_pid) if saved else None,
                      announce=f"launcher pid: {os.getpid()}" if saved and not args.quiet else None,
                      exit_with_stdin=args.exit_with_stdin)


def _share(args, hostfile: str | None, slots: list[int] | None) -> Share:
    """This node's share as the flags say it; `nproc` None for every device of this machine."""
    if slots is not None:  # the one host a hostfile's filters left, run here
        return Share(len(slots), args.nnodes, args.node_rank, args.master_addr, _devices(slots))
    if hostfile or args.world_info:  # this node's share of a multi-node job
        return _this_node(args, hostfile)
    narrowed = bool(args.include or args.exclude)
    starts_hosts = bool((args.num_nodes or 1) > 1 or args.no_ssh or args.launcher != "ssh")
    if narrowed and not starts_hosts:
        return _this_machine(args)
    if narrowed or starts_hosts:
        raise LaunchError("--include/--exclude/--num_nodes/--no_ssh/--launcher select and start hosts of a --hostfile")
    # `deepspeed --num_gpus 2 train.py` on one node
    nproc = args.num_gpus if args.num_gpus is not None else args.nproc_per_node
    return Share(nproc, args.nnodes, args.node_rank, args.master_addr)


def _devices(slots: list[int]) -> str | None:
    """A subset of the node's devices (--include host:0,2) as CUDA_VISIBLE_DEVICES; None for all."""
    return ",".join(map(str, slots)) if slots != list(range(len(slots))) else None


def selected_hosts(args, hostfile: str) -> tuple[dict[str, int], dict[str, list[int]]]:
    """(the hostfile's hosts, the hosts and slots the filters keep)."""
    hosts = read_hostfile(hostfile)
    return hosts, select(hosts, args.include or "", args.exclude or "",
                         args.num_nodes if args.num_nodes is not None else -1,
                         args.num_gpus if args.num_gpus is not None else -1)


def _this_node(args, hostfile: str | None) -> Share:
    """--no_ssh --node_rank i with a hostfile (each node started by hand), or pdsh's per-host
    `--world_info ... --node_rank N`: this node's ranks, its rank among the nodes, the master."""
    active = decode_world_info(args.world_info) if args.world_info else selected_hosts(args, hostfile)[1]
    hosts = list(active)
    if args.node_rank is None or not 0 <= args.node_rank < len(hosts):
        raise LaunchError(f"--node_rank {args.node_rank}: give this node's rank, 0..{len(hosts) - 1} "
                          f"(hosts: {hosts})")
    slots = active[hosts[args.node_rank]]
    return Share(len(slots), len(hosts), args.node_rank, args.master_addr or hosts[0], _devices(slots))


def _this_machine(args) -> Share:
    """No hostfile: --include/--exclude choose among this machine's slots, DeepSpeed's pool of
    `localhost` (specs/cli.md §fnzero launch)."""
    import torch

    slots = select({"localhost": machine_slots()}, args.include or "", args.exclude or "", -1,
                   args.num_gpus if args.num_gpus is not None else -1).get("localhost", [])
    if not slots:
        raise LaunchError("the filters leave no slot of localhost")
    devices = _devices(slots) if torch.cuda.is_available() else None
    return Share(len(slots), args.nnodes, args.node_rank, args.master_addr, devices)


def machine_slots() -> int:
    """How many ranks this machine runs when nothing says: DeepSpeed's `localhost` pool, one per
    CUDA device, else (its CPU accelerator) one per NUMA node with cores."""
    import torch

    from ._binding import numa_nodes

    if torch.cuda.is_available():
        return torch.cuda.device_count()
    return max(1, sum(1 for cores in numa_nodes().values() if cores))


def torchrun_argv(share: Share, master_port: int | None, max_restarts: int | None) -> list[str] | None:
    """torchrun's options for this node (None: several nodes and no rendezvous address)."""
    from ...sharding import free_port

    argv = ["--nproc-per-node", str(share.nproc)]
    nnodes, node_rank, master_addr = share.nnodes, share.node_rank, share.master_addr
    # Under SLURM (one `fnzero launch` per node) the node count and rank come from the allocation.
    if nnodes is None and "SLURM_NNODES" in os.environ:
        nnodes = int(os.environ["SLURM_NNODES"])
        node_rank = int(os.environ.get("SLURM_NODEID", "0")) if node_rank is None else node_rank
        master_addr = master_addr or os.environ.get("MASTER_ADDR")
    nnodes = nnodes or 1
    argv += ["--nnodes", str(nnodes)]
    if nnodes == 1 and master_addr is None:
        argv += ["--master-addr", "127.0.0.1", "--master-port", str(master_port or free_port())]
    elif master_addr is None:
        return None
    else:
        argv += ["--node-rank", str(node_rank or 0), "--master-addr", master_addr,
                 "--master-port", str(master_port or 29500)]
    if max_restarts is not None:
        argv += ["--max-restarts", str(max_restarts)]
    # torchrun checks its workers every 0.1 s and stops the others at once when one fails: a rank
    # whose collective failed because a peer died then often has no time to say which (the
    # watchdog looks for up to 1.5 s, and usually needs a few ms). 1 s lets it report under load;
    # a job, failed or finished, ends at most that much later.
    return argv + ["--monitor-interval", "1"]


def _program(args, rest: list[str], nproc: int) -> list[str]:
    """torchrun's words for what each rank runs: `[-m] SCRIPT ARGS`, `--no-python SCRIPT ARGS`, or,
    with --bind_cores_to_rank or --enable_each_rank_log, fnzero's rank front (`_rank_front.py`)."""
    rank_program(sys.executable, rest[0], [], args.module, args.no_python)  # the flags' checks
    if not (args.module or args.no_python) and not os.path.isfile(rest[0]):
        raise LaunchError(f"script {rest[0]!r} not found (from {os.getcwd()})")
    if args.bind_cores_to_rank:
        bind_command(args.bind_core_list, nproc, 0)  # each rank's step would refuse it: refuse once, here
        check_cores_exist(args.bind_core_list)
    log = rank_log_prefix(args.enable_each_rank_log)
    if args.bind_cores_to_rank or log:
        flags = front_flags(args.bind_cores_to_rank, args.bind_core_list, log, args.module, args.no_python)
        return ["--no-python", sys.executable, "-u", "-m", "fnzero.cli._rank_front", *flags, *rest]
    return (["--module"] if args.module else []) + (["--no-python"] if args.no_python else []) + rest
