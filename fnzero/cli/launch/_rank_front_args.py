"""The launcher's side of the rank front (`_rank_front.py`, which nothing imports): its flags for
a launch's options, and `--enable_each_rank_log`'s folder and file-name prefix."""

from __future__ import annotations

import os
import time

from ._hosts import LaunchError

__all__ = ["front_flags", "rank_log_folder", "rank_log_prefix"]


def front_flags(bind_cores_to_rank: bool, bind_core_list: str | None, rank_log: str | None, module: bool,
                no_python: bool) -> list[str]:
    """This module's flags for a launch's options (empty: no front needed beyond them)."""
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
