"""`fnzero launch`'s parser: torchrun's options, the hostfile's, and the launcher flags in DeepSpeed's
runner's spellings (`specs/cli.md` §Launcher flags)."""

from __future__ import annotations

import argparse

from ._launchers import LAUNCHERS

__all__ = ["add_launch_parser", "add_launcher_flags", "add_rank_flags"]


def add_launch_parser(sub) -> argparse.ArgumentParser:
    """`launch`'s parser among the command's `sub`parsers."""
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
    return lp


def add_rank_flags(g) -> None:
    """The flags that shape how each rank of one node runs (the autotuner passes them to every
    trial): --module, --no_python, core binding, -q."""
    g.add_argument("--module", action="store_true", help="run the script as a module (python -m)")
    g.add_argument("--no_python", "--no-python", action="store_true",
                   help="run the script as a program, not with python")
    g.add_argument("--bind_cores_to_rank", "--bind-cores-to-rank", action="store_true",
                   help="give each local rank its own cores (numactl, or taskset) and OMP_NUM_THREADS")
    g.add_argument("--bind_core_list", "--bind-core-list", default=None, metavar="LIST",
                   help="the cores to share out, e.g. 0-7,16-23 (default: every physical core)")
    g.add_argument("-q", "--quiet", action="store_true", help="only errors from the launcher")


def add_launcher_flags(lp: argparse.ArgumentParser) -> None:
    g = lp.add_argument_group("launchers (DeepSpeed's runner flags)")
    g.add_argument("--launcher", default="ssh", choices=LAUNCHERS, type=str.lower,
                   help="with --hostfile: how the hosts are started (default ssh: one `fnzero launch` per host)")
    g.add_argument("--launcher_args", "--launcher-args", default="", metavar="ARGS",
                   help="words given to the launcher tool (mpirun, pdsh, srun, ssh), as one quoted argument")
    g.add_argument("--no_ssh", "--no-ssh", action="store_true",
                   help="with --hostfile and --node_rank: start only this node's ranks (each node by hand)")
    g.add_argument("--comment", default="", metavar="TEXT", help="with --launcher slurm: srun's --comment")
    g.add_argument("--account", default="", metavar="NAME", help="with --launcher slurm: srun's --account")
    add_rank_flags(g)
    g.add_argument("--save_pid", "--save-pid", nargs="?", const=-1, type=int, default=None,
                   help="write this launcher's pid to /tmp/<pid>.deepspeed while it runs")
    g.add_argument("--no_ssh_check", "--no-ssh-check", action="store_true",
                   help="with --hostfile: do not first check that each host answers over passwordless ssh")
    g.add_argument("--enable_each_rank_log", "--enable-each-rank-log", default=None, metavar="FOLDER",
                   help="each rank's stdout and stderr to FOLDER/<launch time>_rank<R>.log instead of the terminal")
    g.add_argument("--force_multi", "--force-multi", action="store_true",
                   help="with --hostfile: start even one host with the launcher (default: one host runs here)")
    g.add_argument("--no_local_rank", "--no-local-rank", action="store_true",
                   help="accepted: fnzero never passes --local_rank (ranks read LOCAL_RANK)")
    g.add_argument("--world_info", default=None, help=argparse.SUPPRESS)  # pdsh's per-host launcher
