"""`fnzero launch --hostfile FILE --launcher NAME`: the command line and environment each launcher
tool gets (`specs/cli.md` §Launchers), DeepSpeed's `multinode_runner.py` meaning. Pure: builds the
command, runs nothing.

With an MPI launcher or srun each process the tool starts is one rank, which runs the script and
reads its rank from the tool's variables; with pdsh each host runs one `fnzero launch`.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import os
import re
import shlex

from ._binding import bind_command, rank_program
from ._hosts import LaunchError
from ._rank_front import front_flags

__all__ = ["LAUNCHERS", "LaunchJob", "launcher_command", "launcher_tool", "default_exports", "quote_export",
           "encode_world_info", "decode_world_info", "node_flags", "pdsh_kill_command", "MVAPICH_HOSTFILE",
           "PDSH_MAX_FAN_OUT"]

LAUNCHERS = ("ssh", "pdsh", "openmpi", "mpich", "impi", "mvapich", "slurm")
PDSH_MAX_FAN_OUT = 1024
MVAPICH_HOSTFILE = "/tmp/deepspeed_mvapich_hostfile"  # DeepSpeed's name: the host list mpirun reads


@dataclasses.dataclass(frozen=True)
class LaunchJob:
    """One multi-node launch: the hosts and slots it runs on, what every rank runs, how."""
    launcher: str
    hostfile: str  # the hostfile (Open MPI reads it; a filtered copy when filters narrowed it)
    active: dict[str, list[int]]  # host -> its slots, in rank order
    exports: dict[str, str]  # variables every rank gets (pdsh's shell line quotes them: `quote_export`)
    master_addr: str
    master_port: int
    python: str
    cwd: str
    script: str
    script_args: tuple[str, ...] = ()
    launcher_args: str = ""
    module: bool = False
    no_python: bool = False
    bind_cores_to_rank: bool = False
    bind_core_list: str | None = None
    save_pid: int | None = None  # the front launcher's pid, the pid file's name
    quiet: bool = False
    ssh_port: int | None = None
    narrowed: bool = False  # --include/--exclude given (srun then names the hosts)
    num_nodes: int = -1
    num_gpus: int = -1
    slurm_comment: str = ""
    slurm_account: str = ""
    rank_log: str | None = None  # --enable_each_rank_log's FOLDER/<launch time>: each rank's file starts so


def quote_export(value: str) -> str:
    """A variable's value in pdsh's remote shell line (DeepSpeed's add_export): stripped, and in
    double quotes when it holds anything but word characters and @%+=:,./-. (mpirun and srun get
    each value as one word of their command, unquoted.)"""
    value = value.strip()
    return f'"{value}"' if re.search(r"[^\w@%+=:,./-]", value) else value


def default_exports(launcher: str, cuda: bool) -> dict[str, str]:
    """The variables a launcher sets before the forwarded ones (DeepSpeed's runners' own)."""
    if launcher == "openmpi":
        return {"UCX_TLS": "tcp"}
    if launcher == "mvapich":
        return {"MV2_SMP_USE_CMA": "0", "MV2_DEBUG_SHOW_BACKTRACE": "1", **({"MV2_USE_CUDA": "1"} if cuda else {}),
                "MV2_SUPPORT_DL": "1", "MV2_ENABLE_AFFINITY": "0", "MV2_INTER_ALLGATHER_TUNING": "5",
                "MV2_CUDA_USE_NAIVE": "0"}
    return {}


def encode_world_info(active: dict[str, list[int]]) -> str:
    return base64.urlsafe_b64encode(json.dumps(active).encode()).decode()


def decode_world_info(text: str) -> dict[str, list[int]]:
    try:
        info = json.loads(base64.urlsafe_b64decode(text.encode()))
        return {str(h): [int(s) for s in slots] for h, slots in info.items()}
    except (ValueError, TypeError, AttributeError):
        raise LaunchError(f"--world_info {text[:40]!r}: not a base64 JSON host -> slots map") from None


def launcher_tool(launcher: str) -> str:
    """The program a launcher runs (it must be on PATH)."""
    return {"pdsh": "pdsh", "slurm": "srun"}.get(launcher, "mpirun")


def _per_node(job: LaunchJob) -> tuple[int, int]:
    """(ranks in all, ranks per host): MPICH, Intel MPI and MVAPICH2 place the same number on each."""
    counts = [len(s) for s in job.active.values()]
    if len(set(counts)) > 1:
        raise LaunchError(f"--launcher {job.launcher} needs the same number of slots on every host, got "
                          f"{ {h: len(s) for h, s in job.active.items()} }")
    return sum(counts), counts[0]


def _program(job: LaunchJob) -> list[str]:
    """What each rank runs; with --bind_cores_to_rank or --enable_each_rank_log behind fnzero's rank
    front, which reads the rank's ranks from the tool's variables."""
    if not (job.bind_cores_to_rank or job.rank_log):
        return rank_program(job.python, job.script, list(job.script_args), job.module, job.no_python)
    rank_program(job.python, job.script, [], job.module, job.no_python)  # the same checks
    return _front(job, job.bind_cores_to_rank)


def _front(job: LaunchJob, bind: bool) -> list[str]:
    """The rank front running the job's script: binding when `bind`, logging with --rank_log."""
    flags = front_flags(bind, job.bind_core_list, job.rank_log, job.module, job.no_python)
    return [job.python, "-u", "-m", "fnzero.cli._rank_front", *flags, job.script, *job.script_args]


def _openmpi(job: LaunchJob) -> list[str]:
    extra = shlex.split(job.launcher_args)
    # Open MPI's TCP transport on eth0 unless the launcher args choose (as DeepSpeed).
    chosen = any(a in ("-mca", "--mca") and b == "btl_tcp_if_include" for a, b in zip(extra, extra[1:]))
    cmd = ["mpirun", "-n", str(sum(len(s) for s in job.active.values())), "-hostfile", job.hostfile,
           "--mca", "btl", "^openib", *([] if chosen else ["--mca", "btl_tcp_if_include", "eth0"]), *extra]
    for k, v in job.exports.items():
        cmd += ["-x", f"{k}={v}"]
    return cmd + ["-x", f"MASTER_ADDR={job.master_addr}", "-x", f"MASTER_PORT={job.master_port}"] + _program(job)


def _hydra_exports(job: LaunchJob, total: int, per_node: int, flag_value: bool) -> list[str]:
    """MPICH's and Intel MPI's `-genv` list: the forwarded variables, the rendezvous, the sizes."""
    out: list[str] = []
    for k, v in job.exports.items():
        out += ["-genv", k, v] if flag_value else ["-genv", f"{k}={v}"]
    if job.launcher == "impi" and job.bind_cores_to_rank:
        out += ["-genv", "OMP_NUM_THREADS", str(bind_command(job.bind_core_list, per_node, 0)[0])]
    out += ["-genv", "MASTER_ADDR", job.master_addr, "-genv", "MASTER_PORT", str(job.master_port),
            "-genv", "WORLD_SIZE", str(total), "-genv", "LOCAL_SIZE", str(per_node)]
    if job.launcher == "impi":
        out += ["-genv", "I_MPI_PIN", "0"]  # fnzero's (DeepSpeed's) binding, not Intel MPI's
    return out + ["-hosts", ",".join(job.active)]


def _mpich(job: LaunchJob) -> list[str]:
    total, per_node = _per_node(job)
    return (["mpirun", "-n", str(total), "-ppn", str(per_node), *shlex.split(job.launcher_args)]
            + _hydra_exports(job, total, per_node, False) + _program(job))


def _impi(job: LaunchJob) -> list[str]:
    """Intel MPI: one `-n 1 -env RANK i -env LOCAL_RANK l` section per rank, bound in the command."""
    total, per_node = _per_node(job)
    cmd = ["mpirun", "-ppn", str(per_node), *shlex.split(job.launcher_args),
           *_hydra_exports(job, total, per_node, True)]
    for i in range(total):
        local = i % per_node
        bound = bind_command(job.bind_core_list, per_node, local)[1] if job.bind_cores_to_rank else []
        program = rank_program(job.python, job.script, list(job.script_args), job.module, job.no_python)
        if job.rank_log:  # bound above; the front only opens the rank's log file
            program = _front(job, bind=False)
        cmd += ([":"] if i else []) + ["-n", "1", "-env", "RANK", str(i), "-env", "LOCAL_RANK", str(local),
                                       *bound, *program]
    return cmd


def _mvapich(job: LaunchJob) -> list[str]:
    total, per_node = _per_node(job)
    cmd = ["mpirun", "-np", str(total), "-ppn", str(per_node), "--hostfile", MVAPICH_HOSTFILE,
           *shlex.split(job.launcher_args)]
    for k, v in job.exports.items():
        cmd += ["-env", f"{k}={v}"]
    return cmd + ["-env", f"MASTER_ADDR={job.master_addr}", "-env", f"MASTER_PORT={job.master_port}"] + _program(job)


def _slurm(job: LaunchJob) -> list[str]:
    _per_node(job)
    cmd = ["srun", "-n", str(sum(len(s) for s in job.active.values())), *shlex.split(job.launcher_args)]
    if job.slurm_comment:
        cmd += ["--comment", job.slurm_comment]
    if job.slurm_account:
        cmd += ["--account", job.slurm_account]
    if job.narrowed:  # srun has no --include: name the hosts left
        cmd += ["--nodelist", ",".join(job.active), "--nodes", str(len(job.active))]
    if job.num_nodes > 0:
        cmd += ["--nodes", str(job.num_nodes)]
    if job.num_gpus > 0:
        cmd += ["--gpus-per-node", str(job.num_gpus)]
    exports = "".join(f",{k}={v}" for k, v in job.exports.items())
    return cmd + [f"--export=ALL{exports},MASTER_ADDR={job.master_addr},MASTER_PORT={job.master_port}"] + _program(job)


def node_flags(module: bool, no_python: bool, save_pid: int | None, bind_cores_to_rank: bool,
               bind_core_list: str | None, quiet: bool, rank_log_folder: str | None = None) -> list[str]:
    """The flags a per-host `fnzero launch` (pdsh's, ssh's) is given from the front's; each host
    names its ranks' log files by its own launch time, as DeepSpeed's launch.py on each node."""
    return ((["--no_python"] if no_python else []) + (["--module"] if module else [])
            + ([f"--save_pid={save_pid}"] if save_pid is not None else [])
            + (["--bind_cores_to_rank"] if bind_cores_to_rank else [])
            + ([f"--bind_core_list={bind_core_list}"] if bind_core_list else []) + (["-q"] if quiet else [])
            + ([f"--enable_each_rank_log={rank_log_folder}"] if rank_log_folder else []))


def pdsh_node_launch(job: LaunchJob) -> list[str]:
    """The per-host `fnzero launch` pdsh runs (`%n`: pdsh's rank of the host)."""
    return [job.python, "-u", "-m", "fnzero.cli", "launch", f"--world_info={encode_world_info(job.active)}",
            "--node_rank=%n", f"--master_addr={job.master_addr}", f"--master_port={job.master_port}",
            *node_flags(job.module, job.no_python, job.save_pid, job.bind_cores_to_rank, job.bind_core_list, job.quiet,
                        os.path.dirname(job.rank_log) if job.rank_log else None)]


def _pdsh(job: LaunchJob) -> list[str]:
    # pdsh joins the words into one remote shell line: an argument with spaces keeps them in quotes.
    args = [f'"{a.replace(chr(34), chr(92) + chr(34))}"' if " " in a else a for a in job.script_args]
    exports = "".join(f"export {k}={quote_export(v)}; " for k, v in job.exports.items())
    return (["pdsh", "-S", "-f", str(PDSH_MAX_FAN_OUT), "-w", ",".join(job.active), *shlex.split(job.launcher_args),
             exports, f"cd {job.cwd};"] + pdsh_node_launch(job) + [job.script, *args])


def launcher_command(job: LaunchJob, environment: dict[str, str]) -> tuple[list[str], dict[str, str]]:
    """(the command to run here, the environment to run it with)."""
    env = dict(environment)
    if job.launcher == "pdsh":
        env["PDSH_RCMD_TYPE"] = "ssh"
        if job.ssh_port is not None:
            env["PDSH_SSH_ARGS_APPEND"] = f"{env.get('PDSH_SSH_ARGS_APPEND', '')} -p {job.ssh_port}"
        return _pdsh(job), env
    for host, slots in job.active.items():  # a rank's device is its local rank: no slot choice
        if slots != list(range(len(slots))):
            raise LaunchError(f"--launcher {job.launcher} cannot select device ids ({slots} on {host}): filter "
                              "whole hosts, or keep the first N slots of every host")
    builders = {"openmpi": _openmpi, "mpich": _mpich, "impi": _impi, "mvapich": _mvapich, "slurm": _slurm}
    build = builders.get(job.launcher)
    if build is None:
        raise LaunchError(f"--launcher {job.launcher!r}: expected one of {', '.join(LAUNCHERS)}")
    return build(job), env


def pdsh_kill_command(job: LaunchJob) -> list[str]:
    """Ends this job's per-host launchers (pdsh does not forward a signal): their command lines
    name this job's world and port."""
    pattern = f"fnzero.cli launch --world_info={encode_world_info(job.active)} --node_rank=[0-9]* " \
              f"--master_addr={job.master_addr} --master_port={job.master_port}"
    return ["pdsh", "-S", "-f", str(PDSH_MAX_FAN_OUT), "-w", ",".join(job.active), *shlex.split(job.launcher_args),
            f"pkill -f {shlex.quote(pattern)}"]
