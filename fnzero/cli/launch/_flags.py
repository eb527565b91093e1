"""`fnzero launch`'s launcher flags, DeepSpeed's runner's spellings (`specs/cli.md` §Launcher flags)."""

from __future__ import annotations

import argparse

from ._launchers import LAUNCHERS

__all__ = ["add_launcher_flags", "add_rank_flags"]

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
