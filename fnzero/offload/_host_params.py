"""Parameter shards no optimizer holds, in host memory: `offload_param: {device: cpu}` when the
model computes on an accelerator, for stage 3's frozen units (a LoRA model's base) and every
sharded unit of an inference state (ZeRO-Inference); each is copied to the device before its unit's
all-gather, through a `ShardSource` as the NVMe store's (`specs/offload.md` §Step (NVMe), `offload_param: cpu`)."""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

__all__ = ["HostParamStore"]


class HostParamStore:
    """One rank's parameter shards in host memory: `read(unit, kind)` (the host tensor itself;
    readers copy it to their device), `write(unit, kind, value)` (`checkpoint.load`). `kind` is
    "params" (an inference state's units) or "frozen"."""

    def __init__(self, shards: dict[str, dict[str, torch.Tensor]], *, pin: bool):
        self._held = {(kind, unit): _host_copy(t, pin) for kind, units in shards.items() for unit, t in units.items()}
        self.last_step = 0  # as `NvmeParamStore.last_step`

    def set_step(self, step: int) -> None:
        self.last_step = int(step)

    @contextlib.contextmanager
    def updating(self, what: str, step: int) -> Iterator[None]:
        """As `NvmeParamStore.updating`, whose callers group writes in it; nothing to mark here: a
        write is a copy between tensors of the checked size, which does not stop part-way as a
        file write can (disk full)."""
        yield

    def read(self, unit: str, kind: str) -> torch.Tensor:
        return self._held[(kind, unit)]

    def write(self, unit: str, kind: str, value: torch.Tensor) -> None:
        self._held[(kind, unit)].copy_(value.detach().reshape(-1))

    def units(self, kind: str) -> list[str]:
        return [unit for k, unit in self._held if k == kind]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._held.values())

    def close(self) -> None:
        self._held.clear()


def _host_copy(t: torch.Tensor, pin: bool) -> torch.Tensor:
    out = torch.empty(t.numel(), dtype=t.dtype, device="cpu", pin_memory=pin)
    out.copy_(t.detach().reshape(-1))
    return out
