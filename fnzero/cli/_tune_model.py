"""The model_based tuner's step-time model, calibrated from one trial's report
(`specs/autotune.md` §Calibration)."""

from __future__ import annotations

import dataclasses

from ..memory._predict import Link, StepPrediction, collective_traffic, predict_step, ring_link
from ._tune_space import Candidate

__all__ = ["Calibration", "calibrate"]


@dataclasses.dataclass(frozen=True)
class Calibration:
    """Rates measured by one trial, and the link: enough to predict every candidate's step."""

    num_params: int
    units: int
    comm_bytes: int
    world: int
    gas: int
    compute_s_per_sample: float
    optimizer_s_per_param: float
    link: Link
    host_link_Bps: float | None  # None: the device is the host, offloading copies nothing
    source: str  # the trial it came from

    def predict(self, c: Candidate) -> StepPrediction:
        return predict_step(self.num_params, stage=c.stage, world_size=self.world, micro=c.micro, gas=self.gas,
                            units=self.units, compute_s_per_sample=self.compute_s_per_sample,
                            optimizer_s_per_param=self.optimizer_s_per_param, link=self.link,
                            comm_bytes=self.comm_bytes, offload_optimizer=c.offload, host_link_Bps=self.host_link_Bps)


def calibrate(c: Candidate, report: dict, *, world: int, gas: int, link: Link | None = None,
              host_link_Bps: float | None = None) -> Calibration:
    """Rates from trial `c`'s rank-0 report: the optimizer's seconds per parameter of its shard (its
    `wall_clock_breakdown` share); the link: bandwidth as the trial measured it, and, from a stage-0
    trial (whose collectives all run after backward, in its "comm" time), the latency per ring hop
    that this comm time implies beyond the bandwidth's share (at least the measured one: on a busy
    machine it includes the ranks' skew); then the compute per sample as what remains of the measured
    step once the optimizer and the formula's collectives are taken out, so the model reproduces
    this trial's step exactly. `link`, when given, is used as is."""
    n_params, units = int(report["num_params"]), int(report.get("units") or 1)
    comm_bytes = int(report.get("comm_bytes") or 4)
    timings = report.get("timings_s") or {}
    if link is None:
        measured = report.get("link")
        link = ring_link(measured["latency_s"], measured["bandwidth_Bps"], world) if measured else Link(0.0, float("inf"))
        sent, _, hops = collective_traffic(n_params, stage=c.stage, world_size=world, gas=gas, units=units,
                                           comm_bytes=comm_bytes)
        if c.stage == 0 and "comm" in timings and hops:
            in_step = (timings["comm"] - sent / link.bandwidth_Bps) / hops
            link = Link(max(link.latency_s, in_step), link.bandwidth_Bps)
    shard = n_params if c.stage == 0 else n_params / world
    opt_s = float(timings.get("optimizer", 0.0))
    base = Calibration(n_params, units, comm_bytes, world, gas, 0.0, opt_s / shard, link, host_link_Bps, c.name)
    rest = report["step_time_s"] - base.predict(c).total_s
    return dataclasses.replace(base, compute_s_per_sample=max(rest, 0.0) / (c.micro * gas))
