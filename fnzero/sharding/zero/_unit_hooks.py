"""A unit module's calls served by hooks registered on the module; nothing of the module is replaced.

[Note: units by hooks, as FSDP2's]
A stage-3 unit's module gets a forward pre-hook that gathers and binds it (`ApplyRun.enter_unit`) and a
forward hook, always called, that puts the placeholders back (`exit_unit`) (`specs/sharding.md` §Apply);
they serve the ambient run, else the run bound for backward.

[Note: compiled unit forwards by hooks]
While `fnzero.jit(scope="units")` runs a step, each unit module's forward is compiled where it starts:
`compile_unit_calls` registers a pre-hook that opens a compile window (the ambient's `unit_compiler`,
`train/_compile.py`'s `CompiledFrames`) and a forward hook, always called, that closes it. Between them
the module's `_call_impl` starts the forward's frame (and any pre-hook registered after these), so
dynamo compiles that frame and caches the graph on its code object: units of one class share it. The
gathering hooks run before the window opens and after it closes, eagerly. Inside the window dynamo
would compile every Python frame that starts, fnzero's own hooks included, so both hooks are frames
it skips (`skip_code`) and, once the window is open, run only bytecode, C and torch's code.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any, Callable

import torch
from torch import nn

from ..._errors import ShardingError
from ._ambient import ambient
from ._plan import UnitPlan

if TYPE_CHECKING:
    from ._runtime import ApplyRun

__all__ = ["hook_unit", "compile_unit_calls"]


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


def unit_compiler(run: "ApplyRun | None") -> "Callable[[], Any] | None":
    """What opens a unit call's compile window: the ambient's while `fnzero.jit(scope="units")` runs a
    step, else that of the run the call serves. A recomputation on autograd's device thread (no ambient
    context) thus recomputes the same graph (inductor's dropout draws differ from eager's)."""
    compiler = ambient().unit_compiler
    if compiler is None and run is not None:
        compiler = run.unit_compiler
    return compiler


# Per thread, the unit calls running now, innermost last: (module, the window in force or None, whether
# this call opened it); pushed and popped by the two hooks of one call. Module state because torch calls
# the hooks with nothing to carry it, and a unit called inside another's window must learn that without
# calling a Python function (dynamo would compile it), so not from the ambient context's `ambient()`.
_calls = threading.local()


def compile_unit_calls(module: nn.Module, backward_runs: "list[ApplyRun] | None" = None) -> None:
    """Register the hooks that run `module`'s forward in a compile window while a units-scope step (or
    its recomputation) runs (the second Note above); they do nothing otherwise, and nothing inside
    a torch.compile trace (a whole-loss graph stays one graph)."""

    def open_window(mod: nn.Module, args: tuple, kwargs: dict) -> None:
        if torch.compiler.is_dynamo_compiling():  # (see `close_window`)
            return
        calls = _calls.__dict__.setdefault("stack", [])
        if calls and calls[-1][1] is not None:
            # Called eagerly inside another unit's window (its graph broke): that window compiles
            # this forward too. No Python function may be called here: dynamo would compile it.
            calls.append((mod, calls[-1][1], False))
            return
        compiler = unit_compiler(_run_for(backward_runs))
        calls.append((mod, None if compiler is None else compiler(), compiler is not None))

    def close_window(mod: nn.Module, args: tuple, kwargs: dict, out: Any) -> None:
        # True only where dynamo traces this hook into a graph; `is_compiling()` also reads True
        # while another thread's frame is being compiled (a simulated world's ranks are threads).
        if torch.compiler.is_dynamo_compiling():
            return
        calls = getattr(_calls, "stack", None)
        if calls and calls[-1][0] is mod:  # (not when an earlier pre-hook raised: this call opened nothing)
            _, window, opened = calls.pop()
            if opened:
                window.__exit__(None, None, None)

    _skip_frame(open_window)
    _skip_frame(close_window)
    module.register_forward_pre_hook(open_window, with_kwargs=True)
    # First of the forward hooks: the window closes before any other runs (the gathering's release).
    module.register_forward_hook(close_window, with_kwargs=True, always_call=True, prepend=True)


def _skip_frame(fn: Callable) -> None:
    """Dynamo never compiles `fn`'s frame where it starts (it runs as written, and the frames it starts
    are compiled as usual), but inlines `fn` into a graph that calls it. torch.compiler.disable would
    also break that graph, and switch the frame hook off and back on around `fn`, undoing a window
    `fn` closes."""
    from torch._dynamo.eval_frame import skip_code

    skip_code(fn.__code__)
