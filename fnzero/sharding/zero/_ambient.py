"""The step's ambient context: what fnzero's code needs inside code it does not call.

[Note: why a context variable]
A model's own forward, its modules' hooks, torch's saved-tensor hooks and the user's loss function have
no parameter fnzero could pass a value through, and a module attribute would leak across threads
(simulated ranks) and nested applies (`specs/architecture.md`). `within` is the only place that sets it.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from typing import Any, Callable, Iterator

__all__ = ["Ambient", "ambient", "within"]


@dataclasses.dataclass(frozen=True)
class Ambient:
    """What is in force around the code running now (each field None where nothing is)."""

    # The apply run whose units gather right now (`ShardedModule.apply`, and `fnzero.remat`'s
    # recomputation in backward): the unit hooks and the root's direct-call check find it here.
    run: Any = None
    # Inside the step (or a pipeline schedule, or generation): where every apply run the loss makes
    # is added, so that the caller releases them once their backward is done (`ApplyRun.release`).
    step_runs: list | None = None
    # While `fnzero.jit(scope="units")` runs a step: `() -> window`, which opens a compile window
    # (`train/_compile.py`'s `CompiledFrames`; `window.__exit__(None, None, None)` closes it) that
    # each unit module's hooks put around its forward (`_unit_hooks.py`, `specs/jit.md` §Per unit).
    unit_compiler: Callable | None = None
    # While a block decodes with gathered units held across its forwards (`ShardedModule.holding`,
    # `fnzero.generate`): the `_residency.HeldUnits` the no-grad apply runs read and fill.
    held: Any = None


_AMBIENT: contextvars.ContextVar[Ambient] = contextvars.ContextVar("fnzero_ambient", default=Ambient())


def ambient() -> Ambient:
    """The ambient context of the code running now."""
    return _AMBIENT.get()


@contextlib.contextmanager
def within(**changes: Any) -> Iterator[Ambient]:
    """Run the block with the ambient fields in `changes` replaced (`run`, `step_runs`,
    `unit_compiler`, `held`); the previous context is back on exit."""
    token = _AMBIENT.set(dataclasses.replace(_AMBIENT.get(), **changes))
    try:
        yield _AMBIENT.get()
    finally:
        _AMBIENT.reset(token)
