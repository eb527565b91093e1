"""`python -m fnzero.cli._rank_front [--bind_cores_to_rank [--bind_core_list=L]] [--rank_log=PREFIX]
[--module | --no_python] SCRIPT ARGS`: what `fnzero launch` runs in front of each rank to bind its
cores or give it its own log file (`specs/cli.md` §Launcher flags). It reads the rank from the
launcher's environment (torchrun's, an MPI's, SLURM's), then replaces itself with the rank's
program. The launcher's side, the flags for a launch's options and the log files' prefix, is here too."""

from __future__ import annotations

import os
import sys
import time

from ._binding import bind_command, rank_program
from ._hosts import LaunchError

__all__ = ["main", "front_flags", "rank_log_folder", "rank_log_prefix"]


def main(argv: list[str]) -> None:
    """Log, bind, then become the rank's program."""
    from ..._launch_env import launcher_ranks

    opts: dict[str, str] = {}
    while argv and argv[0].startswith("--"):
        flag, _, value = argv.pop(0).partition("=")
        opts[flag] = value
    rank, _, local_rank, local_size = launcher_ranks()
    prefix: list[str] = []
    try:
        program = rank_program(sys.executable, argv[0], argv[1:], "--module" in opts, "--no_python" in opts)
        if "--bind_cores_to_rank" in opts:
            per, prefix = bind_command(opts.get("--bind_core_list") or None, local_size or 1, local_rank)
            os.environ["OMP_NUM_THREADS"] = str(per)
        if "--rank_log" in opts:  # this host's folder may not exist yet (an MPI rank on another host)
            path = f"{opts['--rank_log']}_rank{rank if rank is not None else local_rank}.log"
            os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)  # a restart adds
    except (LaunchError, OSError) as e:
        print(f"fnzero launch: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    if "--rank_log" in opts:
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
    os.execvp((prefix + program)[0], prefix + program)


def front_flags(bind_cores_to_rank: bool, bind_core_list: str | None, rank_log: str | None, module: bool,
                no_python: bool) -> list[str]:
    """The front's flags for a launch's options (empty: no front needed beyond them)."""
    return ((["--bind_cores_to_rank"] if bind_cores_to_rank else [])
            + ([f"--bind_core_list={bind_core_list}"] if bind_cores_to_rank and bind_core_list else [])
            + ([f"--rank_log={rank_log}"] if rank_log else [])
            + (["--module"] if module else []) + (["--no_python"] if no_python else []))


def rank_log_folder(value: str | None) -> str | None:
    """`--enable_each_rank_log`'s folder, or None when it is off (unset, or DeepSpeed's "None")."""
    return None if value in (None, "None") else value


def rank_log_prefix(folder: str | None) -> str | None:
    """`--enable_each_rank_log FOLDER` (DeepSpeed's; "None", its default, is off): the folder,
    made if missing, and the launch time, the start of every rank's file name
    (`FOLDER/%Y%m%d%H%M%S_rank<R>.log`, as DeepSpeed's launch.py names them)."""
    folder = rank_log_folder(folder)
    if folder is None:
        return None
    if os.path.isfile(folder):
        raise LaunchError(f"--enable_each_rank_log {folder!r}: a file, not a folder")
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as e:
        raise LaunchError(f"--enable_each_rank_log {folder!r}: cannot make the folder ({e.strerror})") from None
    return os.path.join(os.path.abspath(folder), time.strftime("%Y%m%d%H%M%S"))
