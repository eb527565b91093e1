"""The host's decisions before a step's tensor work, the first rung of the ladder (`_step.py`):
the micro-batches (checked), the schedule's lr and momentum, the loss scale, the gradient dtypes
and what gradients are divided by before ranks sum them (`specs/sharding.md` §Step)."""

from __future__ import annotations

import dataclasses
from typing import Any

import optree
import torch

from .._errors import ShardingError
from .._state import TrainState
from ..sharding import ShardPlan
from ..state import StepPolicy

__all__ = ["StepSetup", "step_setup", "split_micro_batches", "micro_batch_rows", "accum_dtype_for", "predivisor"]

HALF_DTYPES = (torch.float16, torch.bfloat16)


@dataclasses.dataclass(frozen=True)
class StepSetup:
    """What the host decides before a step's tensor work, for the eager step and the graph alike."""

    micro: list  # the micro-batches
    step_no: int  # applied steps before this one
    scale: float  # the fp16 loss scale, 1.0 without loss scaling
    lr: float | None  # the schedule's; None: the optimizer keeps its own
    momentum: float | None  # OneCycle's beta1/momentum; None: the optimizer's own
    param_dtype: torch.dtype
    accum_dtype: torch.dtype
    prediv: float  # what gradients are divided by before they are summed across ranks
    n: int  # data-parallel ranks
    k: int  # micro-batches
    local: bool = False  # the optimizer takes this rank's own gradients (`Optimizer.local_gradients`)


def step_setup(state: TrainState, batch: Any, policy: StepPolicy, sched, opt=None) -> StepSetup:
    """The micro-batches (checked), the schedule's lr and momentum for this step (None where the
    optimizer keeps its own: no schedule), the loss scale and the gradient dtypes, and whether the
    optimizer `opt` asks for this rank's own gradients this step (then nothing divides them for
    a wire: they stay local)."""
    sh = state.sharding
    plan, n, k = sh.plan, sh.dp_size, policy.accumulation_steps
    micro = split_micro_batches(batch, k, micro_batch_rows(policy, n))
    step_no = int(state.step)
    param_dtype = next(iter(state.params.values())).dtype if state.params else plan.param_dtype
    accum_dtype = accum_dtype_for(policy, param_dtype)
    has_momentum = sched is not None and sched.momentum is not None
    local = opt is not None and opt.exchanges_gradients and bool(opt.local_gradients(state.opt_state))
    return StepSetup(
        micro=micro, step_no=step_no,
        scale=float(state.loss_scale.scale) if state.loss_scale is not None else 1.0,
        lr=float(sched(step_no)) if sched is not None else None,
        momentum=float(sched.momentum(step_no)) if has_momentum else None,
        param_dtype=param_dtype, accum_dtype=accum_dtype,
        prediv=1.0 if local else predivisor(policy, plan, n, param_dtype, accum_dtype), n=n, k=k, local=local,
    )


def split_micro_batches(batch: Any, k: int, rows: int | None = None) -> list[Any]:
    """`k` micro-batches: a list of length k is taken as given; otherwise every tensor leaf of the
    pytree is split into k equal parts along dim 0 (other leaves are shared).

    Checked first, so a wrong batch never trains: not empty (some tensor leaf has rows); when the
    batch is split (k > 1), every tensor leaf with a dim 0 the same length; and, when the leaves
    agree on a length, `rows` per micro-batch (the config's train_micro_batch_size_per_gpu): a
    4-row batch at micro 4 x gas 2 is refused, not trained as two micro-batches of 2. (Leaves of
    different lengths in an unsplit micro-batch are the model's business: images per sample,
    packed sequences' offsets.)"""
    if isinstance(batch, list):
        if len(batch) != k:
            raise ShardingError(
                f"a list batch is read as micro-batches: got {len(batch)}, gradient_accumulation_steps is {k}"
            )
        for i, part in enumerate(batch):
            _check_rows(part, rows, f"micro-batch {i} of the list")
        return batch
    _check_rows(batch, None if rows is None else rows * k, "the batch", k, same_length=k > 1)
    if k == 1:
        return [batch]
    leaves, spec = optree.tree_flatten(batch)
    parts = []
    for path, leaf in zip(optree.tree_paths(batch), leaves):
        if isinstance(leaf, torch.Tensor) and leaf.dim() > 0:
            if leaf.shape[0] % k:
                raise ShardingError(
                    f"batch leaf {_leaf_name(path)} has {leaf.shape[0]} rows, which do not split "
                    f"into gradient_accumulation_steps={k} equal micro-batches"
                )
            parts.append(leaf.split(leaf.shape[0] // k))
        else:
            parts.append([leaf] * k)
    return [optree.tree_unflatten(spec, [p[i] for p in parts]) for i in range(k)]


def micro_batch_rows(policy: StepPolicy, world_size: int) -> int | None:
    """The rows a micro-batch must have: the config's micro-batch size, when the config's batch
    triad was resolved for this world (a config loaded for another world size may have derived
    its micro-batch from train_batch_size for that world, so it is not held against the batch)."""
    if policy.config_world not in (None, world_size):
        return None
    return policy.micro_batch


def _leaf_name(path: tuple) -> str:
    return ".".join(map(str, path)) or "<root>"


def _check_rows(batch: Any, expected: int | None, what: str, k: int = 1, same_length: bool = False) -> None:
    """Some tensor leaf has rows; with `same_length`, all tensor leaves with a dim 0 have the same
    count; where they agree, it equals `expected` when given. A batch without tensor leaves (the
    loss function makes its own data) passes."""
    rows = {}
    for path, leaf in zip(optree.tree_paths(batch), optree.tree_leaves(batch)):
        if isinstance(leaf, torch.Tensor) and leaf.dim() > 0:
            rows.setdefault(leaf.shape[0], _leaf_name(path))
    if not rows:
        return
    if max(rows) == 0:
        raise ShardingError(f"{what} is empty (0 rows): nothing to train on, and the step would still count")
    if len(rows) > 1:
        if same_length:
            seen = ", ".join(f"{name}: {n}" for n, name in rows.items())
            raise ShardingError(f"{what} has leaves of different lengths along dim 0 ({seen}); it is split into "
                                f"gradient_accumulation_steps={k} micro-batches along dim 0, so every tensor leaf "
                                "must have the same number of rows (or pass a list of micro-batches)")
        return
    (n, _name), = rows.items()
    if expected is not None and n != expected:
        how = f"train_micro_batch_size_per_gpu ({expected // k}) x gradient_accumulation_steps ({k})" if k > 1 else (
            f"train_micro_batch_size_per_gpu ({expected})")
        raise ShardingError(f"{what} has {n} rows; the config asks for {how} = {expected} rows per rank and step "
                            "(a short last batch of an epoch? drop it, e.g. DataLoader(drop_last=True))")


def accum_dtype_for(policy: StepPolicy, param_dtype: torch.dtype) -> torch.dtype:
    """The gradient-accumulation dtype: the policy's, else fp32 for 16-bit training, else the
    parameters' own."""
    if policy.accum_dtype is not None:
        return policy.accum_dtype
    return torch.float32 if param_dtype in HALF_DTYPES else param_dtype


def predivisor(policy: StepPolicy, plan: ShardPlan, n: int, param_dtype: torch.dtype, accum_dtype: torch.dtype) -> float:
    """What gradients are divided by before they are summed across ranks. 16-bit sums over N ranks
    can overflow where each addend does not, so 16-bit wires carry g/N (sharded parameters divide
    in `GatherUnit.backward` by the same rule); otherwise `gradient_predivide_factor` with
    `prescale_gradients`, else nothing."""
    grads_sharded = plan.placement.grads  # reduced per micro-batch in the compute dtype
    wire = policy.comm_dtype or (param_dtype if grads_sharded else accum_dtype)
    if n > 1 and (wire in HALF_DTYPES or (grads_sharded and param_dtype in HALF_DTYPES)):
        return float(n)
    if policy.prescale_gradients:
        return policy.predivide_factor
    return 1.0


