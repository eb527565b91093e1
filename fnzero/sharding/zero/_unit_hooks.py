"""A unit module's calls routed through the apply run by hooks registered on the module.

[Note: units by hooks, as FSDP2's]
A stage-3 unit's module gets a forward pre-hook that gathers and binds it (`ApplyRun.enter_unit`) and a
forward hook, always called, that puts the placeholders back (`exit_unit`) (`specs/sharding.md` §Apply);
they serve the ambient run, else the run bound for backward. No hook can change what a module computes,
so `fnzero.jit(scope="units")` routes the unit's `forward` through its compiler (`route_unit_forward`).
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

import torch
from torch import nn

from ..._errors import ShardingError
from ._ambient import ambient
from ._plan import UnitPlan

if TYPE_CHECKING:
    from ._runtime import ApplyRun

__all__ = ["hook_unit", "route_unit_forward"]


def hook_unit(module: nn.Module, unit: UnitPlan, backward_runs: "list[ApplyRun]") -> None:
    """Register the hooks that gather `unit` around each call of `module` (the Note above).
    `unit`: the module's trainable or frozen unit (the same name); the run gathers both."""
    entered = threading.local()  # per thread, the runs this module's calls entered, innermost last

    def before(mod: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        run = _run_for(backward_runs)
        if run is None:
            raise ShardingError(
                f"module {unit.module!r} holds stage-3 sharded parameters; call it through "
                "ShardedModule.apply(params, ...) rather than directly"
            )
        args, kwargs = run.enter_unit(unit.name, mod, args, kwargs)
        entered.__dict__.setdefault("runs", []).append(run)
        return args, kwargs

    def after(mod: nn.Module, args: tuple, kwargs: dict, out):
        runs = entered.__dict__.get("runs")
        if runs:  # (nothing when `before` raised: it entered nothing)
            runs.pop().exit_unit()

    module.register_forward_pre_hook(torch.compiler.disable(
        before, recursive=False,
        reason=f"fnzero ZeRO-3: unit {unit.name!r} gathers its parameter shards (an all-gather) before its forward",
    ), with_kwargs=True)
    module.register_forward_hook(torch.compiler.disable(
        after, recursive=False, reason=f"fnzero ZeRO-3: unit {unit.name!r} releases its gathered parameters",
    ), with_kwargs=True, always_call=True, prepend=True)


def _run_for(backward_runs: "list[ApplyRun] | None") -> "ApplyRun | None":
    """The run a unit's call serves: the ambient one, else the one bound for backward."""
    run = ambient().run
    if run is None and backward_runs:
        run = backward_runs[-1]
    return run


def _forward_to_run(module: nn.Module, inner, run: "ApplyRun | None" = None):
    """The unit's own forward, or the compiled one while `fnzero.jit(scope="units")` runs a step.
    A recomputation on autograd's device thread (no ambient context) takes its run's compiler, so it
    recomputes the same graph (inductor's dropout draws differ from eager's)."""
    compiler = ambient().unit_compiler
    if compiler is None and run is not None:
        compiler = run.unit_compiler
    return inner if compiler is None else compiler(module, inner)


def route_unit_forward(module: nn.Module, backward_runs: "list[ApplyRun] | None" = None,
                       sharded: str | None = None) -> None:
    """Let `fnzero.jit(scope="units")` run a unit's forward as its own compiled graph; otherwise, and
    inside any torch.compile trace, the forward is unchanged. `sharded`: a stage-3 unit's name, where a
    whole-loss trace breaks anyway (its gathering hook): the route stays out of that trace."""
    inner = module.forward

    def forward(*args, **kwargs):
        if torch.compiler.is_compiling():
            return inner(*args, **kwargs)  # (traced through: a whole-loss graph stays one graph)
        return _forward_to_run(module, inner, _run_for(backward_runs))(*args, **kwargs)

    forward.__wrapped__ = inner  # type: ignore[attr-defined]
    if sharded is not None:
        forward = torch.compiler.disable(forward, recursive=False,
                                         reason=f"fnzero ZeRO-3: unit {sharded!r} runs fnzero.jit's compiled forward")
    module.forward = forward
