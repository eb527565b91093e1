"""The autotuner's outputs: the results table (csv and json, a row per candidate), the optimal
config and command (DeepSpeed's `ds_config_optimal.json`, `cmd_optimal.txt`), progress lines
(`specs/autotune.md` §Outputs)."""

from __future__ import annotations

import csv
import json
import os

DEFAULT_TRIAL_S = 120.0  # the time budget per planned trial when --time-budget is not given

__all__ = ["DEFAULT_TRIAL_S", "COLUMNS", "row_for", "metric_value", "write_results", "progress_line", "versus",
           "ignored_dir"]

COLUMNS = ("name", "stage", "micro_batch", "offload", "tensor_parallel", "pipeline_stages", "train_batch_size", "status", "reason", "step_time_s",
           "samples_per_s", "tokens_per_s", "flops_per_s_per_rank", "peak_memory_bytes", "model_state_bytes",
           "estimate_bytes", "predicted_step_s", "prediction_error", "metric", "wall_s", "job_step_times_s")


def metric_value(metric: str, result, num_params: int | None, world: int) -> float | None:
    """The trial's value of autotuning.metric: throughput (samples/s) and flops (FLOP/s per rank,
    measured by the flops profiler, else 6 Ψ per token) are maximised, latency (s/step) minimised."""
    if result is None or result.status != "ok":
        return None
    if metric == "latency":
        return result.step_time_s
    if metric == "flops":
        if result.flops_per_s_per_rank:
            return result.flops_per_s_per_rank
        return 6 * num_params * result.tokens_per_s / world if num_params and result.tokens_per_s else None
    return result.samples_per_s


def row_for(c, *, world: int, gas: int, status: str, reason: str = "", result=None, estimate: int | None = None,
            predicted: float | None = None, metric: float | None = None, jobs: list | None = None) -> dict:
    """One row of the table; `jobs`: every job the candidate ran (--rounds), `result` the one kept."""
    r = dict.fromkeys(COLUMNS)
    r.update(name=c.name, stage=c.stage, micro_batch=c.micro, offload=c.offload, tensor_parallel=c.tp,
             pipeline_stages=c.pp, train_batch_size=c.micro * gas * c.dp(world) or None,
             status=status, reason=reason, estimate_bytes=estimate, predicted_step_s=predicted, metric=metric)
    if result is not None:
        r.update(step_time_s=result.step_time_s, samples_per_s=result.samples_per_s, tokens_per_s=result.tokens_per_s,
                 flops_per_s_per_rank=result.flops_per_s_per_rank, peak_memory_bytes=result.peak_memory_bytes,
                 model_state_bytes=result.model_state_bytes, wall_s=round(result.wall_s, 3))
        if predicted is not None and result.step_time_s:
            r["prediction_error"] = predicted / result.step_time_s - 1
    if jobs:
        r["job_step_times_s"] = [j.step_time_s for j in jobs]
    return r


def ignored_dir(path: str) -> None:
    """Make `path` a directory that version control leaves alone: a `.gitignore` of `*` in it, as
    pytest's and ruff's caches have (specs/autotune.md §Outputs). Only a directory made here gets the
    marker: one that exists already (a user's, perhaps tracked) is left as it is."""
    if os.path.isdir(path):
        return
    os.makedirs(path)
    with open(os.path.join(path, ".gitignore"), "w") as f:
        f.write("# Written by fnzero autotune when it made this directory, its default output directory, which "
                "version control need not see.\n# Set autotuning.results_dir / exps_dir to choose the directory; "
                "delete this file to track this one.\n*\n")


def write_results(results_dir: str, rows: list[dict], best_config: dict | None, best_cmd: list[str] | None) -> dict:
    """Write the table and, when a trial succeeded, the optimal config and command; their paths."""
    os.makedirs(results_dir, exist_ok=True)
    paths = {"csv": os.path.join(results_dir, "autotune_results.csv"),
             "json": os.path.join(results_dir, "autotune_results.json")}
    with open(paths["csv"], "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS)
        w.writeheader()
        w.writerows(rows)
    with open(paths["json"], "w") as f:
        json.dump(rows, f, indent=1)
    if best_config is not None:
        paths["config"] = os.path.join(results_dir, "ds_config_optimal.json")
        with open(paths["config"], "w") as f:
            json.dump(best_config, f, indent=2)
        paths["cmd"] = os.path.join(results_dir, "cmd_optimal.txt")
        with open(paths["cmd"], "w") as f:
            f.write(" ".join(best_cmd or []) + "\n")
    return paths


def progress_line(i: int, total: int, row: dict, elapsed: float, budget: float) -> str:
    """`[2/4] z3_mbs2: 0.1234 s/step, 32.5 samples/s, 2,080 tok/s, peak 512 MiB; predicted 0.1180 s (-4.4%) | 23 s of 120 s`."""
    head = f"[{i}/{total}] {row['name']}: "
    if row["status"] != "ok":
        body = f"{row['status']}: {row['reason']}"
    else:
        body = f"{row['step_time_s']:.4f} s/step, {row['samples_per_s']:.1f} samples/s"
        if row["tokens_per_s"]:
            body += f", {row['tokens_per_s']:,.0f} tok/s"
        if row["peak_memory_bytes"]:
            body += f", peak {row['peak_memory_bytes'] / 2**20:.0f} MiB"
        if row["predicted_step_s"] is not None:
            body += f"; predicted {row['predicted_step_s']:.4f} s ({100 * row['prediction_error']:+.1f}%)"
    return f"{head}{body} | {elapsed:.0f} s of {budget:.0f} s"


def versus(measured: float, predicted: float) -> str:
    """`27% above` / `12% below`: where a measured step lies, in percent of the (positive) prediction."""
    assert predicted > 0, predicted  # a non-positive prediction is no scale: callers leave it out
    pct = 100 * (measured / predicted - 1)
    return f"{abs(pct):.0f}% {'above' if pct >= 0 else 'below'}"
