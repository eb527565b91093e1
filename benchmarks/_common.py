"""Shared helpers for the benchmarks: machine description and CPU contention measurement."""

from __future__ import annotations

import os
import platform
import statistics
import time

__all__ = ["machine", "CpuMonitor", "median", "proc_status"]


def machine() -> str:
    import torch

    cpu = "unknown cpu"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    mem = ""
    try:
        with open("/proc/meminfo") as f:
            kb = int(f.readline().split()[1])
            mem = f", {kb / 2**20:.0f} GiB RAM"
    except (OSError, ValueError, IndexError):
        pass
    return (f"{platform.node()}: {cpu}, {os.cpu_count()} cores{mem}; {platform.platform()}; "
            f"python {platform.python_version()}; torch {torch.__version__} ({torch.backends.cpu.get_cpu_capability()})")


def _busy_jiffies() -> int:
    with open("/proc/stat") as f:
        parts = f.readline().split()[1:]
    vals = list(map(int, parts))
    idle = vals[3] + (vals[4] if len(vals) > 4 else 0)
    return sum(vals[:8]) - idle


class CpuMonitor:
    """Cores used by the whole machine during a window, minus this process tree's own use:
    how contended the measurement was (0 = the benchmark had the machine to itself)."""

    def __enter__(self):
        self.t0 = time.monotonic()
        self.b0 = _busy_jiffies()
        self.own0 = _own_cpu()
        return self

    def __exit__(self, *exc):
        self.wall = time.monotonic() - self.t0
        self.busy = (_busy_jiffies() - self.b0) / os.sysconf("SC_CLK_TCK")
        self.own = _own_cpu() - self.own0
        return False

    @property
    def other_cores(self) -> float:
        return max(0.0, (self.busy - self.own) / self.wall) if self.wall > 0 else 0.0

    def add_own(self, cpu_seconds: float) -> None:
        """Count CPU seconds of processes this one did not wait for (ranks forked by a fork
        server are not its children) as the benchmark's own."""
        self.own += cpu_seconds


def _own_cpu() -> float:
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def median(xs):
    return statistics.median(xs) if xs else float("nan")


def rank_device(kind: str):
    """This rank's device: the CPU, or accelerator `rank` of this node (one per rank)."""
    import torch
    import torch.distributed as dist

    if kind == "cpu":
        return torch.device("cpu")
    mod = torch.get_device_module(kind)
    dev = torch.device(kind, dist.get_rank() % mod.device_count())
    mod.set_device(dev)
    return dev


def proc_status(key: str) -> int:
    """A memory line of /proc/self/status (VmRSS, VmHWM, ...), in bytes; 0 where it is absent."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    return 0
