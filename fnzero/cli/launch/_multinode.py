"""`fnzero launch --hostfile`: one `fnzero launch` per host over SSH, DeepSpeed-style
(`specs/cli.md` §launch --hostfile).

Host i runs `fnzero launch --nproc-per-node <its slots> --nnodes <hosts> --node-rank i
--master-addr <first host's address>` in this directory, with this Python, with the variables of
`.deepspeed_env` and the launcher's own PYTHON*/NCCL*/GLOO*/FNZERO*... variables. Each host's
output comes back prefixed with its name. The job ends as one: when a host's launcher exits
non-zero, or this launcher is interrupted, every other host's is ended too. The remote launchers
watch their standard input (`--exit-with-stdin`): when the SSH channel closes, for whatever
reason, the remote launcher stops its workers, so no rank outlives the job.
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import threading
import time

from ._hosts import HostfileError, LaunchError, read_env_file, read_hostfile, select
from ._launchers import node_flags
from ._rank_front_args import rank_log_folder

__all__ = ["launch_hostfile", "selected_hosts", "master_addr", "forwarded_env", "FORWARDED_PREFIXES", "one_host_here",
           "this_machine", "run_slots_here"]

# The launcher's variables every host gets: DeepSpeed's EXPORT_ENVS (MLFLOW, PYTHON, MV2, UCX) and
# its CUDA accelerator's (NCCL), plus gloo's interface choice and fnzero's own.
FORWARDED_PREFIXES = ("MLFLOW", "PYTHON", "MV2", "UCX", "NCCL", "GLOO_", "TP_SOCKET", "FNZERO_", "OMP_NUM_THREADS")
_GRACE_S = 10.0  # after a failure, how long the other hosts get to stop before their SSH is killed


def ssh_command(port: int | None, options: str = "") -> list[str]:
    """ssh (or $FNZERO_SSH) that never prompts, with `options` (`--launcher_args` under `--launcher
    ssh`) and `port`."""
    ssh = shlex.split(os.environ.get("FNZERO_SSH", "ssh"))
    opts = ["-o", "BatchMode=yes", *shlex.split(options)]
    if port is not None:
        opts += ["-p", str(port)]
    return ssh + opts


def _ssh(args) -> list[str]:
    """A launch's ssh: `--launcher_args` are ssh's own options under `--launcher ssh`."""
    return ssh_command(args.ssh_port, args.launcher_args if args.launcher == "ssh" else "")


def master_addr(args, first: str) -> str:
    """--master-addr, else the first host's first address as it reports it (`hostname -I`, as
    DeepSpeed does), so every host reaches the rendezvous by the same address."""
    if args.master_addr:
        return args.master_addr
    try:
        out = subprocess.run([*_ssh(args), first, "hostname -I"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise HostfileError(f"cannot reach host {first!r} over ssh to find its address: {e}") from None
    if out.returncode != 0 or not out.stdout.split():
        raise HostfileError(f"ssh {first} 'hostname -I' failed ({out.stderr.strip()[:200] or out.returncode}); "
                            "give --master-addr, and check passwordless ssh to every host")
    return out.stdout.split()[0]


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


def _pump(proc: subprocess.Popen, host: str) -> threading.Thread:
    def run():
        for line in iter(proc.stdout.readline, b""):
            sys.stdout.buffer.write(f"{host}: ".encode() + line)
            sys.stdout.buffer.flush()

    t = threading.Thread(target=run, name=f"fnzero-launch-{host}", daemon=True)
    t.start()
    return t


def selected_hosts(args) -> tuple[dict[str, int], dict[str, list[int]]]:
    """(the hostfile's hosts, the hosts and slots the filters keep)."""
    hosts = read_hostfile(args.hostfile)
    return hosts, select(hosts, args.include or "", args.exclude or "",
                         args.num_nodes if args.num_nodes is not None else -1,
                         args.num_gpus if args.num_gpus is not None else -1)


def forwarded_env() -> dict[str, str]:
    """The variables every host (every rank) gets: the forwarded ones, then `.deepspeed_env`'s."""
    env = {k: v for k, v in os.environ.items() if k.startswith(FORWARDED_PREFIXES)}
    env.update(read_env_file())
    return env


def check_ssh(args, hosts: list[str]) -> None:
    """DeepSpeed's runner's check before a multi-node launch: each host answers over passwordless
    ssh (DeepSpeed tries the first host; here every selected one, at once), so an unreachable host
    is one line before anything starts rather than a launcher's failure on that host. Skipped with
    --no_ssh_check, and for slurm, whose srun reaches the hosts without ssh."""
    if args.no_ssh_check or args.launcher == "slurm":
        return
    ssh = ssh_command(args.ssh_port, args.launcher_args if args.launcher == "ssh" else "") + ["-o", "ConnectTimeout=10"]

    def answer(host: str) -> str | None:
        try:
            r = subprocess.run([*ssh, host, "true"], stdin=subprocess.DEVNULL, capture_output=True, text=True,
                               timeout=60)
        except (OSError, subprocess.TimeoutExpired) as e:
            return str(e)
        return None if r.returncode == 0 else (r.stderr.strip().splitlines() or [f"exit {r.returncode}"])[-1]

    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=min(32, len(hosts))) as pool:
        failed = [(h, why) for h, why in zip(hosts, pool.map(answer, hosts)) if why is not None]
    if failed:
        raise HostfileError("; ".join(f"host {h!r} does not answer over passwordless ssh ({why})" for h, why in failed)
                            + ": set up passwordless ssh to every host, or give --no_ssh_check if "
                            f"--launcher {args.launcher} reaches them another way")


def launch_hostfile(args, rest: list[str]) -> int:
    """Start the job on every selected host of the hostfile, over ssh or with `--launcher`'s tool;
    the first failure's exit status."""
    try:
        hosts, active = selected_hosts(args)
        if args.launcher == "ssh":
            check_ssh(args, list(active))
        else:
            from ._tool_launch import launch_with_tool

            return launch_with_tool(args, rest, hosts, active)
        env = forwarded_env()
        addr = master_addr(args, next(iter(active)))
    except LaunchError as e:
        print(f"fnzero launch: {e}", file=sys.stderr)
        return 2
    names = list(active)
    if not args.quiet:
        print(f"fnzero launch: {len(names)} host(s) {', '.join(f'{h}:{len(s)}' for h, s in active.items())}, "
              f"rendezvous at {addr}:{args.master_port or 29500}", file=sys.stderr, flush=True)
    procs: dict[str, subprocess.Popen] = {}
    pumps = []
    for i, host in enumerate(names):
        cmd = _remote_command(args, active[host], hosts[host], len(names), i, addr, env, rest)
        procs[host] = subprocess.Popen([*_ssh(args), host, cmd], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                       stderr=subprocess.STDOUT)
        pumps.append(_pump(procs[host], host))
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


def run_slots_here(args, slots: list[int], devices: bool = True) -> None:
    """This node runs one rank per slot; a subset of its `devices` (--include host:0,2) becomes
    CUDA_VISIBLE_DEVICES."""
    if devices and slots != list(range(len(slots))):
        os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, slots))
    args.nproc_per_node = len(slots)


def one_host_here(args) -> bool:
    """DeepSpeed's runner: when a hostfile's filters leave one host and --force_multi is not
    given, that host's ranks run here, with neither ssh nor the launcher tool (its slots, a subset
    as CUDA_VISIBLE_DEVICES). True when so (and `args` then says this node's ranks)."""
    _, active = selected_hosts(args)
    if len(active) != 1 or args.force_multi:
        return False
    (host, slots), = active.items()
    run_slots_here(args, slots)
    if not args.quiet:
        print(f"fnzero launch: one host selected ({host}): its {len(slots)} rank(s) run here, as DeepSpeed's runner "
              f"does (--force_multi starts it with --launcher {args.launcher})", flush=True)
    return True


def this_machine(args) -> None:
    """No hostfile: --include/--exclude choose among this machine's slots, DeepSpeed's pool of
    `localhost` with one slot per device (CUDA devices; without them, as DeepSpeed's CPU
    accelerator, one per NUMA node with cores), e.g. `--include localhost:1,2` runs two ranks on
    GPUs 1 and 2."""
    import torch

    slots = select({"localhost": machine_slots()}, args.include or "", args.exclude or "", -1,
                   args.num_gpus if args.num_gpus is not None else -1).get("localhost", [])
    if not slots:
        raise LaunchError("the filters leave no slot of localhost")
    run_slots_here(args, slots, devices=torch.cuda.is_available())


def machine_slots() -> int:
    """How many ranks this machine runs when nothing says: DeepSpeed's `localhost` pool, one per
    CUDA device, else (its CPU accelerator) one per NUMA node with cores."""
    import torch

    from ._binding import numa_nodes

    if torch.cuda.is_available():
        return torch.cuda.device_count()
    return max(1, sum(1 for cores in numa_nodes().values() if cores))
