"""`fnzero.jit`: a train step whose forward and backward run as torch.compile graphs, per unit (the
default), the loss function, or the whole step (`_whole_step.py`); what each scope compiles and why
the rest stays eager: `specs/jit.md`."""

from __future__ import annotations

import re
import time
import warnings
from dataclasses import dataclass
from typing import Any

import optree
import torch

from .._errors import FnzeroError
from .._state import TrainState
from ..pipeline import PipelineLoss
from ._compile import CompiledFrames, compile_fn
from ._step import TrainStep

__all__ = ["jit", "JittedStep", "JitWarning", "CompileRecord"]


class JitWarning(UserWarning):
    """`fnzero.jit` broke the graph, fell back to eager, or is recompiling too often."""


@dataclass(frozen=True)
class CompileRecord:
    """One input signature the jitted step has seen: its first call's wall time (trace and
    compile included) and the graph breaks torch.compile reported while compiling it."""

    signature: tuple
    first_call_s: float
    graph_breaks: tuple[str, ...]


def _graph_break_counts() -> dict[tuple[str, str], int]:
    """Dynamo's counts of graph breaks it resumed after ("graph_break") and of breaks that made it
    run a whole frame eagerly ("unimplemented", e.g. a break inside a loop)."""
    from torch._dynamo.utils import counters

    return {(kind, k): v for kind in ("graph_break", "unimplemented") for k, v in counters[kind].items()}


def _short_reason(reason: str) -> str:
    """The first lines of a dynamo graph-break reason (what was unsupported, and why), without
    object addresses so the same break reads the same every time."""
    lines = [ln.strip() for ln in reason.strip().splitlines() if ln.strip()]
    keep = [ln for ln in lines[:2] if not ln.startswith(("Hint:", "Developer debug context"))]
    text = " - ".join(keep) if keep else reason.strip()
    return re.sub(r" at 0x[0-9a-f]+", "", text)


def _describe_breaks(before: dict, after: dict) -> tuple[str, ...]:
    out = []
    for (kind, reason), count in after.items():
        if count > before.get((kind, reason), 0):
            text = _short_reason(reason)
            out.append(text if kind == "graph_break" else f"{text} [the enclosing frame runs eagerly]")
    return tuple(dict.fromkeys(out))


def _signature(state: TrainState, batch: Any) -> tuple:
    """What torch.compile specializes on: the batch's structure, shapes and dtypes, and the
    parameters' shapes and dtypes."""
    leaves, spec = optree.tree_flatten(batch, none_is_leaf=True)
    batch_sig = tuple(
        (tuple(x.shape), x.dtype, x.device.type) if isinstance(x, torch.Tensor) else type(x).__name__ for x in leaves
    )
    params_sig = tuple((k, tuple(v.shape), v.dtype) for k, v in state.params.items())
    return (str(spec), batch_sig, params_sig, state.sharding.plan.placement)


class JittedStep:
    """A `TrainStep` whose forward and backward (per unit, the loss function, or the whole step:
    `scope`) run as torch.compile graphs.

    Call it like the eager step: `state, metrics = jitted(state, batch)`. It keeps a record per
    input signature (`compiles`) and the graph breaks seen (`graph_breaks`); `eager` is the
    original step.
    """

    def __init__(self, step: TrainStep, *, backend: Any = "inductor", mode: str | None = None,
                 fullgraph: bool = False, dynamic: bool | None = None, options: dict[str, Any] | None = None,
                 scope: str = "units"):
        if not isinstance(step, TrainStep):
            raise FnzeroError(f"fnzero.jit expects a step built by fnzero.train_step, got {type(step).__name__}")
        if scope not in ("loss", "step", "units"):
            raise FnzeroError(f"fnzero.jit scope must be 'loss', 'units' or 'step', got {scope!r}")
        self.eager = step
        self.fullgraph = fullgraph
        self.scope = scope
        kwargs = dict(backend=backend, mode=mode, fullgraph=fullgraph, dynamic=dynamic, options=options)
        # A pipeline's loss is a schedule of forwards and point-to-point sends, not one function:
        # its stage's unit forwards compile (scope "units"); "loss" and "step" run it eagerly.
        piped = isinstance(step.loss_fn, PipelineLoss)
        self._loss = step if piped else step.with_loss_fn(compile_fn(step.loss_fn, kwargs))
        self._units = _UnitsStep(step, kwargs) if scope == "units" else None
        self._whole = None
        if scope == "step":
            from ._whole_step import WholeStep

            self._whole = WholeStep(step, kwargs)
        self._records: dict[tuple, CompileRecord] = {}
        self._runners: dict[tuple, Any] = {}
        self._warned: set[str] = set()
        self._fallback_reason: str | None = None
        if piped and scope != "units":
            self._fallback_reason = "a pipeline schedule sends activations between its stages' forwards"
            self._warn_once(f"fnzero.jit(scope={scope!r}): {self._fallback_reason}; the step runs eagerly "
                            "(scope='units' compiles each layer)")

    @property
    def compiles(self) -> tuple[CompileRecord, ...]:
        return tuple(self._records.values())

    @property
    def graph_breaks(self) -> tuple[str, ...]:
        """Every distinct graph-break reason seen so far, in order of first appearance."""
        seen: dict[str, None] = {}
        for r in self._records.values():
            seen.update(dict.fromkeys(r.graph_breaks))
        return tuple(seen)

    @property
    def fallback_reason(self) -> str | None:
        """Why the step runs eagerly, or None while it runs compiled."""
        return self._fallback_reason

    def _warn_once(self, message: str) -> None:
        if message not in self._warned:
            self._warned.add(message)
            warnings.warn(message, JitWarning, stacklevel=3)

    def __call__(self, state: TrainState, batch: Any) -> tuple[TrainState, dict[str, Any]]:
        if self._fallback_reason is not None or not isinstance(state, TrainState):
            return self.eager(state, batch)  # (a wrong state: the eager step names the error)
        sig = _signature(state, batch)
        with warnings.catch_warnings():
            # Dynamo reads `.grad` of every tensor it wraps, which warns for the non-leaf
            # parameter views fnzero passes; the warning concerns dynamo's probe, not user code.
            warnings.filterwarnings("ignore", message="The .grad attribute of a Tensor that is not a leaf")
            if sig in self._records:
                return self._runners[sig](state, batch)
            return self._first_call(sig, state, batch)

    def _runner_for(self, state: TrainState):
        """The compiled callable for this state: the whole-step graph or the per-unit graphs when
        asked for and possible, else the step around the compiled loss function."""
        if self._units is not None:
            # A model with no unit module is one unit, the root: its graph is the loss function's.
            return self._units if any(u.module != "" for u in state.sharding.plan.units) else self._loss
        if self._whole is None:
            return self._loss
        from ._whole_step import whole_step_unsupported

        reason = whole_step_unsupported(self.eager, state)
        if reason is None:
            return self._whole
        if self.fullgraph:
            raise FnzeroError(f"fnzero.jit(scope='step', fullgraph=True) cannot compile this step as one graph: {reason}")
        self._warn_once(f"fnzero.jit: scope='step' compiles the loss function only, because {reason}")
        return self._loss

    def _first_call(self, sig: tuple, state: TrainState, batch: Any):
        runner = self._runner_for(state)
        if self.fullgraph and state.sharding.plan.any_sharded_params and runner is not self._units:
            raise FnzeroError(
                "fnzero.jit(fullgraph=True) cannot compile a ZeRO-3 step into one graph: each sharded unit's "
                "forward first all-gathers its parameter shards (an asynchronous collective outside the graph). "
                "Use fullgraph=False (the default): every unit's forward is still compiled, and the breaks are "
                "listed in .graph_breaks"
            )
        before = _graph_break_counts()
        t0 = time.perf_counter()
        try:
            out = runner(state, batch)
        except Exception as e:  # noqa: BLE001 - a compiler failure becomes a fallback
            if self.fullgraph or not _is_compiler_error(e):
                raise
            reason = f"{type(e).__name__}: {_short_reason(str(e))}"
            if runner is self._whole:
                # Nothing ran yet (tracing failed), so the state is intact: compile the loss only.
                hint = " (with has_aux=True, aux outputs must be tensors to be traced)" if self.eager.has_aux else ""
                self._warn_once(f"fnzero.jit: scope='step' could not trace the step as one graph ({reason}){hint}; "
                                "it compiles the loss function only")
                self._whole = None
                return self._first_call(sig, state, batch)
            self._fallback_reason = reason
            what = "step" if runner is self._whole else "unit forwards" if runner is self._units else "loss"
            self._warn_once(f"fnzero.jit: torch.compile could not compile the {what} ({reason}); the step runs eagerly")
            return self.eager(state, batch)
        seconds = time.perf_counter() - t0
        breaks = _describe_breaks(before, _graph_break_counts())
        self._records[sig] = CompileRecord(sig, seconds, breaks)
        self._runners[sig] = runner
        for b in breaks:
            self._warn_once(f"fnzero.jit: graph break ({b})")
        limit = _recompile_limit()
        if len(self._records) > limit:
            self._warn_once(
                f"fnzero.jit: {len(self._records)} distinct batch/parameter signatures; torch.compile stops "
                f"recompiling after {limit} and runs the rest eagerly. Pad batches to one shape, or pass dynamic=True"
            )
        return out


class _UnitsStep:
    """The eager step, with every unit module's forward (and through AOTAutograd its backward)
    run as its own compiled graph. Each unit's hooks open a compile window around its forward while
    this step runs (the ambient's `unit_compiler`, `sharding/zero/_unit_hooks.py`): dynamo compiles the
    forward's frame and caches it on its code object, so units of one class share a graph (the
    parameters are graph inputs) and each class has its own recompile limit."""

    def __init__(self, step: TrainStep, compile_kwargs: dict[str, Any]):
        self.step = step
        self._frames = CompiledFrames(compile_kwargs)

    def __call__(self, state: TrainState, batch: Any):
        from ..sharding import within

        with within(unit_compiler=self._frames):
            return self.step(state, batch)


def _recompile_limit() -> int:
    cfg = torch._dynamo.config
    return int(getattr(cfg, "recompile_limit", getattr(cfg, "cache_size_limit", 8)))


def _is_compiler_error(e: BaseException) -> bool:
    from torch._dynamo import exc as dynamo_exc

    if isinstance(e, dynamo_exc.TorchRuntimeError):
        return False  # the user's code failed while being traced: the eager error says it better
    if isinstance(e, dynamo_exc.TorchDynamoException):
        return True
    try:
        from torch._inductor.exc import InductorError
    except ImportError:  # older torch
        return False
    return isinstance(e, InductorError)


def jit(step: TrainStep, *, backend: Any = "inductor", mode: str | None = None, fullgraph: bool = False,
        dynamic: bool | None = None, options: dict[str, Any] | None = None, scope: str = "units") -> JittedStep:
    """Compile a step's forward and backward with torch.compile (`specs/jit.md`).

    `backend`, `mode`, `fullgraph`, `dynamic` and `options` are passed to `torch.compile`. `scope`:
    `"units"` (each unit module's forward and backward, one graph per unit structure), `"loss"` (the
    loss function as one graph) or `"step"` (the whole step at stages 0-2; elsewhere it says why once
    and compiles the loss only). A graph break is reported once (`JitWarning`) and kept in
    `.graph_breaks`; a compiler failure is reported once and the step continues eagerly (with
    `fullgraph=True` both raise).

    >>> import torch, fnzero
    >>> cfg = fnzero.load_config({"train_batch_size": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
    >>> sm = fnzero.shard(torch.nn.Linear(4, 1), config=cfg)
    >>> step = fnzero.jit(fnzero.train_step(lambda p, b: sm.apply(p, b).square().mean(), cfg), backend="eager")
    >>> state, metrics = step(sm.init_state(), torch.ones(2, 4))
    >>> step.graph_breaks
    ()
    """
    return JittedStep(step, backend=backend, mode=mode, fullgraph=fullgraph, dynamic=dynamic, options=options,
                      scope=scope)
