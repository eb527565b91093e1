"""The autotuner's loop: the space, the planner's pruning, the trials in the tuner's order, the
model's predictions, the results (`specs/autotune.md` §Trials). The space, the step-time model
and the bounds are `fnzero/autotune/`; each trial's job is `_jobs.py`, the outputs `_results.py`."""

from __future__ import annotations

import os
import sys
import time

from ...autotune import (Candidate, activation_bytes_per_sample, build_space, fit_layouts, given_layout,
                        host_memory_bytes, leave_one_out, memory_floor, micro_batch_sizes, model_state_estimate, order,
                        prune, trial_config, trial_overhead_s, two_sizes_ran)
from ._jobs import launch_flags, launch_with_best, run_trial, script_args_for
from ._results import (
    DEFAULT_TRIAL_S as _DEFAULT_TRIAL_S, ignored_dir, metric_value, progress_line, row_for, versus, write_results,
)

__all__ = ["CONFIRM_SLOWER", "Tuning"]

# --confirm's threshold: a measured step this much slower than predicted (prediction error below
# -15 %, the measurement 18 % above) is run again. Job-to-job spread of one config here: +-14 %.
CONFIRM_SLOWER = 0.15


class Tuning:
    """One `fnzero autotune` run: `Tuning(args, cfg, raw).run()` is its exit status."""

    def __init__(self, args, cfg, raw: dict):
        import torch

        self.args, self.cfg, self.raw, self.at = args, cfg, raw, cfg.autotuning
        self.world, self.gas = args.world, cfg.gradient_accumulation_steps
        self.cuda = torch.cuda.is_available()
        self.limit = args.memory_limit
        if self.limit is None and self.cuda:
            self.limit = torch.cuda.get_device_properties(0).total_memory
        elif self.limit is None and (host := host_memory_bytes()):  # the device is the host: its ranks share it
            self.limit = host // max(1, args.world)
        self.num_params = args.params or self.at.model_info.num_params
        self.rows: dict[Candidate, dict] = {}
        self.results: dict = {}
        self.models: dict = {}  # the step-time model of each layout (tp, pp), fitted to `self.fitted`
        self.fitted: list[tuple[Candidate, dict]] = []
        self.predicted: dict[Candidate, float] = {}  # each row's predicted step (§Calibration)
        self.jobs: dict[Candidate, list] = {}  # every job's TrialResult per candidate (--rounds)
        self.t0 = time.perf_counter()
        self.ran = 0

    # -- the flow ------------------------------------------------------------------------------------------

    def run(self) -> int:
        at = self.at
        for key in ("results_dir", "exps_dir"):  # DeepSpeed's defaults, in the working directory: kept out of git
            if key not in (self.raw.get("autotuning") or {}):
                ignored_dir(getattr(at, key))
        micros = self.args.micro_batch_sizes or micro_batch_sizes(
            at.min_train_micro_batch_size_per_gpu, at.max_train_micro_batch_size_per_gpu, at.num_tuning_micro_batch_sizes)
        tp0, pp0 = given_layout(self.raw)
        tps, pps = self.args.tensor_parallel or [tp0], self.args.pipeline_stages or [pp0]
        cands, rejected = build_space(sorted(set(self.args.stages)), micros, self.args.offload, gas=self.gas,
                                      world=self.world, min_batch=at.min_train_batch_size, max_batch=at.max_train_batch_size,
                                      layouts=[(t, p) for t in tps for p in pps])
        for c, why in rejected:
            self._row(c, "rejected", why)
        rounds = self.args.rounds
        planned = min(len(cands), at.tuner_num_trials) * rounds
        self.budget = self.args.time_budget if self.args.time_budget is not None else _DEFAULT_TRIAL_S * planned
        self._say(f"{len(cands)} candidates (stages {sorted(set(self.args.stages))} x micro-batch {micros} x offload "
                  f"{self.args.offload} x tensor parallel {tps} x pipeline stages {pps}), {self.world} rank(s) per trial, tuner {at.tuner_type}, "
                  f"metric {at.metric}; time budget {self.budget:.0f} s for at most {planned} trial(s)"
                  + (f" ({rounds} rounds)" if rounds > 1 else ""))
        if self.num_params is None and cands:  # the least-memory candidate measures the model's size first
            first = max(cands, key=lambda c: (c.stage, -c.micro, c.offload == "none"))
            self._trial(first, planned)
            self.num_params = (self.results.get(first) and self.results[first].report.get("num_params")) or None
            if self.num_params is None:
                return self._finish(f"the first trial ({first.name}) reported no parameter count; pass --params")
        keep, pruned = prune(cands, self.num_params, self.world, self.cfg.precision, self.limit, not self.cuda)
        for c, why in pruned:
            if c not in self.results:
                self._row(c, "pruned", why)
                self._say(f"pruned {c.name}: {why}")
        self._search([c for c in keep if c not in self.results], planned)
        for r in range(2, rounds + 1):
            if not self._round(r, planned):
                break
        self._confirm(planned)
        return self._finish(None)

    def _search(self, todo: list[Candidate], planned: int) -> None:
        at, since_best, best = self.at, 0, self._best()
        while todo:
            if self.ran >= at.tuner_num_trials:
                return self._skip(todo, f"autotuning.tuner_num_trials ({at.tuner_num_trials}) reached")
            if since_best >= at.tuner_early_stopping:
                return self._skip(todo, f"early stopping: {since_best} trials without a better one "
                                        f"(autotuning.tuner_early_stopping)")
            if self._left() <= 0:
                return self._skip(todo, f"time budget ({self.budget:.0f} s) spent")
            predicted = {c: v for c in todo if (v := self._predicted_metric(c)) is not None}
            unseen = [c for c in todo if c.layout not in self.models]
            if at.tuner_type == "model_based" and self.models and unseen:
                c = unseen[0]  # a layout's first trial, which its model is then fitted to
            else:
                c = order(todo, at.tuner_type, seed=self.args.seed, predicted=predicted,
                          better_high=at.metric != "latency")[0]
            todo.remove(c)
            if bound := self._beyond_bounds(c, planned):
                self._row(c, *bound)
                self._say(f"{bound[0]} {c.name}: {bound[1]}")
                continue
            self._trial(c, planned)
            new_best = self._best()
            since_best = 0 if new_best != best else since_best + 1
            best = new_best

    def _beyond_bounds(self, c: Candidate, planned: int) -> tuple[str, str] | None:
        """(status, why) when c need not run: its memory floor is over the limit, or its trial would
        take more than its share of the budget (§Bounds); None to run it."""
        from ...memory import format_bytes

        ran = [(r, res) for r, res in self.results.items() if res.status == "ok"]
        if not two_sizes_ran(c, ran):
            return None
        per_sample = activation_bytes_per_sample(c, ran)
        if self.limit is not None and per_sample is not None and self.num_params:
            state = model_state_estimate(c, self.num_params, self.world, self.cfg.precision, not self.cuda)
            need = memory_floor(c, ran, state, per_sample)
            if need > self.limit:
                return "pruned", (f"planner: at least {format_bytes(need)} per rank (model state {format_bytes(state)}, "
                                  f"peak memory growing {format_bytes(per_sample)} a sample as measured) > memory "
                                  f"limit {format_bytes(self.limit)}")
        step = self._predict(c)
        if step is None or step <= 0 or c.micro <= max(r.micro for r, _ in ran if r.layout == c.layout):
            return None  # time bounds the grid's growth: sizes up to those measured run (their cost is seen)
        steps = self.at.end_profile_step
        trial = trial_overhead_s(ran, steps) + steps * step
        share = self.budget / max(1, planned)
        allowed = min(share, self._left(), self.args.trial_timeout or float("inf"))
        if trial > allowed:
            return "skipped", (f"predicted {step:.3f} s a step from the smaller sizes measured: its {steps} steps "
                               f"would take ~{trial:.0f} s, more than the {allowed:.0f} s its trial may take "
                               f"(its share of the time budget, {share:.0f} s, or what is left)")
        return None

    def _round(self, r: int, planned: int) -> bool:
        """Round r of --rounds (specs/autotune.md §Rounds); False when the time budget ran out."""
        for c in [c for c, _ in self.fitted]:
            if self._left() <= 0:
                self._say(f"round {r} stopped: time budget ({self.budget:.0f} s) spent")
                return False
            self._trial(c, planned, exps_dir=os.path.join(self.at.exps_dir, f"round{r}"), overwrite=True)
        return True

    def _confirm(self, planned: int) -> None:
        """--confirm: one more job for each candidate measured more than CONFIRM_SLOWER slower than the
        others predict (specs/autotune.md §Confirm, which says the order, the caps and why)."""
        extra, cap = 0, self.args.confirm
        if cap is None:
            cap = -(-len(self.fitted) // 5)  # a fifth of the candidates that ran successfully
        confirmed: dict[Candidate, int] = {}
        unjudged: set[Candidate] = set()
        while extra < cap and len(self.fitted) >= 3:
            loo = leave_one_out(self.fitted, **self._fit_options())
            # Only where the prediction rests on the candidate's own stage: two others of it ran.
            stages = [(c.stage, c.layout) for c, _ in self.fitted]
            judged = [(c, rep["step_time_s"]) for c, rep in self.fitted
                      if stages.count((c.stage, c.layout)) >= 3 and confirmed.get(c, 0) < 2]
            for c, _ in judged:
                if loo[c] <= 0 and c not in unjudged:
                    unjudged.add(c)
                    self._say(f"not judging {c.name}: the other candidates predict a step of {loo[c]:.4f} s, "
                              "which says nothing about its measurement")
            suspects = sorted((c for c, measured in judged if loo[c] > 0 and loo[c] / measured - 1 < -CONFIRM_SLOWER),
                              key=lambda c: (confirmed.get(c, 0), loo[c] / self.results[c].step_time_s))
            if not suspects:
                return
            if self._left() <= 0:
                return self._say(f"confirming stopped: time budget ({self.budget:.0f} s) spent")
            c = suspects[0]
            self._say(f"confirming {c.name}: measured {versus(self.results[c].step_time_s, loo[c])} what the other "
                      f"candidates predict; one more job")
            confirmed[c] = confirmed.get(c, 0) + 1
            extra += 1
            self._trial(c, planned + cap, exps_dir=os.path.join(self.at.exps_dir, f"confirm{len(self.jobs[c]) + 1}"),
                        overwrite=True)

    def _trial(self, c: Candidate, planned: int, exps_dir: str | None = None, overwrite: bool | None = None) -> None:
        left = self._left()
        timeout = min(left, self.args.trial_timeout) if self.args.trial_timeout else left
        res = run_trial(c, raw=self.raw, exps_dir=exps_dir or self.at.exps_dir, world=self.world, gas=self.gas,
                        script=self.args.script, user_args=self.args.script_args, at=self.at,
                        timeout_s=max(timeout, 1.0), overwrite=self.at.overwrite if overwrite is None else overwrite,
                        flags=launch_flags(self.args))
        self.ran += 1
        jobs = self.jobs.setdefault(c, [])
        jobs.append(res)
        # The candidate's result is its fastest successful job (interference only adds time), else its first.
        ok = [j for j in jobs if j.status == "ok"]
        kept = min(ok, key=lambda j: j.step_time_s) if ok else jobs[0]
        self.results[c] = kept
        # The progress line shows what the model said before this trial ran; then it is refitted.
        if (before := self._predict(c)) is not None:
            self.predicted[c] = before
        row = self._row(c, kept.status, kept.reason, kept)
        line = self._row_for(c, res.status, res.reason, res) if res is not kept else row  # this job's, not stored
        self._say(progress_line(self.ran, planned, line, time.perf_counter() - self.t0, self.budget)
                  + (f" (job {len(jobs)}; kept {kept.step_time_s:.4f})" if len(jobs) > 1 and ok else ""))
        if kept.status == "ok" and kept.report.get("num_params"):
            self.fitted = [(f, rep) for f, rep in self.fitted if f != c] + [(c, kept.report)]
            self._fit(c)

    # -- the model -----------------------------------------------------------------------------------------

    def _fit_options(self) -> dict:
        from ...memory import Link, ring_link

        a, link = self.args, None
        if a.link_bandwidth is not None or a.link_latency is not None:
            measured = self.fitted[0][1].get("link") or {}
            lat = a.link_latency if a.link_latency is not None else ring_link(
                measured.get("latency_s", 0.0), 1.0, self.world).latency_s
            link = Link(lat, a.link_bandwidth if a.link_bandwidth is not None else measured.get("bandwidth_Bps", 1e30))
        host = a.host_bandwidth if a.host_bandwidth is not None else (25e9 if self.cuda else None)
        return dict(world=self.world, gas=self.gas, link=link, host_link_Bps=host)

    def _fit(self, c: Candidate) -> None:
        """Refit every layout's model; say the one `c` belongs to."""
        self.models = fit_layouts(self.fitted, **self._fit_options())
        k = self.models[c.layout]
        of = f"layout tp {c.tp} x pp {c.pp}, " if set(self.models) != {(1, 1)} else ""
        comm = (", ".join(f"{n} {k.pass_s[n] * 1e3:.2f} ms" for n in ("all_reduce", "all_gather", "reduce_scatter"))
                + " per pass") if k.pass_s else (f"link {k.link.bandwidth_Bps / 1e9:.3f} GB/s and "
                                                 f"{k.link.latency_s * 1e6:.1f} us/hop")
        steps = ", ".join(f"z{s} {t * 1e3:.2f}" for s, t in sorted(k.compute_s_per_micro_step.items()))
        self._say(f"step-time model ({of}{k.world} data-parallel rank(s)) fitted to {len(k.sources)} trial(s): compute {k.compute_s_per_sample * 1e3:.3f} "
                  f"ms/sample + per micro-step ({steps}) ms, optimizer "
                  f"{k.optimizer_s_per_param * 1e9:.3f} ns/param; {comm}; {k.units} units, {k.num_params:,} parameters")

    def _predict(self, c: Candidate) -> float | None:
        """c's step by its layout's model; None before a trial of that layout ran."""
        model = self.models.get(c.layout)
        return model.predict(c).total_s if model else None

    def _predicted_metric(self, c: Candidate) -> float | None:
        t = self._predict(c)
        if t is None or t <= 0:  # no time or less: the fit extrapolated past its points, no rank for the tuner
            return None
        return t if self.at.metric == "latency" else c.micro * self.gas * c.dp(self.world) / t

    # -- rows, best, outputs -------------------------------------------------------------------------------

    def _row_for(self, c: Candidate, status: str, reason: str = "", res=None) -> dict:
        """Candidate c's table row with result `res`."""
        est = (model_state_estimate(c, self.num_params, self.world, self.cfg.precision, not self.cuda)
               if self.num_params and c.dp(self.world) >= 1 else None)  # a layout the world cannot hold: none
        return row_for(c, world=self.world, gas=self.gas, status=status, reason=reason, result=res, estimate=est,
                       predicted=self.predicted.get(c), metric=metric_value(self.at.metric, res, self.num_params,
                                                                            self.world), jobs=self.jobs.get(c))

    def _row(self, c: Candidate, status: str, reason: str = "", res=None) -> dict:
        """Store (and return) candidate c's row in the table."""
        self.rows[c] = row = self._row_for(c, status, reason, res)
        return row

    def _skip(self, todo, why: str) -> None:
        for c in todo:
            self._row(c, "skipped", why)
        self._say(f"{len(todo)} candidate(s) not run: {why}")

    def _best(self):
        scored = [(r["metric"], c) for c, r in self.rows.items() if r["status"] == "ok" and r["metric"] is not None]
        if not scored:
            return None
        sign = -1 if self.at.metric == "latency" else 1
        return max(scored, key=lambda mc: sign * mc[0])[1]

    def _left(self) -> float:
        return self.budget - (time.perf_counter() - self.t0)

    def _finish(self, error: str | None) -> int:
        if self.models:  # each trial's prediction from the others (out of sample), the rest from them all
            self.predicted = {c: t for c in self.rows if (t := self._predict(c)) is not None}
            self.predicted.update(leave_one_out(self.fitted, **self._fit_options()))
            for c, row in list(self.rows.items()):
                self._row(c, row["status"], row["reason"], self.results.get(c))
        best = self._best()
        config = cmd = None
        if best is not None:
            config = trial_config(self.raw, best, gas=self.gas, world=self.world, metric_path="", start=0, end=0)
            path = os.path.join(self.at.results_dir, "ds_config_optimal.json")
            cmd = ["fnzero", "launch", "--nproc-per-node", str(self.world), *launch_flags(self.args), self.args.script,
                   *script_args_for(self.args.script_args, path, config, self.at.arg_mappings)]
        paths = write_results(self.at.results_dir, list(self.rows.values()), config, cmd)
        self._say(f"results: {paths['csv']}, {paths['json']}")
        if error or best is None:
            print(f"fnzero autotune: {error or 'no trial succeeded; see the reasons in ' + paths['csv']}", file=sys.stderr)
            return 1
        r = self.rows[best]
        self._say(f"best: {best.name} (stage {best.stage}, micro-batch {best.micro}, offload {best.offload}): "
                  f"{r['step_time_s']:.4f} s/step, {r['samples_per_s']:.1f} samples/s -> {paths['config']}")
        return launch_with_best(self.args, paths["config"]) if self.args.run else 0

    def _say(self, line: str) -> None:
        print(f"fnzero autotune: {line}", flush=True)
