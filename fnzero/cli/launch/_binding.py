"""`fnzero launch --bind_cores_to_rank [--bind_core_list L]`: each local rank gets its own run of
cores, as DeepSpeed's launch.py does (`specs/cli.md` §Launcher flags); `fnzero.cli._rank_front`
applies it in front of each rank.
"""

from __future__ import annotations

import glob
import os
import shutil

from ._hosts import LaunchError

__all__ = ["parse_core_list", "core_ranges", "physical_cores", "numa_nodes", "bind_command", "check_cores_exist", "rank_program"]


def parse_core_list(text: str) -> list[int]:
    """"1,3-5,7" -> [1, 3, 4, 5, 7]."""
    cores: list[int] = []
    for part in text.split(","):
        lo, sep, hi = part.strip().partition("-")
        try:
            cores += list(range(int(lo), int(hi) + 1)) if sep else [int(lo)]
        except ValueError:
            raise LaunchError(f"--bind_core_list {text!r}: expected numbers and ranges like 1,3-5,7") from None
    return cores


def core_ranges(cores: list[int]) -> str:
    """[0, 1, 2, 5, 7, 8] -> "0-2,5,7-8" (numactl's and taskset's list form)."""
    runs: list[list[int]] = []
    for c in cores:
        if runs and c == runs[-1][-1] + 1:
            runs[-1].append(c)
        else:
            runs.append([c])
    return ",".join(str(r[0]) if len(r) == 1 else f"{r[0]}-{r[-1]}" for r in runs)


def physical_cores() -> int:
    """Physical cores (distinct package/core ids, hyper-threads not counted), as DeepSpeed's
    psutil.cpu_count(logical=False); the logical count where the topology is not readable."""
    seen = set()
    for cpu in glob.glob("/sys/devices/system/cpu/cpu[0-9]*/topology"):
        try:
            with open(f"{cpu}/physical_package_id") as p, open(f"{cpu}/core_id") as c:
                seen.add((p.read().strip(), c.read().strip()))
        except OSError:
            continue
    return len(seen) or os.cpu_count() or 1


def numa_nodes() -> dict[int, list[int]]:
    """NUMA node -> its cores."""
    nodes = {}
    for path in glob.glob("/sys/devices/system/node/node[0-9]*/cpulist"):
        with open(path) as f:
            text = f.read().strip()
        nodes[int(path.split("/")[-2][4:])] = parse_core_list(text) if text else []
    return dict(sorted(nodes.items()))


def bind_command(core_list: str | None, local_size: int, local_rank: int, numactl: str | None = None,
                 numa: dict[int, list[int]] | None = None) -> tuple[int, list[str]]:
    """(cores per rank, the command prefix binding local rank `local_rank` of `local_size`).
    `numactl`: its path, "" for none (default: looked up); `numa`: node -> cores (default: this
    machine's)."""
    if "KMP_AFFINITY" in os.environ:  # as DeepSpeed: it overrides the binding numactl sets
        raise LaunchError("--bind_cores_to_rank: unset KMP_AFFINITY, which conflicts with the core binding")
    cores = parse_core_list(core_list) if core_list else list(range(physical_cores()))
    per = len(cores) // max(local_size, 1)
    if per < 1:
        raise LaunchError(f"--bind_cores_to_rank: {len(cores)} core(s) for {local_size} local ranks; "
                          "each rank needs at least one")
    mine = cores[per * local_rank:per * (local_rank + 1)]
    numactl = numactl if numactl is not None else (shutil.which("numactl") or "")
    if not numactl:
        return per, ["taskset", "-c", core_ranges(mine)]
    nodes = numa_nodes() if numa is None else numa
    memory = [["-m", str(n)] for n, node_cores in nodes.items() if set(mine) <= set(node_cores)]
    return per, ["numactl", *(memory[0] if memory else []), "-C", core_ranges(mine)]


def check_cores_exist(core_list: str | None) -> None:
    """Refuse a --bind_core_list naming cores this process may not run on (numactl would print
    only its usage)."""
    if not core_list or not hasattr(os, "sched_getaffinity"):
        return
    cores, allowed = set(parse_core_list(core_list)), os.sched_getaffinity(0)
    if not cores <= allowed:
        raise LaunchError(f"--bind_core_list {core_list!r}: core(s) {core_ranges(sorted(cores - allowed))} are not "
                          f"this machine's (it may run on {core_ranges(sorted(allowed))})")


def rank_program(python: str, script: str, script_args: list[str], module: bool = False,
                 no_python: bool = False) -> list[str]:
    """What one rank runs: `python -u [-m] SCRIPT ARGS`, or `SCRIPT ARGS` with --no_python."""
    if module and no_python:
        raise LaunchError("--module and --no_python cannot be used together")
    return ([] if no_python else [python, "-u", *(["-m"] if module else [])]) + [script, *script_args]
