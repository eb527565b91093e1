"""The autotuner's search space: candidates, the planner's pruning, each trial's config and the
tuners' orders (`specs/autotune.md` §Search space, §Tuners)."""

from __future__ import annotations

import copy
import dataclasses
import math
import random

__all__ = ["Candidate", "micro_batch_sizes", "build_space", "prune", "trial_config", "order"]


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One point of the space: ZeRO stage, micro-batch size per rank, optimizer offload device."""

    stage: int
    micro: int
    offload: str = "none"

    @property
    def name(self) -> str:
        return f"z{self.stage}_mbs{self.micro}" + ("" if self.offload == "none" else f"_off{self.offload}")


def micro_batch_sizes(lo: int, hi: int, count: int) -> list[int]:
    """`count` sizes from lo to hi, spread geometrically (1, 4, 16 for 1..16 and 3), without repeats."""
    if count <= 1 or lo == hi:
        return [hi] if count >= 1 else []
    ratio = (hi / lo) ** (1 / (count - 1))
    return sorted({min(hi, max(lo, round(lo * ratio**i))) for i in range(count)})


def build_space(stages, micros, offloads, *, gas: int, world: int, min_batch: int = 1,
                max_batch: int | None = None) -> tuple[list[Candidate], list[tuple[Candidate, str]]]:
    """(candidates, rejected with why): stage x micro x offload; offload needs stage >= 1 (ZeRO-Offload
    offloads the optimizer's shard), and train_batch_size = micro x gas x world must lie within
    autotuning.min/max_train_batch_size."""
    keep, rejected = [], []
    for stage in stages:
        for micro in micros:
            for off in offloads:
                c = Candidate(stage, micro, off)
                batch = micro * gas * world
                if off != "none" and stage == 0:
                    continue  # not a configuration: offload_optimizer needs ZeRO stage 1-3
                if max_batch is not None and batch > max_batch:
                    rejected.append((c, f"train_batch_size {batch} > autotuning.max_train_batch_size {max_batch}"))
                elif batch < min_batch:
                    rejected.append((c, f"train_batch_size {batch} < autotuning.min_train_batch_size {min_batch}"))
                else:
                    keep.append(c)
    return keep, rejected


def model_state_estimate(c: Candidate, num_params: int, world: int, precision: str, device_is_host: bool) -> int:
    """The planner's per-rank model-state bytes of `c` where they count against the limit: the
    device's, plus the host's when the device is the host (a CPU run: offloading moves nothing)."""
    from ..memory._estimate import estimate

    e = estimate(num_params, stage=c.stage, world_size=world, precision=precision, offload_optimizer=c.offload)
    return int(e.device_bytes + (e.host_bytes if device_is_host else 0))


def prune(cands, num_params: int, world: int, precision: str, limit: int | None, device_is_host: bool):
    """(fitting candidates, [(candidate, why)] that the planner says cannot fit `limit` bytes per rank)."""
    from ..memory._estimate import format_bytes

    keep, pruned = [], []
    for c in cands:
        need = model_state_estimate(c, num_params, world, precision, device_is_host)
        if limit is not None and need > limit:
            pruned.append((c, f"planner: model state {format_bytes(need)} per rank > memory limit {format_bytes(limit)}"))
        else:
            keep.append(c)
    return keep, pruned


def trial_config(raw: dict, c: Candidate, *, gas: int, world: int, metric_path: str, start: int, end: int) -> dict:
    """The user's config with `c` applied, and the trial's autotuning block (its Monitor reports to
    metric_path and ends the run after end_profile_step). With an empty metric_path it is
    the config to train with (no autotuning block, as DeepSpeed's ds_config_optimal.json)."""
    out = copy.deepcopy(raw)
    out["train_micro_batch_size_per_gpu"] = c.micro
    out["gradient_accumulation_steps"] = gas
    out["train_batch_size"] = c.micro * gas * world
    zero = dict(out.get("zero_optimization") or {})
    zero["stage"] = c.stage
    if c.offload == "none":
        zero.pop("offload_optimizer", None)
    else:
        zero["offload_optimizer"] = {**(zero.get("offload_optimizer") or {}), "device": c.offload}
    if c.stage < 3:
        zero.pop("offload_param", None)
    out["zero_optimization"] = zero
    out.pop("autotuning", None)
    if metric_path:
        out["wall_clock_breakdown"] = True  # the optimizer's share calibrates the step-time model
        out["autotuning"] = {"enabled": True, "metric_path": metric_path, "start_profile_step": start,
                             "end_profile_step": end}
    return out


def order(cands: list[Candidate], tuner: str, *, seed: int = 0, predicted: dict | None = None,
          better_high: bool = True) -> list[Candidate]:
    """The order in which the tuner runs `cands`: gridsearch as built (stage, micro, offload); random
    shuffled by `seed`; model_based by predicted metric, best first (unpredicted last)."""
    if tuner == "random":
        out = list(cands)
        random.Random(seed).shuffle(out)
        return out
    if tuner == "model_based" and predicted:
        sign = -1 if better_high else 1
        return sorted(cands, key=lambda c: (c not in predicted, sign * predicted.get(c, math.nan)
                                            if c in predicted else 0.0))
    return list(cands)
