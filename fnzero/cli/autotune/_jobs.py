"""One autotuner trial as its own job: its config file, its `fnzero launch` command, its reports
(`specs/autotune.md` §Trials); and `--run`'s training job with the optimal config."""

from __future__ import annotations

import dataclasses
import glob
import json
import os
import subprocess
import sys
import time

from ...autotune import Candidate, trial_config

__all__ = ["TrialResult", "config_arg_index", "launch_flags", "launch_with_best", "run_trial", "script_args_for",
           "trial_argv"]

CONFIG_FLAGS = ("--deepspeed_config", "--deepspeed", "--config")  # DeepSpeed's two, then fnzero's examples'
_OOM_SIGNS = ("out of memory", "OutOfMemoryError", "CUDA error: out of memory", "Cannot allocate memory",
              "std::bad_alloc")


@dataclasses.dataclass
class TrialResult:
    """What one trial measured (max over ranks for memory), or why it has no numbers."""

    status: str  # "ok", "failed", "oom", "timeout"
    reason: str = ""
    step_time_s: float | None = None
    samples_per_s: float | None = None
    tokens_per_s: float | None = None
    flops_per_s_per_rank: float | None = None
    peak_memory_bytes: int | None = None
    model_state_bytes: int | None = None
    wall_s: float = 0.0
    report: dict = dataclasses.field(default_factory=dict)  # rank 0's report


def config_arg_index(user_args: list[str]) -> int:
    """The index of the config path in the script's arguments (after --deepspeed_config,
    --deepspeed or --config, also as --flag=path); -1 when there is none."""
    for flag in CONFIG_FLAGS:
        for i, a in enumerate(user_args):
            if a == flag and i + 1 < len(user_args):
                return i + 1
            if a.startswith(flag + "="):
                return i
    return -1


def script_args_for(user_args: list[str], config_path: str, config: dict, arg_mappings: dict | None) -> list[str]:
    """The script's arguments with the config path replaced, and each `arg_mappings` argument set to
    its config key's value (DeepSpeed's scheduler.run_job: replaced when present, appended when not)."""
    args = list(user_args)
    i = config_arg_index(args)
    if "=" in args[i] and args[i].startswith("--"):
        args[i] = args[i].split("=", 1)[0] + "=" + config_path
    else:
        args[i] = config_path
    for key, flag in (arg_mappings or {}).items():
        value = config
        for part in key.split("."):
            value = value.get(part) if isinstance(value, dict) else None
        if value is None or value == "auto":
            continue
        if flag in args and args.index(flag) + 1 < len(args):
            args[args.index(flag) + 1] = str(value)
        else:
            args += [flag, str(value)]
    return args


# `fnzero launch`'s switches that each trial takes as they are (the rest of a launch's flags start hosts).
LAUNCH_SWITCHES = ("bind_cores_to_rank", "module", "no_python", "quiet")


def launch_flags(args) -> list[str]:
    """The `fnzero launch` flags every trial, the optimal command and `--run` pass on."""
    out = [f"--{name}" for name in LAUNCH_SWITCHES if getattr(args, name, False)]
    if getattr(args, "bind_core_list", None):
        out += ["--bind_core_list", args.bind_core_list]
    return out


def trial_argv(world: int, script: str, args: list[str], flags: list[str] = ()) -> list[str]:
    """The trial's command: this Python's `fnzero launch` (torchrun, one process per rank), with
    the user's launcher `flags` (`launch_flags`: core binding, --module, --no_python, -q)."""
    return [sys.executable, "-m", "fnzero.cli", "launch", "--nproc-per-node", str(world), *flags, script, *args]


def run_trial(c: Candidate, *, raw: dict, exps_dir: str, world: int, gas: int, script: str, user_args: list[str],
              at, timeout_s: float, overwrite: bool = True, flags: list[str] = ()) -> TrialResult:
    """Run candidate `c` as its own job and read what its ranks reported."""
    exp = os.path.join(exps_dir, c.name)
    os.makedirs(exp, exist_ok=True)
    metric_path = os.path.abspath(os.path.join(exp, "metrics.json"))
    if not overwrite and os.path.exists(metric_path):
        return _read_reports(metric_path, 0.0, "reused")
    for old in glob.glob(metric_path + "*"):
        os.remove(old)
    config = trial_config(raw, c, gas=gas, world=world, metric_path=metric_path, start=at.start_profile_step,
                          end=at.end_profile_step)
    config_path = os.path.join(exp, "ds_config.json")
    with open(config_path, "w") as f:
        json.dump(config, f, indent=2)
    argv = trial_argv(world, script, script_args_for(user_args, config_path, config, at.arg_mappings), flags)
    with open(os.path.join(exp, "cmd.txt"), "w") as f:
        f.write(" ".join(argv) + "\n")
    t0 = time.perf_counter()
    log_path = os.path.join(exp, "stdout.log")
    with open(log_path, "w") as log:
        try:
            proc = subprocess.run(argv, stdout=log, stderr=subprocess.STDOUT, timeout=timeout_s,
                                  env={**os.environ, "PYTHONUNBUFFERED": "1"})
            code = proc.returncode
        except subprocess.TimeoutExpired:
            return TrialResult("timeout", f"no report within {timeout_s:.0f} s (the trial's time)",
                               wall_s=time.perf_counter() - t0)
    wall = time.perf_counter() - t0
    if code != 0 or not os.path.exists(metric_path):
        with open(log_path, errors="replace") as f:
            text = f.read()
        if code in (-9, 137) or any(s in text for s in _OOM_SIGNS):
            return TrialResult("oom", f"out of memory (exit status {code}; {log_path})", wall_s=wall)
        last = [ln for ln in text.splitlines() if ln.strip()][-1:] or [""]
        why = (f"exit status {code}: {last[0][:200]}" if code else
               "the job wrote no report: does the script log its steps through fnzero.monitor.Monitor, "
               "and run past autotuning.end_profile_step?")
        return TrialResult("failed", f"{why} ({log_path})", wall_s=wall)
    return _read_reports(metric_path, wall, "")


def _read_reports(metric_path: str, wall: float, note: str) -> TrialResult:
    reports = []
    for path in [metric_path, *sorted(glob.glob(metric_path + ".rank*"))]:
        with open(path) as f:
            reports.append(json.load(f))
    r0 = reports[0]

    def peak(r):
        return r.get("cuda_peak_bytes") or r.get("peak_rss_bytes")

    states = [r["model_state_bytes"] for r in reports if r.get("model_state_bytes") is not None]
    return TrialResult("ok", note, step_time_s=r0["step_time_s"], samples_per_s=r0["samples_per_s"],
                       tokens_per_s=r0["tokens_per_s"], flops_per_s_per_rank=r0.get("flops_per_s_per_rank"),
                       peak_memory_bytes=max(peak(r) or 0 for r in reports), model_state_bytes=max(states, default=None),
                       wall_s=wall, report=r0)


def launch_with_best(args, best_config_path: str) -> int:
    """`--autotuning run`: train with the optimal config, the script's config argument replaced."""
    user = script_args_for(args.script_args, best_config_path, {}, None)
    argv = trial_argv(args.world, args.script, user, launch_flags(args))
    print("fnzero autotune: training with the optimal config: " + " ".join(argv[2:]), flush=True)
    return subprocess.run(argv).returncode
