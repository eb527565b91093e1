"""`fnzero autotune` and `fnzero launch --autotuning` (`specs/autotune.md`): the command
(`_command.py`), its loop over the trials (`_loop.py`), each trial as its own `fnzero launch` job
(`_jobs.py`), and the results table and optimal config (`_results.py`). What is searched and how
it is judged, the space, the step-time model and the bounds, is the library's `fnzero/autotune/`."""

from ._command import autotune_from_launch, register

__all__ = ["autotune_from_launch", "register"]
