"""A unit module's forward routed through the apply run: a stage-3 unit's wrapper gathers its
parameters (`ApplyRun.unit_forward`), and `fnzero.jit(scope="units")` runs a gathered unit's
forward as its own compiled graph."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from ..._errors import ShardingError
from ._plan import UnitPlan
from ._ambient import ambient

if TYPE_CHECKING:
    from ._runtime import ApplyRun

__all__ = ["wrap_unit_forward", "route_unit_forward"]


def wrap_unit_forward(module: nn.Module, unit: UnitPlan, backward_runs: "list[ApplyRun]") -> None:
    # `unit`: the module's trainable or frozen unit (the same name); the run gathers both.
    """Route `module`'s forward through the active ApplyRun, which gathers the unit's parameters.
    In backward (a recomputation) that is the run bound for it, the last of `backward_runs`."""
    inner = module.forward

    def forward(*args, **kwargs):
        run = ambient().run
        if run is None and backward_runs:
            run = backward_runs[-1]
        if run is None:
            raise ShardingError(
                f"module {unit.module!r} holds stage-3 sharded parameters; call it through "
                "ShardedModule.apply(params, ...) rather than directly"
            )
        return run.unit_forward(unit.name, module, _forward_to_run(module, inner, run), args, kwargs)

    forward.__wrapped__ = inner  # type: ignore[attr-defined]
    module.forward = torch.compiler.disable(
        forward, recursive=False,
        reason=f"fnzero ZeRO-3: unit {unit.name!r} gathers its parameter shards (an all-gather) before its forward",
    )


def _forward_to_run(module: nn.Module, inner, run: "ApplyRun | None" = None):
    """The unit's own forward, or the compiled one while `fnzero.jit(scope="units")` runs a step.

    A recomputation in backward may run on autograd's device thread, where the step's context
    variable is not set: it then takes the compiler its run was made under, so the recomputed
    forward is the same graph as the first one (inductor's dropout draws differ from eager's)."""
    compiler = ambient().unit_compiler
    if compiler is None and run is not None:
        compiler = run.unit_compiler
    return inner if compiler is None else compiler(module, inner)


def route_unit_forward(module: nn.Module, backward_runs: "list[ApplyRun] | None" = None) -> None:
    """Let `fnzero.jit(scope="units")` run a gathered (stage 0-2, or persistent) unit's forward as
    its own compiled graph; otherwise, and inside any torch.compile trace, the forward is unchanged."""
    inner = module.forward

    def forward(*args, **kwargs):
        if torch.compiler.is_compiling():
            return inner(*args, **kwargs)  # (traced through: a whole-loss graph stays one graph)
        run = backward_runs[-1] if backward_runs else None  # bound while backward recomputes
        return _forward_to_run(module, inner, run)(*args, **kwargs)

    forward.__wrapped__ = inner  # type: ignore[attr-defined]
    module.forward = forward
