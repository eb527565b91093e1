"""The autotuner's logic (`specs/autotune.md`): what `fnzero autotune` searches and how it judges,
apart from running the trials (`fnzero/cli/autotune/`).

The search space (`_space.py`):
    Candidate(stage, micro, offload, tp, pp)   one point: its name, layout, data-parallel ranks
    micro_batch_sizes(lo, hi, count)           the micro-batch grid
    build_space(...), prune(...)               the candidates, and those the planner says cannot fit
    trial_config(raw, c, ...)                  the user's config with a candidate applied
    given_layout(raw), order(cands, tuner, ...), model_state_estimate(c, ...)
The step-time model fitted to the trials (`_model.py`; imports torch, so loaded on first use):
    Calibration, fit(trials, ...), fit_layouts(trials, ...), leave_one_out(trials, ...)
How far the micro-batch grid grows (`_bounds.py`):
    two_sizes_ran, activation_bytes_per_sample, memory_floor, trial_overhead_s, host_memory_bytes
"""

from __future__ import annotations

import importlib as _importlib

from ._bounds import activation_bytes_per_sample, host_memory_bytes, memory_floor, trial_overhead_s, two_sizes_ran
from ._space import (Candidate, build_space, given_layout, micro_batch_sizes, model_state_estimate, order, prune,
                     trial_config)

# The step-time model reads the step's collectives from `memory/_predict.py`, which imports torch:
# loaded on first use (PEP 562), so that `fnzero --help` and `fnzero autotune`'s checks stay fast.
_LAZY = dict.fromkeys(("Calibration", "fit", "fit_layouts", "leave_one_out"), "._model")


def __getattr__(name: str):
    where = _LAZY.get(name)
    if where is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(_importlib.import_module(where, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__all__ = ["Calibration", "Candidate", "activation_bytes_per_sample", "build_space", "fit", "fit_layouts",
           "given_layout", "host_memory_bytes", "leave_one_out", "memory_floor", "micro_batch_sizes",
           "model_state_estimate", "order", "prune", "trial_config", "trial_overhead_s", "two_sizes_ran"]
