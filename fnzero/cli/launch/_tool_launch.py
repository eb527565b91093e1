"""`fnzero launch --hostfile FILE --launcher pdsh|openmpi|mpich|impi|mvapich|slurm`: runs the command
`_launchers.launcher_command` builds, here, and waits for it (`specs/cli.md` §Launchers)."""

from __future__ import annotations

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
from ._multinode import check_ssh, forwarded_env, master_addr
from ._rank_front_args import rank_log_prefix

__all__ = ["launch_with_tool", "pid_file"]

_GRACE_S = 10.0  # after a stop, how long the tool gets to end before it is killed


def pid_file(front_pid: int) -> str:
    """Where `--save_pid` leaves the launcher's pid (DeepSpeed's name, for tools that wait on it)."""
    return os.path.join(tempfile.gettempdir(), f"{front_pid}.deepspeed")


def _job(args, rest: list[str], hosts: dict[str, int], active: dict[str, list[int]], hostfile: str) -> LaunchJob:
    cuda = False
    if args.launcher == "mvapich":  # its CUDA-aware transport is asked for on CUDA machines only
        import torch

        cuda = torch.cuda.is_available()
    exports = {**default_exports(args.launcher, cuda), **forwarded_env()}
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


def launch_with_tool(args, rest: list[str], hosts: dict[str, int], active: dict[str, list[int]]) -> int:
    """Run the launcher's tool over the selected hosts; its exit status."""
    tool = launcher_tool(args.launcher)
    if shutil.which(tool) is None:
        raise LaunchError(f"--launcher {args.launcher}: `{tool}` is not on PATH; install it, or use "
                          "--launcher ssh (the default)")
    check_ssh(args, list(active))
    # Every rank imports from this directory first, as DeepSpeed's runner arranges.
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")]))
    with tempfile.TemporaryDirectory(prefix="fnzero-launch-") as tmp:
        hostfile = args.hostfile
        if args.launcher == "openmpi" and active != {h: list(range(n)) for h, n in hosts.items()}:
            hostfile = os.path.join(tmp, "hostfile")  # mpirun reads the hosts the filters keep
            with open(hostfile, "w") as f:
                f.writelines(f"{h} slots={len(s)}\n" for h, s in active.items())
        job = _job(args, rest, hosts, active, hostfile)
        cmd, env = launcher_command(job, dict(os.environ))
        if args.launcher == "mvapich":
            with open(MVAPICH_HOSTFILE, "w") as f:
                f.writelines(f"{h}\n" for h in active)
        if not args.quiet:
            print(f"fnzero launch: {args.launcher} on {len(active)} host(s) "
                  f"{', '.join(f'{h}:{len(s)}' for h, s in active.items())}, rendezvous at "
                  f"{job.master_addr}:{job.master_port}: {subprocess.list2cmdline(cmd)}", file=sys.stderr, flush=True)
        return _run(cmd, env, pdsh_kill_command(job) if args.launcher == "pdsh" else None,
                    pid_file(os.getpid()) if args.save_pid is not None and args.launcher != "pdsh" else None)


def _run(cmd: list[str], env: dict[str, str], kill_cmd: list[str] | None, pid_path: str | None) -> int:
    """Run the tool; on Ctrl-C or SIGTERM pass it on (and, for pdsh, end the per-host launchers)."""
    if pid_path:
        with open(pid_path, "w") as f:
            f.write(str(os.getpid()))
    proc = subprocess.Popen(cmd, env=env)
    stopping: list[float] = []  # when a stop was asked for

    def stop(signum, frame):  # no waiting here: the loop below reaps the tool
        stopping.append(time.monotonic())
        if kill_cmd:  # pdsh: end each host's launcher; its ssh sessions, then pdsh, end with them
            subprocess.run(kill_cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=60)
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
