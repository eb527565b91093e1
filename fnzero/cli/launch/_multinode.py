"""`fnzero launch --hostfile`: one `fnzero launch` per host over SSH, DeepSpeed-style; a `LaunchPlan`
of kind `ssh` and its executor. What each host runs, with which variables, and how the job ends
as one: `specs/cli.md` §launch --hostfile.
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import time

from ._launchers import node_flags
from ._plan import LaunchPlan
from ._rank_front import rank_log_folder
from ._ssh import check_ssh, forwarded_env, launch_ssh, master_addr, pump

__all__ = ["plan_ssh", "run_over_ssh"]

_GRACE_S = 10.0  # after a failure, how long the other hosts get to stop before their SSH is killed


def plan_ssh(args, rest: list[str], hostfile: str, hosts: dict[str, int], active: dict[str, list[int]]) -> LaunchPlan:
    """The job on every selected host of the hostfile, each started over ssh; every host answers
    first (`check_ssh`)."""
    check_ssh(args, list(active))
    env = forwarded_env()
    addr = master_addr(args, next(iter(active)))
    names = list(active)
    commands = {host: (*launch_ssh(args), host, _remote_command(args, active[host], hosts[host], len(names), i, addr,
                                                                 env, rest))
                for i, host in enumerate(names)}
    announce = None if args.quiet else (
        f"fnzero launch: {len(names)} host(s) {', '.join(f'{h}:{len(s)}' for h, s in active.items())}, "
        f"rendezvous at {addr}:{args.master_port or 29500}")
    return LaunchPlan(kind="ssh", launcher="ssh", hosts=active, host_commands=commands, announce=announce)


def _remote_command(args, host_slots: list[int], all_slots: int, nnodes: int, node_rank: int, addr: str,
                    env: dict[str, str], rest: list[str]) -> str:
    """The shell command host `node_rank` runs: its launcher, in this directory and environment."""
    env = dict(env)
    if host_slots != list(range(all_slots)):  # a subset of the host's devices (--include host:0,2)
        env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, host_slots))
    launch = [sys.executable, "-u", "-m", "fnzero.cli", "launch", "--exit-with-stdin",
              "--nproc-per-node", str(len(host_slots)), "--nnodes", str(nnodes), "--node-rank", str(node_rank),
              "--master-addr", addr, "--master-port", str(args.master_port or 29500)]
    if args.max_restarts is not None:
        launch += ["--max-restarts", str(args.max_restarts)]
    launch += node_flags(args.module, args.no_python, os.getpid() if args.save_pid is not None else None,
                         args.bind_cores_to_rank, args.bind_core_list, args.quiet,
                         rank_log_folder(args.enable_each_rank_log))
    assignments = [f"{k}={shlex.quote(v)}" for k, v in sorted(env.items())]
    return f"cd {shlex.quote(os.getcwd())} && exec env {' '.join(assignments)} {shlex.join(launch + rest)}"


def run_over_ssh(plan: LaunchPlan) -> int:
    """Start every host's launcher; the first failure's exit status."""
    if plan.announce:
        print(plan.announce, file=sys.stderr, flush=True)
    procs: dict[str, subprocess.Popen] = {}
    pumps = []
    for host, cmd in plan.host_commands.items():
        procs[host] = subprocess.Popen(list(cmd), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                       stderr=subprocess.STDOUT)
        pumps.append(pump(procs[host], host))
    code = _supervise(procs)
    for t in pumps:
        t.join(timeout=5)
    return code


def _stop(procs: dict[str, subprocess.Popen]) -> None:
    """Close every host's channel (its launcher stops its workers), then kill what is left."""
    for p in procs.values():
        try:
            p.stdin.close()
        except OSError:
            pass
    deadline = time.monotonic() + _GRACE_S
    for p in procs.values():
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()


def _supervise(procs: dict[str, subprocess.Popen]) -> int:
    """Wait for every host; on the first failure (or Ctrl-C / SIGTERM here) end them all."""
    interrupted = []
    old = signal.signal(signal.SIGTERM, lambda *a: interrupted.append("SIGTERM"))
    try:
        while True:
            done = {h: p.returncode for h, p in procs.items() if p.poll() is not None}
            failed = {h: c for h, c in done.items() if c != 0}
            if failed or interrupted:
                why = (f"host {next(iter(failed))} exited with status {next(iter(failed.values()))}" if failed
                       else f"{interrupted[0]} received")
                print(f"fnzero launch: {why}; ending the job on every host", file=sys.stderr, flush=True)
                _stop(procs)
                return next(iter(failed.values())) if failed else 130
            if len(done) == len(procs):
                return 0
            time.sleep(0.2)
    except KeyboardInterrupt:
        print("fnzero launch: interrupted; ending the job on every host", file=sys.stderr, flush=True)
        _stop(procs)
        return 130
    finally:
        signal.signal(signal.SIGTERM, old)
