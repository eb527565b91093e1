"""`assert_reshard_roundtrip`: a checkpoint saved by N ranks loads on M ranks to the same state, both
sides consolidated independently of the checkpoint code (`consolidate`) (`specs/testing.md` §Assertions)."""

from __future__ import annotations

import shutil
import tempfile
from typing import Any, Callable, Sequence

import optree
import torch

import fnzero
from fnzero import checkpoint

from ._runs import AUTO, build, cast_floats, derive_config, global_rows, model_dtype, rank_slice, step_loss
from ._threads import simulated_world
from ._trees import assert_trees_equal

__all__ = ["assert_reshard_roundtrip", "consolidate"]


def _unit_tensor(parts: list[torch.Tensor], unit) -> torch.Tensor:
    full = parts[0] if parts[0].numel() == unit.padded_numel else torch.cat([p.reshape(-1) for p in parts])
    return full.reshape(-1)[: unit.numel].detach().clone()


def _frozen_by_name(states: Sequence[fnzero.TrainState]) -> dict[str, torch.Tensor]:
    """The frozen parameters by name, whether held whole or (stage 3) in frozen units."""
    plan = states[0].sharding.plan
    out = {n: states[0].frozen[n] for n in plan.frozen}
    for u in plan.frozen_units:
        full = _unit_tensor([s.frozen[u.name] for s in states], u)
        out.update({s.name: full[s.offset: s.offset + s.numel].view(s.shape) for s in u.slots})
    return out


def consolidate(states: Sequence[fnzero.TrainState]) -> dict[str, Any]:
    """The logical content of one TrainState per rank (rank order) as one world-size-independent
    pytree: unit-indexed leaves are the replicated buffer or the shards in rank order, cut to the
    unit's real elements; everything else rank 0's."""
    plan = states[0].sharding.plan
    units = {u.name: u for u in plan.units}

    def by_unit(field):
        d = getattr(states[0], field)
        if d is None:
            return None
        return {name: _unit_tensor([getattr(s, field)[name] for s in states], units[name]) for name in d}

    paths, leaves, spec = optree.tree_flatten_with_path(states[0].opt_state, none_is_leaf=True)
    per_rank = [optree.tree_leaves(s.opt_state, none_is_leaf=True) for s in states]
    merged = []
    for i, (path, leaf) in enumerate(zip(paths, leaves)):
        unit = units.get(path[-1]) if path else None
        if unit is not None and isinstance(leaf, torch.Tensor) and leaf.numel() in (unit.padded_numel, unit.shard_numel):
            merged.append(_unit_tensor([r[i] for r in per_rank], unit))
        else:
            merged.append(leaf)
    s0 = states[0]
    return {
        "params": by_unit("params"),
        "master": by_unit("master"),
        "opt_state": optree.tree_unflatten(spec, merged),
        "frozen": _frozen_by_name(states),
        "buffers": dict(s0.buffers),
        "step": s0.step,
        "loss_scale": s0.loss_scale,
    }


def assert_reshard_roundtrip(
    model_factory: Callable[[], Any],
    cfg: Any,
    save_world: int,
    load_world: int,
    *,
    load_stage: int | None = None,
    loss_fn: Callable[..., Any] | None = None,
    batch: Any = None,
    steps: int = 1,
    dtype: Any = AUTO,
    seed: int = 0,
) -> None:
    """Assert that a state saved with `fnzero.checkpoint.save` by `save_world` simulated ranks at
    `cfg`'s stage loads with `fnzero.checkpoint.load` on `load_world` ranks at `load_stage`
    (default: the same stage) to the same consolidated state, bit for bit.

    With `loss_fn(apply, batch)` and a global `batch`, the saving side first trains `steps` steps,
    so the optimizer moments and step count are not trivially zero (recommended). The checkpoint
    goes to a temporary directory that is removed afterwards.
    """
    base = fnzero.load_config(cfg) if not isinstance(cfg, fnzero.Config) else cfg
    stage = base.zero_optimization.stage
    load_stage = stage if load_stage is None else load_stage
    mdtype = model_dtype(base, dtype)
    k = base.gradient_accumulation_steps
    micro = base.train_micro_batch_size_per_gpu
    if batch is not None:
        batch, _, rows = global_rows(cast_floats(batch, mdtype), save_world * k)
        micro = rows // (save_world * k)
    save_cfg = derive_config(base, stage, save_world, micro)
    load_cfg = derive_config(base, load_stage, load_world, micro)
    root = tempfile.mkdtemp(prefix="fnzero-reshard-")

    def saver(comm):
        sm, state = build(model_factory, save_cfg, comm, mdtype, seed)
        if loss_fn is not None and batch is not None:
            step = fnzero.train_step(step_loss(sm, loss_fn), save_cfg)
            mine = rank_slice(batch, comm.rank, save_world)
            for _ in range(steps):
                state, _ = step(state, mine)
        checkpoint.save(root, state, tag="roundtrip").wait()
        return state

    def loader(comm):
        _, like = build(model_factory, load_cfg, comm, mdtype, seed + 1)  # other weights: loading must replace them
        return checkpoint.load(root, like=like, restore_rng=False)[0]

    try:
        before = consolidate(simulated_world(save_world).run(saver))
        after = consolidate(simulated_world(load_world).run(loader))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    assert_trees_equal(
        after, before,
        what=f"checkpoint saved by {save_world} ranks at stage {stage} and loaded by {load_world} ranks at "
        f"stage {load_stage} differs from what was saved",
        root="state",
    )
