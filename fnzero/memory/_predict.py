"""Step-time model for a ZeRO configuration (`specs/autotune.md` §Step-time model): pure numbers,
no tensors. A step is the sum of its compute, collectives, optimizer update and offload copies, a
bound for a step whose communication is not hidden; `StepPrediction.overlapped_s` is the other end.

    >>> link = Link(latency_s=1e-5, bandwidth_Bps=1e10)
    >>> p = predict_step(1_000_000, stage=0, world_size=2, micro=4, gas=1, units=1,
    ...                  compute_s_per_sample=0.01, optimizer_s_per_param=1e-9, link=link)
    >>> round(p.comm_bytes), round(p.comm_s * 1e6, 2)   # 4Ψ·2(N-1)/N + the norm's 16; 4 hops x 10 µs + 400 µs
    (4000016, 440.0)
    >>> round(p.total_s, 6)
    0.04144
"""

from __future__ import annotations

import dataclasses

from ..sharding import placement_for_stage

__all__ = ["Link", "StepPrediction", "collective_passes", "collective_traffic", "predict_step", "ring_link"]

PASS_KINDS = ("all_gather", "reduce_scatter", "all_reduce")


@dataclasses.dataclass(frozen=True)
class Link:
    """One link between data-parallel ranks: `latency_s` per ring hop, `bandwidth_Bps` the bytes per
    second one rank sends (the ring's bus bandwidth)."""

    latency_s: float
    bandwidth_Bps: float


def ring_link(allreduce_latency_s: float, bandwidth_Bps: float, world_size: int) -> Link:
    """A `Link` from a measured small all-reduce's time on `world_size` ranks (2(N-1) ring hops)."""
    return Link(allreduce_latency_s / max(1, 2 * (world_size - 1)), bandwidth_Bps)


@dataclasses.dataclass(frozen=True)
class StepPrediction:
    """Seconds of one optimizer step of one rank, by part; bytes and collectives it sends."""

    compute_s: float
    comm_s: float
    optimizer_s: float
    offload_s: float
    comm_bytes: float
    collectives: int

    @property
    def total_s(self) -> float:
        return self.compute_s + self.comm_s + self.optimizer_s + self.offload_s

    @property
    def overlapped_s(self) -> float:
        """The step if every collective were hidden behind compute."""
        return max(self.compute_s, self.comm_s) + self.optimizer_s + self.offload_s


def collective_passes(stage: int, gas: int) -> dict[str, int]:
    """Passes over the whole model per optimizer step, by collective (`specs/collectives.md` §Per
    stage): stage 0 all-reduces each unit's gradient once (the last micro-batch); stage 1
    reduce-scatters it once and all-gathers the new parameters; stage 2 reduce-scatters per
    micro-batch; stage 3 gathers in forward and reduce-scatters per micro-batch (no backward
    re-gather: the reuse distance's default)."""
    sharded = placement_for_stage(stage)
    if sharded.params:
        return {"all_gather": gas, "reduce_scatter": gas, "all_reduce": 0}
    if sharded.grads:
        return {"all_gather": 1, "reduce_scatter": gas, "all_reduce": 0}
    if sharded.optimizer:
        return {"all_gather": 1, "reduce_scatter": 1, "all_reduce": 0}
    return {"all_gather": 0, "reduce_scatter": 0, "all_reduce": 1}


def collective_traffic(num_params: float, *, stage: int, world_size: int, gas: int, units: int,
                       comm_bytes: int = 4) -> tuple[float, int, int]:
    """(bytes one rank sends, collectives, ring hops) of one step (`collective_passes`, §Traffic):
    ring all-reduce 2(N-1)/N of its buffer in 2(N-1) hops, all-gather and reduce-scatter (N-1)/N in
    N-1 hops; plus the gradient-norm/loss all-reduce of two float64."""
    n = world_size
    if n < 2:
        return 0.0, 0, 0
    half = comm_bytes * num_params * (n - 1) / n  # one all-gather or reduce-scatter of the whole model
    passes = collective_passes(stage, gas)
    halves = passes["all_gather"] + passes["reduce_scatter"]
    sent = half * (halves + 2 * passes["all_reduce"]) + 16 * 2 * (n - 1) / n
    collectives = units * sum(passes.values()) + 1
    hops = units * (halves * (n - 1) + passes["all_reduce"] * 2 * (n - 1)) + 2 * (n - 1)
    return sent, collectives, hops


def predict_step(num_params: float, *, stage: int, world_size: int, micro: int, gas: int, units: int,
                 compute_s_per_sample: float, optimizer_s_per_param: float, link: Link, comm_bytes: int = 4,
                 offload_optimizer: str = "none", host_link_Bps: float | None = None,
                 host_optimizer_s_per_param: float | None = None, compute_s_per_micro_step: float = 0.0,
                 pass_s: dict[str, float] | None = None) -> StepPrediction:
    """The step-time model for one configuration of `world_size` data-parallel ranks
    (`specs/autotune.md` §Step-time model, whose terms the arguments are): collectives over `link` by
    the traffic formulas, or, given `pass_s` (seconds of one pass per kind of `PASS_KINDS`, and
    `"scalar"`), each pass of `collective_passes` at its measured time; `host_link_Bps` None: no
    offload copy (the device is the host)."""
    sent, collectives, hops = collective_traffic(num_params, stage=stage, world_size=world_size, gas=gas,
                                                 units=units, comm_bytes=comm_bytes)
    if not sent:
        comm = 0.0
    elif pass_s is not None:
        counts = collective_passes(stage, gas)
        comm = sum(counts[k] * pass_s[k] for k in PASS_KINDS) + pass_s.get("scalar", 0.0)
    else:
        comm = hops * link.latency_s + sent / link.bandwidth_Bps
    sharded = placement_for_stage(stage).optimizer  # the update runs on this rank's shard only
    shard = num_params / world_size if sharded else num_params
    offloaded = offload_optimizer != "none" and sharded
    rate = host_optimizer_s_per_param if offloaded and host_optimizer_s_per_param is not None else optimizer_s_per_param
    copies = 2 * comm_bytes * shard / host_link_Bps if offloaded and host_link_Bps else 0.0
    compute = gas * (compute_s_per_micro_step + micro * compute_s_per_sample)
    return StepPrediction(compute_s=compute, comm_s=comm, optimizer_s=rate * shard, offload_s=copies,
                          comm_bytes=sent, collectives=collectives)
