"""The `fnzero` command (`specs/cli.md`): launch, report, config, plan, checkpoint.

`_main.py` parses and dispatches; each command family is one module (`_plan.py`, `_checkpoint.py`,
`_report.py`). Handlers import torch and the rest of fnzero only when they run, so `--help` and
`config` stay fast.
"""

from __future__ import annotations

from ._main import build_parser, main

__all__ = ["build_parser", "main"]
