"""`LaunchPlan`: exactly what `fnzero launch` will run, decided before anything starts
(`specs/cli.md` §How a launch runs)."""

from __future__ import annotations

import dataclasses
import os
import tempfile

__all__ = ["LaunchPlan", "pid_file"]


@dataclasses.dataclass(frozen=True)
class LaunchPlan:
    """What one launch runs, with what, where; fields a kind does not use keep their defaults."""

    kind: str  # which executor runs it: "torchrun", "ssh" or "tool"
    launcher: str  # torchrun, or --launcher's name (ssh, pdsh, openmpi, mpich, impi, mvapich, slurm)
    command: tuple[str, ...] = ()  # torchrun: its options, then each rank's program; tool: the tool's command
    hosts: dict[str, list[int]] = dataclasses.field(default_factory=dict)  # host -> its slots, in rank order
    host_commands: dict[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)  # ssh: each host's start
    setenv: dict[str, str] = dataclasses.field(default_factory=dict)  # set here before the start; inherited
    command_env: dict[str, str] | None = None  # tool: the tool's whole environment
    files: dict[str, str] = dataclasses.field(default_factory=dict)  # path -> text, written before the start
    scratch: str | None = None  # a temporary folder `files` may lie in, removed when the launch ends
    kill_command: tuple[str, ...] | None = None  # pdsh: ends every host's launcher when this one is stopped
    pid_file: str | None = None  # --save_pid: holds this launcher's pid while it runs
    announce: str | None = None  # the launcher's line before the start (none with -q)
    exit_with_stdin: bool = False  # a host's launcher started over ssh: it ends when the channel closes


def pid_file(front_pid: int) -> str:
    """Where `--save_pid` leaves the launcher's pid (DeepSpeed's name, for tools that wait on it)."""
    return os.path.join(tempfile.gettempdir(), f"{front_pid}.deepspeed")
