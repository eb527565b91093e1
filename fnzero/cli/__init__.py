"""The `fnzero` command (`specs/cli.md`), in three parts.

`launch/`: `fnzero launch`, its flags parsed and checked, a frozen `LaunchPlan` built from them,
and the executor of the plan's kind (torchrun here, a launcher per host over ssh, a launcher
tool). `autotune/`: `fnzero autotune` and `launch --autotuning`, the command and its trials as
jobs (the search space and the step-time model are the library's `fnzero/autotune/`). The small
commands, one module per family: `_config.py`, `_plan.py` (with `_plan_predict.py`),
`_checkpoint.py`, `_report.py`, `_bench.py` (`_bench_comm.py`, `_nvme.py`), `_remote.py` (`ssh`).
`_main.py` builds the parser and dispatches. Handlers import torch and the rest of fnzero only
when they run, so `--help` and `config` stay fast.
"""

from __future__ import annotations

from ._main import build_parser, main

__all__ = ["build_parser", "main"]
