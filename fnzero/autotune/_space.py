"""The autotuner's search space: candidates, the planner's pruning, each trial's config and the
tuners' orders (`specs/autotune.md` §Search space, §Tuners)."""

from __future__ import annotations

import copy
import dataclasses
import math
import random

__all__ = ["Candidate", "micro_batch_sizes", "build_space", "given_layout", "model_state_estimate", "prune",
           "trial_config", "order"]


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One point of the space: ZeRO stage, micro-batch size per rank, optimizer offload device,
    tensor-parallel size and pipeline stages (the layout; data parallelism takes the rest)."""

    stage: int
    micro: int
    offload: str = "none"
    tp: int = 1
    pp: int = 1

    @property
    def name(self) -> str:
        return (f"z{self.stage}_mbs{self.micro}" + (f"_tp{self.tp}" if self.tp > 1 else "")
                + (f"_pp{self.pp}" if self.pp > 1 else "") + ("" if self.offload == "none" else f"_off{self.offload}"))

    @property
    def layout(self) -> tuple[int, int]:
        return self.tp, self.pp

    def dp(self, world: int) -> int:
        """Data-parallel ranks of `world`: what ZeRO shards over and the batch multiplies by."""
        return world // (self.tp * self.pp)


def micro_batch_sizes(lo: int, hi: int, count: int) -> list[int]:
    """`count` sizes from lo to hi, spread geometrically (1, 4, 16 for 1..16 and 3), without repeats."""
    if count <= 1 or lo == hi:
        return [hi] if count >= 1 else []
    ratio = (hi / lo) ** (1 / (count - 1))
    return sorted({min(hi, max(lo, round(lo * ratio**i))) for i in range(count)})


def build_space(stages, micros, offloads, *, gas: int, world: int, min_batch: int = 1,
                max_batch: int | None = None, layouts=((1, 1),)) -> tuple[list[Candidate], list[tuple[Candidate, str]]]:
    """(candidates, rejected with why): layout (tp, pp) x stage x micro x offload; offload needs
    stage >= 1 (ZeRO-Offload offloads the optimizer's shard); tp x pp must divide the world; a
    pipeline takes stage 0 or 1 only (as DeepSpeed); train_batch_size = micro x gas x data-parallel
    ranks must lie within autotuning.min/max_train_batch_size."""
    keep, rejected = [], []
    for (tp, pp), stage, micro, off in ((lay, s, m, o) for lay in layouts for s in stages for m in micros
                                        for o in offloads):
        c = Candidate(stage, micro, off, tp, pp)
        batch = micro * gas * c.dp(world)
        if off != "none" and stage == 0:
            continue  # not a configuration: offload_optimizer needs ZeRO stage 1-3
        if world % (tp * pp):
            rejected.append((c, f"tensor parallel {tp} x pipeline stages {pp} does not divide the {world} ranks"))
        elif pp > 1 and stage >= 2:
            rejected.append((c, f"ZeRO stage {stage} with a pipeline: DeepSpeed and fnzero allow stage 0 or 1"))
        elif pp > gas:
            rejected.append((c, f"{pp} pipeline stages need at least {pp} micro-batches a step (1F1B): raise "
                                f"gradient_accumulation_steps ({gas}) in the config"))
        elif max_batch is not None and batch > max_batch:
            rejected.append((c, f"train_batch_size {batch} > autotuning.max_train_batch_size {max_batch}"))
        elif batch < min_batch:
            rejected.append((c, f"train_batch_size {batch} < autotuning.min_train_batch_size {min_batch}"))
        else:
            keep.append(c)
    return keep, rejected


def model_state_estimate(c: Candidate, num_params: int, world: int, precision: str, device_is_host: bool) -> int:
    """The planner's per-rank model-state bytes of `c` where they count against the limit: the
    device's, plus the host's when the device is the host (a CPU run: offloading moves nothing).
    Tensor and pipeline parallelism give each rank 1/(tp x pp) of the parameters (a lower bound:
    replicated embeddings and norms, an uneven cut), which ZeRO shards over the data-parallel ranks."""
    from ..memory import estimate

    e = estimate(num_params // (c.tp * c.pp), stage=c.stage, world_size=c.dp(world), precision=precision,
                 offload_optimizer=c.offload)
    return int(e.device_bytes + (e.host_bytes if device_is_host else 0))


def prune(cands, num_params: int, world: int, precision: str, limit: int | None, device_is_host: bool):
    """(fitting candidates, [(candidate, why)] that the planner says cannot fit `limit` bytes per rank)."""
    from ..memory import format_bytes

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
    out["train_batch_size"] = c.micro * gas * c.dp(world)
    if c.layout != given_layout(raw):  # the config's own layout is left as written ("auto" stages too)
        out["tensor_parallel"] = {**(out.get("tensor_parallel") or {}), "autotp_size": c.tp}
        out["pipeline"] = {**(out.get("pipeline") or {}), "stages": c.pp}
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


def given_layout(raw: dict) -> tuple[int, int]:
    """The (tensor-parallel size, pipeline stages) a config asks for; "auto" stages count as 1."""
    tp = (raw.get("tensor_parallel") or {}).get("autotp_size") or 1
    pp = (raw.get("pipeline") or {}).get("stages", 1)
    return max(1, int(tp)), pp if isinstance(pp, int) and not isinstance(pp, bool) else 1


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
