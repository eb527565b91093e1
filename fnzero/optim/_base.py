"""`Optimizer`, the record of how an optimizer's chain runs (specs/optim.md §The implementation
record), and the pytree plumbing every update rule shares."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

import optree
import torch

__all__ = ["Optimizer", "Params", "OptState"]

Params = Any  # a pytree (optree) of tensors
OptState = Any  # a pytree whose tensors mirror Params, plus a step count

UpdateFn = Callable[..., tuple[Params, OptState]]


class Optimizer(NamedTuple):
    """One implementation of an optimizer: how its chain runs (specs/optim.md §The implementation record).

    Attributes:
      init: ``init(params) -> opt_state``; pure.
      update: ``update(grads, opt_state, params, lr=None, *, momentum=None, **extras) -> (params,
        opt_state)``; pure. ``lr=None``: the factory's; ``momentum`` replaces beta1 (or SGD's
        momentum) for this step; ``extras``: numbers a shard cannot compute alone (``global_norm``).
      update_: the same step, allowed to write into the ``params`` and ``opt_state`` it is given
        (the one named buffer reuse); ``grads`` are never written.
      elementwise: each element's update depends on that element alone, so flat shards may be
        updated on their own (False for Lamb's per-tensor trust ratio).
      graph_update: ``update`` in plain tensor ops (``lr``, ``momentum`` may be 0-dim tensors), for
        the whole-step graph, or None.
      transform: the chain it runs (`as_optimizer`), or None (the fused implementations).
      local_gradients: None, or for an optimizer that exchanges what it needs itself (the 1-bit ones)
        ``local_gradients(opt_state) -> bool``: whether the next step hands it this rank's own
        gradients (specs/optim.md §1-bit optimizers).
    """

    init: Callable[[Params], OptState]
    update: UpdateFn
    update_: UpdateFn
    elementwise: bool
    graph_update: UpdateFn | None = None
    transform: Any = None
    local_gradients: Callable[[OptState], bool] | None = None

    @property
    def traceable(self) -> bool:
        """It can run inside the whole-step graph (it has a `graph_update`)."""
        return self.graph_update is not None

    @property
    def exchanges_gradients(self) -> bool:
        """It exchanges what it needs itself (the 1-bit optimizers): the step may hand it this
        rank's own gradients (`local_gradients`) and gives it the compressed all-reduce."""
        return self.local_gradients is not None


def pure(update_: UpdateFn) -> UpdateFn:
    """Make the pure `update` from `update_` by running it on private copies (one extra pass, paid
    for purity: callers keep the old state alive without copies of their own)."""

    def update(grads: Params, opt_state: OptState, params: Params, lr: float | None = None, *,
               momentum: float | None = None, **extras):
        with torch.no_grad():
            params = optree.tree_map(torch.clone, params)
            opt_state = optree.tree_map(torch.clone, opt_state)
        return update_(grads, opt_state, params, lr, momentum=momentum, **extras)

    update.__doc__ = update_.__doc__
    return update


def leaves_like(treedef: optree.PyTreeSpec, tree: Params, what: str) -> list[torch.Tensor]:
    """The leaves of `tree`, which must have the params' structure (checked: a mismatch would
    otherwise pair the wrong tensors silently)."""
    leaves, spec = optree.tree_flatten(tree)
    if spec != treedef:
        raise ValueError(f"{what} has tree structure {spec}, but params have {treedef}")
    return leaves


def state_leaves(opt_state: OptState, treedef: optree.PyTreeSpec, *fields: str) -> list[list[torch.Tensor]]:
    """The leaves of each of the state's `fields`, checked against the params' structure."""
    return [leaves_like(treedef, getattr(opt_state, f), f"opt_state.{f}") for f in fields]


def flat_args(grads: Params, opt_state: OptState, params: Params, *fields: str, cast: bool = True) -> tuple:
    """An update's operands as leaf lists, each tree checked against the params': (treedef, params,
    grads, then the leaves of each state field in `fields`); `cast`: the grads in the params' dtypes."""
    p, treedef = optree.tree_flatten(params)
    g = leaves_like(treedef, grads, "grads")
    return (treedef, p, grads_as(g, p) if cast else g, *state_leaves(opt_state, treedef, *fields))


def grads_as(grads: list[torch.Tensor], params: list[torch.Tensor]) -> list[torch.Tensor]:
    """Gradients in the params' dtype (e.g. bf16 grads for fp32 master weights); no copy when
    they already match, which is the common case."""
    out = grads
    for i, (g, p) in enumerate(zip(grads, params)):
        if g.shape != p.shape:
            raise ValueError(f"grad leaf {i} has shape {tuple(g.shape)}, its param {tuple(p.shape)}")
        if g.dtype != p.dtype or g.device != p.device:
            if out is grads:
                out = list(grads)
            out[i] = g.to(device=p.device, dtype=p.dtype)
    return out


def groups(*lists: Sequence[torch.Tensor]) -> Iterator[tuple[list[torch.Tensor], ...]]:
    """Split parallel tensor lists by (device, dtype) of the first list, as the multi-tensor kernels
    want; the usual single group is yielded in the input order."""
    first = lists[0]
    if not first:
        return
    key0 = (first[0].device, first[0].dtype)
    if all((t.device, t.dtype) == key0 for t in first):
        yield tuple(list(lst) for lst in lists)
        return
    buckets: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, t in enumerate(first):
        buckets.setdefault((t.device, t.dtype), []).append(i)
    for idx in buckets.values():
        yield tuple([lst[i] for i in idx] for lst in lists)


def scalars_as(like: torch.Tensor, *xs):
    """Tensor scalars (a `graph_update`'s lr, bias corrections...) in `like`'s dtype: two 0-dim
    tensors promote to the wider dtype, which would turn a 0-dim float32 parameter into float64."""
    return tuple(x.to(like.dtype) if isinstance(x, torch.Tensor) else x for x in xs)


def traced_count(count: torch.Tensor, like: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """For a `graph_update`: (the advanced count, this step's 1-based number as a float64 0-dim
    tensor on the device of `like`'s first tensor), both tensor ops, so a graph takes the count
    as an input and does not specialise on its value."""
    new = count + 1
    device = like[0].device if like else count.device
    return new, new.to(device=device, dtype=torch.float64)


def zeros_like(params: Params) -> Params:
    """A tree of zeros shaped and typed like `params`: a moment's initial value."""
    with torch.no_grad():
        return optree.tree_map(torch.zeros_like, params)


def zeros_count() -> torch.Tensor:
    """The step counter: a 0-dim int64 CPU tensor, so `update_` can advance it in place and
    reading it never waits on an accelerator."""
    return torch.zeros((), dtype=torch.int64)


def advance(count: torch.Tensor) -> int:
    """Count this step in place and return its 1-based number t (bias corrections use t)."""
    count.add_(1)
    return int(count)
