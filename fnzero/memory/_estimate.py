"""Per-rank model-state memory for every ZeRO stage and offload choice (`fnzero plan`, `specs/cli.md`).

Pure functions over numbers: no torch, no process group. Model state is Adam's: parameters,
gradients, optional fp32 master weights and two fp32 moments. The device totals without offload
are `fnzero.memory.zero_formula`; the breakdown below sums to it exactly. Where each byte lives
with each offload choice, and what is not counted: `specs/cli.md` §The model.

    >>> e = estimate(7_000_000_000, stage=3, world_size=64, precision="bf16")
    >>> round(e.device_bytes / 2**30, 2)                 # 16 bytes/param over 64 ranks
    1.63
    >>> e = estimate(7e9, stage=2, world_size=64, precision="bf16", offload_optimizer="cpu")
    >>> e.device_bytes == 2 * 7e9, e.host_bytes == 16 * 7e9 / 64
    (True, True)
    >>> parse_count("1.3b"), parse_bytes("80GB"), parse_bytes("80GiB") == 80 * 2**30
    (1300000000, 80000000000, True)
"""

from __future__ import annotations

import dataclasses
import math
import re
from fractions import Fraction

from ..sharding import placement_for_stage
from ._state_bytes import ep_zero_formula

__all__ = [
    "Breakdown", "Estimate", "OFFLOAD_CHOICES", "bytes_per_param", "estimate", "largest_model",
    "parse_bytes", "parse_count", "format_bytes", "format_count",
]

PRECISIONS = ("fp32", "bf16", "fp16")
DEVICES = ("none", "cpu", "nvme")


@dataclasses.dataclass(frozen=True)
class Breakdown:
    """Bytes of one memory tier, by kind of model state (Fractions: Ψ/N need not be whole)."""

    params: Fraction = Fraction(0)
    grads: Fraction = Fraction(0)
    master: Fraction = Fraction(0)
    optimizer: Fraction = Fraction(0)

    @property
    def total(self) -> Fraction:
        return self.params + self.grads + self.master + self.optimizer

    def scaled(self, k) -> "Breakdown":
        return Breakdown(*(getattr(self, f.name) * k for f in dataclasses.fields(self)))

    def __add__(self, other: "Breakdown") -> "Breakdown":
        return Breakdown(*(getattr(self, f.name) + getattr(other, f.name) for f in dataclasses.fields(self)))

    def as_ints(self) -> dict[str, int]:
        return {f.name: round(getattr(self, f.name)) for f in dataclasses.fields(self)}


@dataclasses.dataclass(frozen=True)
class Estimate:
    """Per-rank model-state bytes of one (stage, precision, offload) choice, by memory tier."""

    num_params: int
    stage: int
    world_size: int
    precision: str
    offload_optimizer: str
    offload_param: str
    ratio: float
    device: Breakdown
    host: Breakdown
    nvme: Breakdown
    expert_params: int = 0  # of num_params, split over `ep` expert-parallel ranks
    ep: int = 1

    @property
    def device_bytes(self) -> int:
        return round(self.device.total)

    @property
    def host_bytes(self) -> int:
        return round(self.host.total)

    @property
    def nvme_bytes(self) -> int:
        return round(self.nvme.total)

    @property
    def label(self) -> str:
        """`-` without offload, else e.g. `opt=cpu param=nvme`."""
        parts = []
        if self.offload_optimizer != "none":
            parts.append(f"opt={self.offload_optimizer}" + (f"({self.ratio:g})" if self.ratio < 1 else ""))
        if self.offload_param != "none":
            parts.append(f"param={self.offload_param}")
        return " ".join(parts) or "-"


# The choices worth a row: every stage without offload, then what DeepSpeed offers at each stage.
OFFLOAD_CHOICES: tuple[tuple[int, str, str], ...] = (
    (0, "none", "none"),
    (1, "none", "none"), (1, "cpu", "none"), (1, "nvme", "none"),
    (2, "none", "none"), (2, "cpu", "none"), (2, "nvme", "none"),
    (3, "none", "none"), (3, "cpu", "none"), (3, "nvme", "none"),
    (3, "cpu", "cpu"), (3, "nvme", "cpu"), (3, "cpu", "nvme"), (3, "nvme", "nvme"),
)


def _check(num_params, stage, world_size, precision, offload_optimizer, offload_param, ratio) -> None:
    if not (isinstance(num_params, (int, float)) and math.isfinite(num_params) and num_params > 0):
        raise ValueError(f"number of parameters must be a positive number, got {num_params!r}")
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"ZeRO stage must be 0, 1, 2 or 3, got {stage!r}")
    if not (isinstance(world_size, int) and world_size > 0):
        raise ValueError(f"world size must be a positive integer, got {world_size!r}")
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    for name, dev in (("offload_optimizer", offload_optimizer), ("offload_param", offload_param)):
        if dev not in DEVICES:
            raise ValueError(f"{name} must be one of {', '.join(DEVICES)}, got {dev!r}")
    # The same rules `load_config` enforces (specs/config.md), so a plan never shows a config it would reject.
    if offload_optimizer != "none" and stage == 0:
        raise ValueError("optimizer offload needs ZeRO stage 1, 2 or 3")
    if offload_param != "none" and stage != 3:
        raise ValueError("parameter offload needs ZeRO stage 3")
    if not 0.0 <= ratio <= 1.0 or (ratio < 1.0 and stage != 3):
        raise ValueError(f"offload ratio must be in [0, 1], and below 1 only at stage 3; got {ratio!r} at stage {stage}")


def estimate(num_params, *, stage: int, world_size: int, precision: str = "fp32", offload_optimizer: str = "none",
             offload_param: str = "none", ratio: float = 1.0, expert_params=0, ep: int = 1) -> Estimate:
    """Per-rank model-state bytes on the device, in host memory and on NVMe.

    >>> e = estimate(1000, stage=1, world_size=4, precision="fp32")
    >>> e.device_bytes, e.device.as_ints()                 # 8Ψ + 8Ψ/N
    (10000, {'params': 4000, 'grads': 4000, 'master': 0, 'optimizer': 2000})

    With experts (`specs/mesh.md §Expert parallelism memory`): `expert_params` Ψ_e of the
    `num_params` are experts split over `ep` expert-parallel ranks; each rank holds Ψ_e / ep of
    them, sharded over the N / ep ranks holding the same ones, and the dense Ψ - Ψ_e over all N.

    >>> estimate(3000, stage=1, world_size=4, expert_params=2000, ep=2).device_bytes   # 10000 + (8000 + 8000/2)
    22000
    """
    _check(num_params, stage, world_size, precision, offload_optimizer, offload_param, ratio)
    psi = Fraction(round(num_params))
    psi_e = Fraction(expert_params)
    if not 0 <= psi_e <= psi:
        raise ValueError(f"expert parameters must be between 0 and the {int(psi)} parameters, got {expert_params}")
    if isinstance(ep, bool) or not isinstance(ep, int) or ep < 1 or world_size % ep:
        raise ValueError(f"expert-parallel size {ep!r} must be a positive integer dividing the world size {world_size}")
    mixed = precision != "fp32"
    dense = _tiers(psi - psi_e, world_size, stage, precision, offload_optimizer, offload_param, ratio)
    experts = _tiers(psi_e / ep, world_size // ep, stage, precision, offload_optimizer, offload_param, ratio)
    device, host, nvme = (a + b for a, b in zip(dense, experts))
    if offload_optimizer == "none" and offload_param == "none":
        # The breakdown is the formula, split by kind; keep them provably the same.
        want = ep_zero_formula(float(psi - psi_e), float(psi_e), stage, world_size, ep, mixed)
        assert abs(float(device.total) - want) <= 1e-6 * float(device.total) + 1
    return Estimate(int(psi), stage, world_size, precision, offload_optimizer, offload_param, float(ratio), device, host,
                    nvme, int(round(psi_e)), ep)


def _tiers(psi: Fraction, n: int, stage: int, precision: str, offload_optimizer: str, offload_param: str,
           ratio: float) -> tuple[Breakdown, Breakdown, Breakdown]:
    """(device, host, nvme) bytes of Ψ parameters sharded over n ranks."""
    p = 4 if precision == "fp32" else 2
    mixed = precision != "fp32"
    # Each kind's bytes, divided by N where the stage's placement shards it.
    sharded = placement_for_stage(stage)
    params = psi * p / (n if sharded.params else 1)
    grads = psi * p / (n if sharded.grads else 1)
    master = psi * 4 / (n if sharded.optimizer else 1) if mixed else Fraction(0)
    optimizer = psi * 8 / (n if sharded.optimizer else 1)
    device = Breakdown(params, grads, master, optimizer)
    tiers = {"cpu": "host", "nvme": "nvme"}
    moved = {"host": Breakdown(), "nvme": Breakdown()}

    if offload_optimizer != "none":
        # The optimizer step runs where its state lives: it reads an fp32 gradient shard and
        # updates an fp32 copy of this rank's parameters there (also at fp32, where that copy
        # replaces the device-side update). Stage 1 still accumulates full gradients on device.
        off = Breakdown(grads=psi * 4 / n, master=psi * 4 / n, optimizer=psi * 8 / n)
        r = Fraction(ratio).limit_denominator(10**6)
        # NVMe holds the master and moments (fnzero's NvmeOptimizerStore, specs/offload.md); the
        # gradient shard the step streams against them stays in host memory.
        moved[tiers[offload_optimizer]] += dataclasses.replace(off, grads=Fraction(0)).scaled(r)
        moved["host"] += Breakdown(grads=off.grads * r)
        # What stays (ratio < 1, stage 3 only) stays as it was without offload.
        device = Breakdown(params=params, grads=grads if not sharded.grads else grads * (1 - r),
                           master=master * (1 - r), optimizer=optimizer * (1 - r))
    if offload_param != "none":
        moved[tiers[offload_param]] += Breakdown(params=params)
        device = dataclasses.replace(device, params=Fraction(0))
    if offload_param == "nvme" and offload_optimizer == "none" and not mixed:
        # The parameters are in files: the optimizer updates an fp32 master of its own on the device.
        device = dataclasses.replace(device, master=psi * 4 / n)
    return device, moved["host"], moved["nvme"]


def bytes_per_param(e: Estimate, tier: str = "device") -> Fraction:
    """Bytes per parameter on one tier (the estimate is linear in Ψ)."""
    return getattr(e, tier).total / e.num_params


def largest_model(memory: int, *, stage: int, world_size: int, precision: str = "fp32", offload_optimizer: str = "none",
                  offload_param: str = "none", ratio: float = 1.0, reserve: int = 0,
                  host_memory_per_node: int | None = None, gpus_per_node: int = 1, expert_share=0,
                  ep: int = 1) -> int | None:
    """The most parameters whose model state fits `memory - reserve` bytes per device (and, when
    given, `host_memory_per_node` bytes of host memory shared by `gpus_per_node` ranks).
    None when nothing bounds it (all model state offloaded and no host limit given).
    `expert_share` (a number in [0, 1], a Fraction for exactness): the part of the parameters
    that are experts, split over `ep` ranks (`estimate`).

    >>> largest_model(80 * 10**9, stage=0, world_size=8)       # 16 bytes/param
    5000000000
    """
    if memory <= reserve:
        return 0
    unit = estimate(1_000_000, stage=stage, world_size=world_size, precision=precision,
                    offload_optimizer=offload_optimizer, offload_param=offload_param, ratio=ratio,
                    expert_params=Fraction(expert_share) * 1_000_000, ep=ep)
    limits = []
    a = bytes_per_param(unit, "device")
    if a > 0:
        limits.append(math.floor(Fraction(memory - reserve) / a))
    if host_memory_per_node is not None:
        h = bytes_per_param(unit, "host") * gpus_per_node
        if h > 0:
            limits.append(math.floor(Fraction(host_memory_per_node) / h))
    return min(limits) if limits else None


# -- parsing and printing numbers -------------------------------------------------------------------

_COUNT_SUFFIX = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9, "g": 10**9, "t": 10**12}
_BYTE_SUFFIX = {
    "": 1, "b": 1,
    "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9, "t": 10**12, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
_NUM = re.compile(r"^\s*([0-9][0-9_,]*(?:\.[0-9]*)?(?:e[+-]?[0-9]+)?|\.[0-9]+(?:e[+-]?[0-9]+)?)\s*([a-z]*)\s*$", re.I)


def _parse(text: str, suffixes: dict[str, int], what: str, example: str) -> float:
    m = _NUM.match(str(text))
    if not m or m.group(2).lower() not in suffixes:
        raise ValueError(f"{what} {text!r} is not a number like {example}")
    value = float(m.group(1).replace("_", "").replace(",", "")) * suffixes[m.group(2).lower()]
    if not math.isfinite(value):
        raise ValueError(f"{what} {text!r} is too large")
    return value


def parse_count(text: str) -> int:
    """A parameter count: `7e9`, `7B`, `350M`, `1.3b`, `125k`, `7_000_000_000`.

    >>> parse_count("350M"), parse_count("7e9")
    (350000000, 7000000000)
    """
    value = round(_parse(text, _COUNT_SUFFIX, "parameter count", "7e9, 7B, 350M or 1.3b"))
    if value <= 0:
        raise ValueError(f"parameter count {text!r} must be at least 1")
    return value


def parse_bytes(text: str, *, allow_zero: bool = False) -> int:
    """A size: KB/MB/GB/TB are powers of 1000, KiB/MiB/GiB/TiB powers of 1024; a bare number is bytes.

    >>> parse_bytes("80GB"), parse_bytes("1.5GiB"), parse_bytes("0", allow_zero=True)
    (80000000000, 1610612736, 0)
    """
    value = round(_parse(text, _BYTE_SUFFIX, "size", "80GB, 80GiB or 8.5e10"))
    if value < 0 or (value == 0 and not allow_zero):
        raise ValueError(f"size {text!r} must be {'non-negative' if allow_zero else 'positive'}")
    return value


def format_bytes(n: float) -> str:
    """Binary units, two decimals: `1.63 GiB`; whole bytes below 1 KiB.

    >>> format_bytes(1.75 * 2**30), format_bytes(512)
    ('1.75 GiB', '512 B')
    """
    n = float(n)
    units = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")
    i = 0
    while abs(n) >= 1024 and i < len(units) - 1:
        n /= 1024
        i += 1
    return f"{n:.0f} B" if i == 0 else f"{n:.2f} {units[i]}"


def format_count(n: float) -> str:
    """`7.00B`, `350.0M`, `1.23T`."""
    for div, unit in ((10**12, "T"), (10**9, "B"), (10**6, "M"), (10**3, "k")):
        if n >= div:
            return f"{n / div:.2f}{unit}"
    return f"{n:.0f}"
