"""`assert_stage_equivalent`: a ZeRO stage on N ranks equals the unsharded step on one process
(`specs/testing.md` §Assertions, §Noise floor)."""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch

import fnzero

from ._floor import Floor, floor_note, judge, measure_floor, warn_floor_used
from ._precision import describe_sites, lower_precision_sites
from ._runs import AUTO, build, cast_floats, derive_config, global_rows, model_dtype, precision_of, rank_slice, step_loss
from ._threads import simulated_world
from ._trees import assert_trees_close

__all__ = ["assert_stage_equivalent", "default_tolerances"]


def default_tolerances(precision: str, float64: bool) -> tuple[float, float, bool]:
    """`(rtol, atol, compare_params)` for a precision and whether the model is float64; why each:
    `specs/testing.md` §Tolerances."""
    if precision == "fp32":
        return (1e-9, 1e-9, True) if float64 else (1e-4, 1e-6, False)
    return (5e-3, 1e-4, False) if precision == "fp16" else (3e-2, 1e-3, False)


def _trace(model_factory, loss, cfg, comm, batches, *, dtype, seed):
    sm, state = build(model_factory, cfg, comm, dtype, seed)
    step = fnzero.train_step(step_loss(sm, loss), cfg)
    out = []
    for b in batches:
        state, m = step(state, b)
        out.append({"metrics": {"loss": m["loss"], "grad_norm": m["grad_norm"], "skipped": m["skipped"]},
                    "params": sm.gather(state)})
    return out


def assert_stage_equivalent(
    model_factory: Callable[[], Any],
    loss_fn: Callable[..., Any],
    cfg: Any,
    batch: Any,
    world_size: int = 2,
    steps: int = 3,
    *,
    rtol: float | None = None,
    atol: float | None = None,
    compare_params: bool | None = None,
    dtype: Any = AUTO,
    seed: int = 0,
    wrap_comm: Callable[[Any], Any] | None = None,
    noise_floor: bool = True,
) -> None:
    """Assert that `steps` training steps at `cfg`'s ZeRO stage on a simulated world of
    `world_size` ranks equal the unsharded stage-0 step on one process given the global batch.

    model_factory: zero-arg callable -> nn.Module (a class, a `ModelFactory`); it is called under
        `seeded(seed)` once per rank and once for the reference, so all copies are identical.
    loss_fn: `loss_fn(apply, batch) -> scalar`, `apply(*args)` runs the model; it must be a mean
        over rows (rank r's share of the global batch is weighted 1/world_size, as in DDP).
    cfg: a Config, dict, path or JSON text; its batch sizes are re-derived from the batch.
    batch: the global batch (a pytree; tensors split along dim 0), used for every step, or a
        callable `step -> batch`. Its rows are extended cyclically to a multiple of
        world_size x gradient_accumulation_steps; rank r gets the r-th contiguous block.
    dtype: "auto" (float64 for fp32 configs, float32 for 16-bit) converts the model and float
        batch leaves; None keeps them. rtol/atol/compare_params default by precision
        (`default_tolerances`). wrap_comm wraps each simulated rank's collectives (fault injection).
    noise_floor: a miss of the stated tolerance is judged again within max(atol, 10 x the
        unsharded step's own noise floor), warning `NoiseFloorWarning` (specs/testing.md §Noise
        floor). False: the stated tolerance alone.
    """
    base = fnzero.load_config(cfg) if not isinstance(cfg, fnzero.Config) else cfg
    stage, k, precision = base.zero_optimization.stage, base.gradient_accumulation_steps, precision_of(base)
    mdtype = model_dtype(base, dtype)
    d_rtol, d_atol, d_params = default_tolerances(precision, mdtype == torch.float64)
    rtol = d_rtol if rtol is None else rtol
    atol = d_atol if atol is None else atol
    parts = ("metrics", "params") if (d_params if compare_params is None else compare_params) else ("metrics",)

    global_batches, given, rows = [], None, None
    for s in range(steps):
        b = batch(s) if callable(batch) else batch
        b, given, rows = global_rows(cast_floats(b, mdtype), world_size * k)
        global_batches.append(b)
    ref_cfg = derive_config(base, 0, 1, rows // k)
    shard_cfg = derive_config(base, stage, world_size, rows // (k * world_size))

    run = functools.partial(_trace, model_factory, loss_fn, dtype=mdtype, seed=seed)
    reference = run(ref_cfg, fnzero.LocalCollectives(), global_batches)
    traces = simulated_world(world_size, wrap_comm=wrap_comm).run(
        lambda comm: run(shard_cfg, comm, [rank_slice(b, comm.rank, world_size) for b in global_batches])
    )
    chunks = world_size * k

    def measure() -> Floor | None:
        # One process, accumulating over exactly the sharded run's micro-batches: rank r's j-th is
        # the global batch's (r*k + j)-th, as split_micro_batches cuts it.
        if not noise_floor or chunks == 1:
            return None
        split = run(derive_config(base, 0, 1, rows // chunks, accumulation=chunks), fnzero.LocalCollectives(), global_batches)
        return measure_floor(split, reference, chunks)

    extended = f" (extended from {given})" if given != rows else ""
    what = (f"ZeRO stage {stage} on {world_size} simulated ranks diverged from the unsharded stage-0 step on one "
            f"process at step {{s}} of {steps}, rank {{r}} ({precision}, {rows} global rows{extended}, accumulation {k})")
    floor, worst = _compare(traces, reference, parts, rtol, atol, measure, what)
    if floor is not None:
        try:
            sites = describe_sites(lower_precision_sites(
                model_factory, loss_fn, rank_slice(global_batches[0], 0, chunks), mdtype, seed))
        except Exception as e:  # a diagnostic for the warning: it must not turn a pass into an error
            sites = e
        warn_floor_used(f"assert_stage_equivalent (ZeRO stage {stage} on {world_size} simulated ranks)", floor, worst,
                        sites, mdtype == torch.float64, rtol)


def _compare(traces, reference, parts, rtol, atol, measure, what) -> tuple[Floor | None, tuple[str, float]]:
    """Each step, then rank, against the reference, the first miss raising (after being judged again
    against the noise floor); returns (the floor if some leaf needed it else None, the closest leaf)."""
    floor, needed, worst = None, False, ("", 0.0)
    for s in range(len(reference)):
        for r, trace in enumerate(traces):
            got, want = trace[s], reference[s]
            # Report metrics and parameters together: a wrong gradient norm says "the reduction",
            # the parameter paths say which units it hit.
            found = []
            for part in parts:
                try:
                    assert_trees_close(got[part], want[part], rtol, atol, root=part)
                except AssertionError as e:
                    found.append(str(e))
            if not found:
                continue
            try:
                floor = floor or measure()
            except Exception as e:  # the stated-tolerance report stands; say why it was not re-judged
                found.append(f"(the model's noise floor could not be measured: {type(e).__name__}: {e})")
                floor = None
            if floor is None:
                raise AssertionError(f"{what.format(s=s, r=r)}: " + "; and ".join(found))
            if not floor.is_rounding:
                raise AssertionError(f"{what.format(s=s, r=r)}: " + "; and ".join(found) + "; " + floor_note(floor, False))
            verdicts = [judge(got, want, floor.steps[s], part, rtol, atol) for part in parts]
            found = [v for v, _ in verdicts if v]
            if found:
                raise AssertionError(f"{what.format(s=s, r=r)}: " + "; and ".join(found) + "; " + floor_note(floor, True))
            needed = True
            worst = max([worst] + [w for _, w in verdicts], key=lambda w: w[1])
    return (floor if needed else None), worst
