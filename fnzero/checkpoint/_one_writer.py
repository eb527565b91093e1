"""One rank writes an export, every rank learns how it went, in small all-reduces ("rounds")
(`specs/checkpoint-format.md` §Export, "Every rank calls it").

[Note: a round is a sum over each of `comms` in turn] (the data-parallel group, then the
tensor-parallel one): the writer's words reach the whole grid without a group spanning it, and
without a rank-0 `src` (which torch's `broadcast` reads as a rank of the whole job).
"""

from __future__ import annotations

import json
import time
from typing import Callable

import torch
import torch.distributed as dist

from .._errors import CheckpointError
from ..sharding import ProcessGroupCollectives, default_collectives, default_device

__all__ = ["Rounds", "world_device", "job_rank"]

GO_ON, DONE, FAILED = 1, 2, 3
BEAT_S = 1.0
_LABEL = "checkpoint export (every rank calls it)"  # the watchdog names this if a rank never comes


def world_device(comm) -> torch.device:
    """Where `comm`'s collectives take their tensors: the accelerator for NCCL, else the host."""
    if isinstance(comm, ProcessGroupCollectives) and "gloo" not in str(dist.get_backend(comm.group)):
        return default_device()
    return torch.device("cpu")


def job_rank() -> int:
    """This process's rank in the job (a simulated world's thread rank), for messages."""
    return int(default_collectives().rank)


class Rounds:
    """The rounds of one export. `writes`: whether this rank is the writer (exactly one rank
    of the grid `comms` spans)."""

    def __init__(self, comms: list, writes: bool, device: torch.device):
        self.comms = [c for c in comms if c is not None and c.world_size > 1]
        self.writes, self.device = writes, device
        self.last = time.monotonic()
        self.outcome: tuple[int, dict] | None = None

    def _sum(self, t: torch.Tensor) -> torch.Tensor:
        for c in self.comms:
            t = c.all_reduce_async(t.to(self.device), label=_LABEL).wait()
        return t.cpu()

    def _round(self, code: int, said: dict | None = None) -> tuple[int, dict]:
        raw = json.dumps(said).encode() if said is not None else b""
        head = self._sum(torch.tensor([code, len(raw)] if self.writes else [0, 0], dtype=torch.int64))
        code, n = int(head[0]), int(head[1])
        if n == 0:
            return code, {}
        body = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if self.writes else torch.zeros(n, dtype=torch.uint8)
        return code, json.loads(self._sum(body).numpy().tobytes())

    # -- the writer ------------------------------------------------------------------------------
    def beat(self, force: bool = False) -> None:
        """The writer between two pieces of work: a 'go on' round when `BEAT_S` has passed (or
        `force`: a round the others expect at this point)."""
        if self.comms and (force or time.monotonic() - self.last >= BEAT_S):
            self._round(GO_ON)
            self.last = time.monotonic()

    def write(self, fn: Callable[[], list[str]]) -> list[str]:
        """Run the writer's `fn` and tell every rank its paths, or its failure (then re-raised)."""
        try:
            paths = fn()
        except BaseException as e:
            if self.comms:
                try:
                    self._round(FAILED, {"error": f"{type(e).__name__}: {e}", "rank": job_rank()})
                except Exception:  # noqa: BLE001 - the group itself broke; the original error says why
                    pass
            raise
        if self.comms:
            self._round(DONE, {"paths": paths})
        return paths

    # -- the others ------------------------------------------------------------------------------
    def follow(self) -> bool:
        """One round on a rank that does not write: True while the writer goes on; False once it
        has finished (the outcome is kept for `result`)."""
        code, said = self._round(0)
        if code == GO_ON:
            return True
        if code not in (DONE, FAILED):
            raise CheckpointError(f"the ranks of an export are out of step (round code {code}): was it called on "
                                  "every rank, with the same arguments?")
        self.outcome = (code, said)
        return False

    def result(self) -> list[str]:
        """The writer's paths (following its rounds to the end), or its failure as a `CheckpointError`."""
        while self.outcome is None and self.follow():
            pass
        code, said = self.outcome
        if code == FAILED:
            raise CheckpointError(f"the export failed on rank {said['rank']}, the rank that writes it (this rank "
                                  f"only waited for it): {said['error']}")
        return list(said["paths"])
