"""`TrialProbe`: what an autotuner trial measures and reports, inside an ordinary training run's
`Monitor` (`specs/autotune.md` §Trial report).
"""

from __future__ import annotations

import json
import os
import statistics
import time

from ._passes import measure_passes

__all__ = ["TrialProbe", "measure_link", "report_path"]

# Link measurement: a small all-reduce (latency) and a large one (bandwidth), fp32.
_SMALL, _LARGE, _REPEATS = 1, 1 << 20, 3


def report_path(metric_path: str, rank: int) -> str:
    """Where rank `rank` of a trial writes its report."""
    return metric_path if rank == 0 else f"{metric_path}.rank{rank}"


def measure_link(device=None) -> dict | None:
    """Every rank together: all-reduce latency (s) and ring bandwidth (bytes/s per rank) over the
    default process group, or None outside one. Bandwidth counts the ring's `2(N-1)/N` bytes."""
    import torch
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() < 2:
        return None
    n = dist.get_world_size()
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"

    def timed(numel: int) -> float:
        buf = torch.ones(numel, dtype=torch.float32, device=device)
        dist.all_reduce(buf)  # warm-up: connections, allocation
        best = float("inf")
        for _ in range(_REPEATS):
            dist.barrier()
            if buf.is_cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            dist.all_reduce(buf)
            if buf.is_cuda:
                torch.cuda.synchronize()
            best = min(best, time.perf_counter() - t0)
        # Every rank reports the slowest rank's time: the collective ends when the last one does.
        t = torch.tensor([best], dtype=torch.float64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t)

    latency = timed(_SMALL)
    large = timed(_LARGE)
    ring_bytes = 4 * _LARGE * 2 * (n - 1) / n
    return {"latency_s": latency, "bandwidth_Bps": ring_bytes / max(large - latency, 1e-9)}


class TrialProbe:
    """The profile-step timer of one trial; `Monitor` feeds it every step."""

    def __init__(self, cfg, *, rank: int, world_size: int, tokens_per_step: int | None, samples_per_step: int):
        at = cfg.autotuning
        self.metric_path, self.start, self.end = at.metric_path, at.start_profile_step, at.end_profile_step
        self.rank, self.world_size = rank, world_size
        self.tokens_per_step, self.samples_per_step = tokens_per_step, samples_per_step
        self.micro, self.gas = cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps
        self.comm_bytes = 2 if cfg.precision in ("bf16", "fp16") else 4  # the gradients' itemsize
        self.precision = cfg.precision
        self.times: list[float] = []
        self.timings: dict[str, float] = {}

    @classmethod
    def from_config(cls, cfg, **kw) -> "TrialProbe | None":
        """A probe when `cfg` is an autotuner trial's config, else None."""
        at = getattr(cfg, "autotuning", None)
        return cls(cfg, **kw) if at is not None and at.enabled and at.metric_path else None

    def record(self, step: int, dt: float, timings: dict | None, state=None, step_flops: int | None = None) -> bool:
        """Note step `step`'s time; at `end_profile_step` write the report and return True (the
        caller then ends the run). Every rank must call it: the last call measures the link."""
        if self.start < step <= self.end:
            self.times.append(dt)
            for k, v in (timings or {}).items():
                self.timings[k] = self.timings.get(k, 0.0) + float(v)
        if step < self.end:
            return False
        import torch

        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(self.precision, torch.float32)
        passes = measure_passes(state, dtype) if state is not None else None
        self._write(measure_link(), passes, state, step_flops)
        return True

    def _write(self, link: dict | None, passes: dict | None, state, step_flops: int | None) -> None:
        import torch

        from ..memory import model_state_bytes, peak_rss_bytes

        n = len(self.times)
        # The median step: robust to the odd step a busy machine slows (a collective waiting on a descheduled rank).
        step_time = statistics.median(self.times) if n else float("nan")
        report = {
            "rank": self.rank, "world_size": self.world_size, "measured_steps": n, "step_time_s": step_time,
            "mean_step_time_s": sum(self.times) / n if n else None, "step_times_s": self.times,
            "micro_batch": self.micro, "gradient_accumulation_steps": self.gas,
            "samples_per_s": self.samples_per_step / step_time if n else None,
            "tokens_per_s": self.tokens_per_step / step_time if n and self.tokens_per_step else None,
            "flops_per_s_per_rank": step_flops / step_time if n and step_flops else None,
            "timings_s": {k: v / n for k, v in self.timings.items()} if n else {},
            "num_params": state.sharding.plan.num_params if state is not None else None,
            "units": len(state.sharding.plan.units) if state is not None else None, "comm_bytes": self.comm_bytes,
            "model_state_bytes": model_state_bytes(state).total if state is not None else None,
            "peak_rss_bytes": peak_rss_bytes(),
            "cuda_peak_bytes": torch.cuda.max_memory_allocated() if torch.cuda.is_available()
            and torch.cuda.is_initialized() else None,
            "link": link, "passes_s": passes,
        }
        path = report_path(self.metric_path, self.rank)
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path + ".tmp", "w") as f:
            json.dump(report, f, indent=1)
        os.replace(path + ".tmp", path)  # the autotuner never reads half a report
