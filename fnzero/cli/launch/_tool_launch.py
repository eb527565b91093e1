"""`fnzero launch --hostfile FILE --launcher pdsh|openmpi|mpich|impi|mvapich|slurm`: a `LaunchPlan`
of kind `tool`, the command `_launchers.launcher_command` builds, and its executor, which runs it
here and waits for it (`specs/cli.md` §Launchers)."""

from __future__ import annotations

import dataclasses
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

from ._hosts import LaunchError
from ._launchers import (MVAPICH_HOSTFILE, LaunchJob, default_exports, launcher_command, launcher_tool,
                         pdsh_kill_command)
from ._plan import LaunchPlan, pid_file
from ._rank_front import rank_log_prefix
from ._ssh import check_ssh, forwarded_env, master_addr

__all__ = ["plan_tool", "run_tool"]

_GRACE_S = 10.0  # after a stop, how long the tool gets to end before it is killed


def plan_tool(args, rest: list[str], hostfile: str, hosts: dict[str, int], active: dict[str, list[int]]) -> LaunchPlan:
    """The launcher's tool over the selected hosts: it must be on PATH, and every host answers
    over ssh first (`check_ssh`)."""
    tool = launcher_tool(args.launcher)
    if shutil.which(tool) is None:
        raise LaunchError(f"--launcher {args.launcher}: `{tool}` is not on PATH; install it, or use "
                          "--launcher ssh (the default)")
    check_ssh(args, list(active))
    # Every rank imports from this directory first, as DeepSpeed's runner arranges.
    setenv = {"PYTHONPATH": os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")]))}
    environ = {**os.environ, **setenv}
    job = _job(args, rest, active, hostfile, environ)
    cmd, env = launcher_command(job, environ)  # its checks, before anything is made
    files, scratch = {}, None
    if args.launcher == "openmpi" and active != {h: list(range(n)) for h, n in hosts.items()}:
        scratch = tempfile.mkdtemp(prefix="fnzero-launch-")  # mpirun reads the hosts the filters keep
        job = dataclasses.replace(job, hostfile=os.path.join(scratch, "hostfile"))
        files[job.hostfile] = "".join(f"{h} slots={len(s)}\n" for h, s in active.items())
        cmd, env = launcher_command(job, environ)
    if args.launcher == "mvapich":
        files[MVAPICH_HOSTFILE] = "".join(f"{h}\n" for h in active)
    announce = None if args.quiet else (
        f"fnzero launch: {args.launcher} on {len(active)} host(s) "
        f"{', '.join(f'{h}:{len(s)}' for h, s in active.items())}, rendezvous at "
        f"{job.master_addr}:{job.master_port}: {subprocess.list2cmdline(cmd)}")
    return LaunchPlan(kind="tool", launcher=args.launcher, command=tuple(cmd), hosts=active, setenv=setenv,
                      command_env=env, files=files, scratch=scratch, announce=announce,
                      kill_command=tuple(pdsh_kill_command(job)) if args.launcher == "pdsh" else None,
                      pid_file=pid_file(os.getpid()) if args.save_pid is not None and args.launcher != "pdsh" else None)


def _job(args, rest: list[str], active: dict[str, list[int]], hostfile: str, environ: dict[str, str]) -> LaunchJob:
    cuda = False
    if args.launcher == "mvapich":  # its CUDA-aware transport is asked for on CUDA machines only
        import torch

        cuda = torch.cuda.is_available()
    exports = {**default_exports(args.launcher, cuda), **forwarded_env(environ)}
    return LaunchJob(
        launcher=args.launcher, hostfile=hostfile, active=active,
        exports={k: v.strip() for k, v in exports.items()},
        master_addr=master_addr(args, next(iter(active))), master_port=args.master_port or 29500,
        python=sys.executable, cwd=os.getcwd(), script=rest[0], script_args=tuple(rest[1:]),
        launcher_args=args.launcher_args, module=args.module, no_python=args.no_python,
        bind_cores_to_rank=args.bind_cores_to_rank, bind_core_list=args.bind_core_list,
        save_pid=os.getpid() if args.save_pid is not None else None, quiet=args.quiet, ssh_port=args.ssh_port,
        narrowed=bool(args.include or args.exclude), num_nodes=args.num_nodes or -1, num_gpus=args.num_gpus or -1,
        slurm_comment=args.comment, slurm_account=args.account, rank_log=rank_log_prefix(args.enable_each_rank_log))


def run_tool(plan: LaunchPlan) -> int:
    """Run a `tool` plan; the tool's exit status."""
    os.environ.update(plan.setenv)
    try:
        for path, text in plan.files.items():
            with open(path, "w") as f:
                f.write(text)
        if plan.announce:
            print(plan.announce, file=sys.stderr, flush=True)
        return _run(list(plan.command), dict(plan.command_env), plan.kill_command, plan.pid_file)
    finally:
        if plan.scratch:
            shutil.rmtree(plan.scratch, ignore_errors=True)


def _run(cmd: list[str], env: dict[str, str], kill_cmd: tuple[str, ...] | None, pid_path: str | None) -> int:
    """Run the tool; on Ctrl-C or SIGTERM pass it on (and, for pdsh, end the per-host launchers)."""
    if pid_path:
        with open(pid_path, "w") as f:
            f.write(str(os.getpid()))
    proc = subprocess.Popen(cmd, env=env)
    stopping: list[float] = []  # when a stop was asked for

    def stop(signum, frame):  # no waiting here: the loop below reaps the tool
        stopping.append(time.monotonic())
        if kill_cmd:  # pdsh: end each host's launcher; its ssh sessions, then pdsh, end with them
            subprocess.run(list(kill_cmd), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=60)
        else:  # mpirun and srun pass SIGINT on to the ranks
            proc.send_signal(signal.SIGINT)

    old = {s: signal.signal(s, stop) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        while (code := proc.poll()) is None:
            if stopping and time.monotonic() - stopping[0] > _GRACE_S:
                proc.kill()
            time.sleep(0.1)
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        if pid_path and os.path.exists(pid_path):
            os.remove(pid_path)
    return 130 if stopping else (code if code >= 0 else 128 - code)
