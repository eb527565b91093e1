"""SSH as the launcher uses it (`specs/cli.md` §launch --hostfile): the command (`FNZERO_SSH`
replaces ssh), the check that every host answers, the rendezvous address the first host reports,
the variables every host gets, and each host's output prefixed with its name."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import threading

from ._hosts import HostfileError, read_env_file

__all__ = ["FORWARDED_PREFIXES", "ssh_command", "launch_ssh", "check_ssh", "master_addr", "forwarded_env", "pump"]

# The launcher's variables every host gets: DeepSpeed's EXPORT_ENVS (MLFLOW, PYTHON, MV2, UCX) and
# its CUDA accelerator's (NCCL), plus gloo's interface choice and fnzero's own.
FORWARDED_PREFIXES = ("MLFLOW", "PYTHON", "MV2", "UCX", "NCCL", "GLOO_", "TP_SOCKET", "FNZERO_", "OMP_NUM_THREADS")


def ssh_command(port: int | None, options: str = "") -> list[str]:
    """ssh (or $FNZERO_SSH) that never prompts, with `options` (`--launcher_args` under `--launcher
    ssh`) and `port`."""
    ssh = shlex.split(os.environ.get("FNZERO_SSH", "ssh"))
    opts = ["-o", "BatchMode=yes", *shlex.split(options)]
    if port is not None:
        opts += ["-p", str(port)]
    return ssh + opts


def launch_ssh(args) -> list[str]:
    """A launch's ssh: `--launcher_args` are ssh's own options under `--launcher ssh`."""
    return ssh_command(args.ssh_port, args.launcher_args if args.launcher == "ssh" else "")


def master_addr(args, first: str) -> str:
    """--master-addr, else the first host's first address as it reports it (`hostname -I`, as
    DeepSpeed does), so every host reaches the rendezvous by the same address."""
    if args.master_addr:
        return args.master_addr
    try:
        out = subprocess.run([*launch_ssh(args), first, "hostname -I"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise HostfileError(f"cannot reach host {first!r} over ssh to find its address: {e}") from None
    if out.returncode != 0 or not out.stdout.split():
        raise HostfileError(f"ssh {first} 'hostname -I' failed ({out.stderr.strip()[:200] or out.returncode}); "
                            "give --master-addr, and check passwordless ssh to every host")
    return out.stdout.split()[0]


def forwarded_env(environ=None) -> dict[str, str]:
    """The variables every host (every rank) gets: the forwarded ones of `environ` (default: this
    process's), then `.deepspeed_env`'s."""
    environ = os.environ if environ is None else environ
    env = {k: v for k, v in environ.items() if k.startswith(FORWARDED_PREFIXES)}
    env.update(read_env_file())
    return env


def check_ssh(args, hosts: list[str]) -> None:
    """DeepSpeed's runner's check before a multi-node launch that each host answers over passwordless
    ssh (specs/cli.md §`fnzero launch --hostfile FILE`, ssh check)."""
    if args.no_ssh_check or args.launcher == "slurm":
        return
    ssh = launch_ssh(args) + ["-o", "ConnectTimeout=10"]

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


def pump(proc: subprocess.Popen, host: str) -> threading.Thread:
    """A thread copying `proc`'s output to this process's stdout, each line prefixed `HOST: `."""
    def run():
        for line in iter(proc.stdout.readline, b""):
            sys.stdout.buffer.write(f"{host}: ".encode() + line)
            sys.stdout.buffer.flush()

    t = threading.Thread(target=run, name=f"fnzero-launch-{host}", daemon=True)
    t.start()
    return t
