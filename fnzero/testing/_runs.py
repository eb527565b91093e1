"""Running a user's model through fnzero the way the assertions need: the loss convention
(`specs/testing.md` §Loss), configs re-derived for a world size, global batches split into
per-rank slices, one sharded run."""

from __future__ import annotations

import functools
from typing import Any, Callable

import optree
import torch

import fnzero

from ._context import seeded

__all__ = ["step_loss", "derive_config", "precision_of", "model_dtype", "global_rows", "rank_slice", "build", "AUTO"]

AUTO = "auto"


def step_loss(sm: fnzero.ShardedModule, loss: Callable[..., Any]) -> Callable[[dict, Any], Any]:
    """`loss(apply, batch)` as the `loss_fn(params, batch)` that `fnzero.train_step` takes:
    `apply` runs `sm.apply(params, ...)`."""

    def loss_fn(params, batch):
        return loss(functools.partial(sm.apply, params), batch)

    return loss_fn


def precision_of(cfg: fnzero.Config) -> str:
    return "fp16" if cfg.fp16.enabled else "bf16" if cfg.bf16.enabled else "fp32"


def model_dtype(cfg: fnzero.Config, dtype: Any) -> torch.dtype | None:
    """"auto": float64 for fp32 training (reduction order then costs ~1e-16, so tight tolerances
    test the sharding and not rounding), float32 for 16-bit training (fp32 master weights)."""
    if dtype == AUTO:
        return torch.float64 if precision_of(cfg) == "fp32" else torch.float32
    return dtype


def derive_config(cfg: Any, stage: int | None, world: int, micro: int, accumulation: int | None = None) -> fnzero.Config:
    """`cfg` at another stage and world size, with `micro` rows per micro-batch (and, when given,
    `accumulation` micro-batches per step; the batch triad is re-derived: train_batch_size =
    micro x accumulation x world)."""
    base = fnzero.load_config(cfg) if not isinstance(cfg, fnzero.Config) else cfg
    d = base.to_dict()
    d.pop("train_batch_size", None)
    d["train_micro_batch_size_per_gpu"] = micro
    if accumulation is not None:
        d["gradient_accumulation_steps"] = accumulation
    if stage is not None:
        d["zero_optimization"]["stage"] = stage
    return fnzero.load_config(d, world_size=world)


def _row_leaves(batch: Any) -> list[tuple[str, torch.Tensor]]:
    from ._trees import leaf_paths

    paths, leaves, _ = leaf_paths(batch, "batch")
    return [(p, x) for p, x in zip(paths, leaves) if isinstance(x, torch.Tensor) and x.dim() > 0]


def global_rows(batch: Any, multiple: int) -> tuple[Any, int, int]:
    """`(batch', given_rows, rows)`: the batch extended cyclically (row i is row i mod given) to
    the smallest multiple of `multiple` rows that is at least the given count. Non-tensor and
    0-dim leaves are shared by every row."""
    leaves = _row_leaves(batch)
    if not leaves:
        raise ValueError("the batch has no tensor with a row dimension to split across ranks")
    counts = {p: x.shape[0] for p, x in leaves}
    if len(set(counts.values())) != 1:
        raise ValueError(f"batch leaves disagree on the row count (dim 0): {counts}")
    given = next(iter(counts.values()))
    if given == 0:
        raise ValueError("the batch has 0 rows")
    rows = -(-given // multiple) * multiple
    if rows == given:
        return batch, given, rows
    idx = torch.arange(rows) % given
    return optree.tree_map(
        lambda x: x[idx] if isinstance(x, torch.Tensor) and x.dim() > 0 else x, batch, none_is_leaf=True
    ), given, rows


def rank_slice(batch: Any, rank: int, world: int) -> Any:
    """Rank `rank`'s contiguous 1/world of every row-indexed leaf."""

    def cut(x):
        if isinstance(x, torch.Tensor) and x.dim() > 0:
            n = x.shape[0] // world
            return x[rank * n : (rank + 1) * n]
        return x

    return optree.tree_map(cut, batch, none_is_leaf=True)


def cast_floats(batch: Any, dtype: torch.dtype | None) -> Any:
    if dtype is None:
        return batch
    return optree.tree_map(
        lambda x: x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x, batch, none_is_leaf=True
    )


def build(model_factory: Callable[[], torch.nn.Module], cfg: fnzero.Config, comm: Any, dtype: torch.dtype | None, seed: int):
    """`(sm, state)`: the factory's model built under `seeded(seed)` (identical on every rank and
    thread), converted to `dtype`, sharded over `comm`."""
    with seeded(seed):
        model = model_factory()
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"the model factory must return a torch.nn.Module, got {type(model).__name__}")
    if dtype is not None:
        model = model.to(dtype)
    sm = fnzero.shard(model, config=cfg, comm=comm)
    # Every rank has built its model before any trains: activation checkpointing forks and
    # restores torch's global generator during backward, which would reseed a simulated rank
    # (a thread) still building.
    sm.comm.barrier()
    return sm, sm.init_state()
