"""The comms logger's timed summary (`specs/collectives.md` §Comms logger timings): per collective
kind and message size, how many calls, their bytes, time, and algorithmic and bus bandwidth, laid
out as DeepSpeed's `deepspeed.comm.log_summary()`. Pure functions of the records."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

__all__ = ["CommsRow", "bus_factor", "comms_summary", "format_comms_summary", "human_bytes"]


def bus_factor(op: str, world_size: int) -> float:
    """Ring-equivalent bytes each rank sends per logical byte of `op` (nccl-tests' and DeepSpeed's
    bus-bandwidth factors, `specs/collectives.md` §Comms logger timings); 0 in a world of one."""
    n = world_size
    if n <= 1:
        return 0.0
    if op == "all_reduce":
        return 2 * (n - 1) / n
    if op in ("all_gather", "reduce_scatter"):
        return (n - 1) / n
    if op in ("broadcast", "send", "all_to_all", "pt2pt"):
        return 1.0
    raise ValueError(f"no bus factor for collective {op!r}")


@dataclasses.dataclass(frozen=True)
class CommsRow:
    """One line of the summary (`specs/collectives.md` §Comms logger timings): `timed` of the `count`
    calls had completed; times in seconds over those; bandwidths in bytes/s, None when none was timed."""

    op: str
    bytes: int
    count: int
    total_bytes: int
    timed: int
    total_s: float
    avg_s: float | None
    algbw: float | None
    busbw: float | None


def comms_summary(records: Iterable[Any], world_size: int) -> list[CommsRow]:
    """Rows for `records` (anything with `op`, `bytes`, `seconds`): ops in order of first call,
    sizes ascending within an op."""
    groups: dict[str, dict[int, list[float | None]]] = {}
    for r in records:
        groups.setdefault(r.op, {}).setdefault(r.bytes, []).append(r.seconds)
    rows = []
    for op, sizes in groups.items():
        factor = bus_factor(op, world_size)
        for size in sorted(sizes):
            times = [s for s in sizes[size] if s is not None]
            total = sum(times)
            algbw = size * len(times) / total if times and total > 0 else None
            rows.append(CommsRow(op, size, len(sizes[size]), size * len(sizes[size]), len(times), total,
                                 total / len(times) if times else None, algbw,
                                 None if algbw is None else algbw * factor))
    return rows


def human_bytes(n: float) -> str:
    """1024-based, as DeepSpeed's `convert_size` (whose `KB` means KiB; spelled KiB here)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _cell(v: float | None, scale: float) -> str:
    return "-" if v is None else f"{v * scale:.2f}"


def format_comms_summary(rows: list[CommsRow]) -> str:
    """DeepSpeed's layout: a header line, then each op's name on a line of its own and one line per
    message size: size, count, total and average latency (ms), algbw and busbw (Gbps)."""
    names = ("Comm. Op", "Message Size", "Count", "Total Latency(ms)", "Avg Latency(ms)", "tput_avg (Gbps)",
             "busbw_avg (Gbps)")
    lines = ["".join(f"{h:<20}" for h in names)]
    op = None
    for r in rows:
        if r.op != op:
            op = r.op
            lines.append(op)
        count = f"{r.count}" if r.timed == r.count else f"{r.count} ({r.timed} timed)"
        cells = ("", human_bytes(r.bytes), count, f"{r.total_s * 1e3:.2f}", _cell(r.avg_s, 1e3),
                 _cell(r.algbw, 8e-9), _cell(r.busbw, 8e-9))
        lines.append("".join(f"{c:<20}" for c in cells))
    return "\n".join(lines)
