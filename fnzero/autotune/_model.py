"""The model_based tuner's step-time model, fitted to the trials run so far: the passes, the link
and the optimizer's rate measured, the compute per micro-step fitted (`specs/autotune.md` §Calibration).
"""

from __future__ import annotations

import dataclasses
import statistics

from ..memory import PASS_KINDS, Link, StepPrediction, predict_step, ring_link
from ._space import Candidate

__all__ = ["Calibration", "fit", "fit_layouts", "leave_one_out"]

Trial = tuple[Candidate, dict]  # a candidate and its rank-0 report


@dataclasses.dataclass(frozen=True)
class Calibration:
    """Rates measured or fitted from trials: enough to predict every candidate's step."""

    num_params: int
    units: int
    comm_bytes: int
    world: int
    gas: int
    compute_s_per_micro_step: dict[int, float]  # by stage (§Calibration): what a micro-step costs whatever its size
    compute_s_per_sample: float
    optimizer_s_per_param: float
    host_optimizer_s_per_param: float | None  # None: offloaded updates at the device's rate
    link: Link
    pass_s: dict | None  # measured seconds per pass of each collective; None: the link's formulas
    host_link_Bps: float | None  # None: the device is the host, offloading copies nothing
    sources: tuple[str, ...]  # the trials it came from

    def per_micro_step(self, stage: int) -> float:
        """The stage's fitted cost per micro-step; for a stage no trial ran, the median of the others'."""
        known = self.compute_s_per_micro_step
        return known[stage] if stage in known else _median(known.values()) if known else 0.0

    def predict(self, c: Candidate) -> StepPrediction:
        return predict_step(self.num_params, stage=c.stage, world_size=self.world, micro=c.micro, gas=self.gas,
                            units=self.units, compute_s_per_sample=self.compute_s_per_sample,
                            compute_s_per_micro_step=self.per_micro_step(c.stage),
                            optimizer_s_per_param=self.optimizer_s_per_param,
                            host_optimizer_s_per_param=self.host_optimizer_s_per_param, link=self.link,
                            pass_s=self.pass_s, comm_bytes=self.comm_bytes, offload_optimizer=c.offload,
                            host_link_Bps=self.host_link_Bps)


def fit(trials: list[Trial], *, world: int, gas: int, link: Link | None = None,
        host_link_Bps: float | None = None) -> Calibration:
    """The model from `trials` (at least one). `link`, when given (`--link-bandwidth`,
    `--link-latency`), replaces the measured passes and link: collectives by the traffic formulas."""
    reports = [r for _, r in trials]
    first = reports[0]
    n_params, units = int(first["num_params"]), int(first.get("units") or 1)
    comm_bytes = int(first.get("comm_bytes") or 4)
    pass_s = None
    if link is None:
        links = [r["link"] for r in reports if r.get("link")]
        link = (ring_link(_median(lk["latency_s"] for lk in links), _median(lk["bandwidth_Bps"] for lk in links), world)
                if links else Link(0.0, float("inf")))
        measured = [r["passes_s"] for r in reports if r.get("passes_s")]
        if measured:  # the fastest trial's: a pass costs the same in every trial, and interference only adds
            pass_s = {k: min(p[k] for p in measured) for k in (*PASS_KINDS, "scalar")}
    device = [_optimizer_rate(c, r, world) for c, r in trials if c.offload == "none" or c.stage == 0]
    host = [_optimizer_rate(c, r, world) for c, r in trials if c.offload != "none" and c.stage > 0]
    device, host = [x for x in device if x is not None], [x for x in host if x is not None]
    opt = _median(device) if device else _median(host) if host else 0.0
    base = Calibration(n_params, units, comm_bytes, world, gas, {}, 0.0, opt, _median(host) if host else None,
                       link, pass_s, host_link_Bps, tuple(c.name for c, _ in trials))
    # What each trial's step leaves for compute, per micro-step, against its micro-batch (and the
    # step per micro-step, the scale of its error).
    points = [(c.stage, c.micro, (r["step_time_s"] - base.predict(c).total_s) / gas, r["step_time_s"] / gas)
              for c, r in trials]
    per_step, per_sample = _fit_lines(points)
    return dataclasses.replace(base, compute_s_per_micro_step=per_step, compute_s_per_sample=per_sample)


def fit_layouts(trials: list[Trial], *, world: int, **kw) -> dict[tuple[int, int], Calibration]:
    """One model per layout (tensor parallel, pipeline stages) that ran, each `fit` to its own
    trials over its data-parallel ranks (`specs/autotune.md` §Calibration)."""
    return {lay: fit(group, world=world // (lay[0] * lay[1]), **kw) for lay, group in _by_layout(trials).items()}


def leave_one_out(trials: list[Trial], *, world: int, **kw) -> dict[Candidate, float]:
    """Each trial's step as predicted by the model fitted to every other trial of its layout:
    out-of-sample for each (needs two trials of the layout; with one, its own fit)."""
    out = {}
    for (tp, pp), group in _by_layout(trials).items():
        dp = world // (tp * pp)
        if len(group) < 2:
            out.update({c: fit(group, world=dp, **kw).predict(c).total_s for c, _ in group})
        else:
            out.update({c: fit(group[:i] + group[i + 1:], world=dp, **kw).predict(c).total_s
                        for i, (c, _) in enumerate(group)})
    return out


def _by_layout(trials: list[Trial]) -> dict[tuple[int, int], list[Trial]]:
    groups: dict[tuple[int, int], list[Trial]] = {}
    for c, r in trials:
        groups.setdefault(c.layout, []).append((c, r))
    return groups


def _optimizer_rate(c: Candidate, report: dict, world: int) -> float | None:
    t = (report.get("timings_s") or {}).get("optimizer")
    if t is None:
        return None
    return float(t) / (report["num_params"] / (1 if c.stage == 0 else world))


def _fit_lines(points: list[tuple[int, int, float, float]]) -> tuple[dict[int, float], float]:
    """Per-stage intercepts a_s and one slope b ≥ 0 of y = a_s + b·m, from points (stage, m, y,
    t): least squares on the step's relative error (weights 1/t², t the measured step per
    micro-step). Why per stage, why a_s may be negative, and the fit with one micro-batch size per
    stage: `specs/autotune.md` §Calibration."""
    by_stage: dict[int, list[tuple[int, float, float]]] = {}
    for stage, m, y, t in points:
        by_stage.setdefault(stage, []).append((m, y, 1 / max(t, 1e-12) ** 2))
    num = den = 0.0
    for pts in by_stage.values():
        sw = sum(w for _, _, w in pts)
        mm = sum(w * m for m, _, w in pts) / sw
        yy = sum(w * y for _, y, w in pts) / sw
        num += sum(w * (m - mm) * (y - yy) for m, y, w in pts)
        den += sum(w * (m - mm) ** 2 for m, _, w in pts)
    if den == 0:  # no stage ran two micro-batch sizes
        return {s: 0.0 for s in by_stage}, max(_median(y / m for pts in by_stage.values() for m, y, _ in pts), 0.0)
    b = max(num / den, 0.0)
    return {stage: sum(w * (y - b * m) for m, y, w in pts) / sum(w for _, _, w in pts)
            for stage, pts in by_stage.items()}, b


def _median(xs) -> float:
    return float(statistics.median(list(xs)))
