"""The phases of a training step, which the one ladder (`_ladder.py`) runs in this order, eagerly
(`_step.py`) or traced (`_whole_step.py`) (`specs/architecture.md` §How a batch flows):

    step_setup          the host's decisions before any tensor work (micro-batches, lr, ...)
    gradients           reduced by placement (`_grads.py`: hooks eagerly, torch.func in a graph)
    norm_and_loss       one all-reduce of two numbers
    step_verdict        the metrics, the fp16 overflow verdict and the next loss scale (host)
    clip_factor         unscale x clip, one factor
    optimizer_update    the optimizer, wherever its state is (`_update.py`)
    publish_params      the new parameters by placement (`_update.py`)
    next_state

Each is a small function of tensors, a unit's `Placement` and a `Collectives`: the eager step
passes the state's own collectives and Python numbers, the graph passes torch's traceable
functional collectives (`fnzero/sharding/comm/_functional.py`) and 0-dim tensors, so each rule is
written once and a fix in one is a fix in both (`specs/sharding.md` §Step).
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any

import optree
import torch

from .._errors import ShardingError
from .._state import TrainState
from ..sharding import Placement, ShardPlan, UnitPlan
from ..state import StepPolicy, update_loss_scale

__all__ = [
    "split_micro_batches", "micro_batch_rows", "accum_dtype_for", "predivisor", "prepare_for_comm", "reduce_whole", "norm_and_loss",
    "clip_coefficient", "clip_factor", "clip_norm", "unscale_factor", "loss_scale_after", "next_state", "Timer", "StepSetup", "step_setup", "step_verdict",
]

_HALF = (torch.float16, torch.bfloat16)


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


def unscale_factor(prediv: float, n: int, k: int, scale):
    """What the reduced gradients (sums over n ranks and k micro-batches of gradients of the loss
    times `scale`, each divided by `prediv`) are multiplied by to become the mean gradient; `scale`
    is a tensor in a graph, so a new loss scale does not recompile."""
    return prediv / (n * k * scale)


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


def step_verdict(state: TrainState, setup: StepSetup, policy: StepPolicy, norm_sq: float, loss_total: float,
                 auxes: list, has_aux: bool) -> tuple[dict[str, Any], Any]:
    """(metrics, next loss scale) from the two numbers every rank agreed on. `metrics["skipped"]`
    is the fp16 overflow verdict (a non-finite norm on any rank): the step is then not applied.
    Without loss scaling a non-finite norm raises (`loss_scale_after`)."""
    overflow = not math.isfinite(norm_sq)
    metrics: dict[str, Any] = {
        "loss": loss_total / (setup.k * setup.n),
        "lr": setup.lr,
        "grad_norm": math.sqrt(norm_sq) if not overflow else float("inf"),
        "loss_scale": setup.scale if state.loss_scale is not None else None,
        "skipped": overflow,
    }
    if has_aux:
        metrics["aux"] = auxes if setup.k > 1 else auxes[0]
    return metrics, loss_scale_after(state, policy, overflow, setup.step_no, state.sharding.comm.rank)


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
    return torch.float32 if param_dtype in _HALF else param_dtype


def predivisor(policy: StepPolicy, plan: ShardPlan, n: int, param_dtype: torch.dtype, accum_dtype: torch.dtype) -> float:
    """What gradients are divided by before they are summed across ranks. 16-bit sums over N ranks
    can overflow where each addend does not, so 16-bit wires carry g/N (sharded parameters divide
    in `GatherUnit.backward` by the same rule); otherwise `gradient_predivide_factor` with
    `prescale_gradients`, else nothing."""
    grads_sharded = plan.placement.grads  # reduced per micro-batch in the compute dtype
    wire = policy.comm_dtype or (param_dtype if grads_sharded else accum_dtype)
    if n > 1 and (wire in _HALF or (grads_sharded and param_dtype in _HALF)):
        return float(n)
    if policy.prescale_gradients:
        return policy.predivide_factor
    return 1.0


def prepare_for_comm(g: torch.Tensor, policy: StepPolicy, prediv: float = 1.0) -> torch.Tensor:
    """The gradient as it goes on the wire: communication dtype, divided by the predivisor."""
    cd = policy.comm_dtype
    if cd is not None and g.dtype != cd:
        g = g.to(cd)
    if prediv != 1.0:
        g = g / prediv
    return g


def reduce_whole(comm, g: torch.Tensor, placement: Placement) -> torch.Tensor:
    """A whole-unit gradient summed across ranks: all of it where the optimizer state is
    replicated, this rank's shard where it is sharded."""
    return comm.reduce_scatter(g) if placement.optimizer else comm.all_reduce(g)


def norm_and_loss(units: tuple[UnitPlan, ...], grads: dict[str, torch.Tensor], inv, loss_sum: torch.Tensor,
                  mesh, device: torch.device, local: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(global squared gradient norm, loss summed over ranks) over the state's `mesh` (a
    `StateMesh`): `_norm_and_loss` on this rank's units over its data axis, then, with a pipeline
    axis, summed over the stages (each holds other layers; only the last has a loss): one more
    all-reduce of two numbers. Expert units are replicated over the expert-data-parallel ranks
    (`mesh.expert_data`). MiCS's replicas hold the same reduced shards as the other shard groups,
    so the norm is whole within the data axis and only the loss is summed over them, one more
    all-reduce of one number.
    `local`: the gradients are each rank's own (not reduced); the norm is then the mean of the
    ranks' norms, DeepSpeed's fp32 `clip_grad_norm_` (which all-reduces each rank's norm / ranks),
    and every rank agrees on it (the overflow verdict with it: non-finite where any rank's is)."""
    norm_sq, loss = _norm_and_loss(units, grads, inv, loss_sum, mesh.data, device, mesh.tp, mesh.expert_data, local)
    replicas = mesh.replicas
    if replicas is not None and replicas.world_size > 1:
        loss = replicas.all_reduce(loss.reshape(1))[0]
    pp = mesh.pp.comm if mesh.pp is not None else None
    if pp is None or pp.world_size == 1:
        return norm_sq, loss
    both = pp.all_reduce(torch.stack([norm_sq, loss]))
    return both[0], both[1]


def _norm_and_loss(units: tuple[UnitPlan, ...], grads: dict[str, torch.Tensor], inv, loss_sum: torch.Tensor,
                   comm, device: torch.device, tp=None, expert_comm=None,
                   local: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(global squared gradient norm, loss summed over ranks) as float64 tensors, from one
    all-reduce of two numbers (three with tensor parallelism). `inv` unscales the reduced gradients. Shards' squares are summed
    across ranks; a replicated gradient's is global already and is added after the sum. With
    tensor parallelism (`tp`, a TPLayout), the squares of split parameters are summed over the
    tensor-parallel ranks too (one more all-reduce of one number); replicated ones, equal there,
    count once. An expert unit differs across the ep ranks, so its squares are summed over the dp
    ranks like a shard's; held whole (optimizer state replicated) it is the same on its
    expert-data-parallel ranks, so each of them adds its share, 1 / their number."""
    dtypes = {g.dtype for g in grads.values()}
    norm_dtype = torch.float64 if torch.float64 in dtypes else torch.float32
    # [sharded over dp, replicated over dp] x [replicated over tp, split over tp]
    sq = [[torch.zeros((), dtype=norm_dtype, device=device) for _ in range(2)] for _ in range(2)]
    for u in units:
        g = grads[u.name]
        if not g.numel():
            continue
        lo = u.shard_range(comm.rank)[0] if u.placement.optimizer else 0
        summed = local or u.placement.optimizer or u.is_expert  # differs across the dp ranks: summed over them
        share = 1.0 if u.placement.optimizer or not u.is_expert else 1.0 / expert_comm.world_size
        for part, split in _tp_parts(u, g, lo, tp):
            sq[0 if summed else 1][int(split)] += torch.linalg.vector_norm(part, dtype=norm_dtype).square() * share
    ii = inv * inv
    loss = loss_sum.to(device=device, dtype=torch.float64)
    if local:  # two numbers: [this rank's norm / ranks, loss], summed to the mean of the ranks' norms
        own = (sq[0][0] + sq[0][1]).to(torch.float64) * ii
        vec = torch.stack([own.sqrt() / comm.world_size, loss])
        vec = comm.all_reduce(vec) if comm.world_size > 1 else vec
        return vec[0].square(), vec[1]
    if tp is None:  # two numbers: [Σ shards' squares, loss]
        vec = torch.stack([sq[0][0].to(torch.float64) * ii, loss])
        vec = comm.all_reduce(vec) if comm.world_size > 1 else vec
        return vec[0] + sq[1][0].to(torch.float64) * ii, vec[1]
    vec = torch.stack([sq[0][0].to(torch.float64) * ii, sq[0][1].to(torch.float64) * ii, loss])
    vec = comm.all_reduce(vec) if comm.world_size > 1 else vec
    split_sq = vec[1] + sq[1][1].to(torch.float64) * ii
    if tp.size > 1:
        split_sq = tp.comm.all_reduce(split_sq.reshape(1))[0]
    return vec[0] + sq[1][0].to(torch.float64) * ii + split_sq, vec[2]


def _tp_parts(u: UnitPlan, g: torch.Tensor, lo: int, tp):
    """(piece of `g`, split over tp?) for the slots of unit `u` that `g` (elements `[lo, lo +
    len(g))` of the unit's buffer) covers; the whole of `g` when there is no tensor parallelism."""
    if tp is None or not tp.splits:
        yield g, False
        return
    hi = lo + g.numel()
    for slot in u.slots:
        a, b = max(lo, slot.offset), min(hi, slot.offset + slot.numel)
        if a < b:
            split = tp.split_of(slot.name, *slot.aliases) is not None
            yield g[a - lo: b - lo], split


def _local_norm(grads: dict[str, torch.Tensor], inv: float) -> float:
    """The norm of this rank's own (un-reduced, whole-unit) gradients times `inv`, with no
    communication."""
    sq = sum(float(torch.linalg.vector_norm(g, dtype=torch.float64).square()) for g in grads.values())
    return math.sqrt(sq) * inv


def clip_norm(setup: StepSetup, clip: float, grads: dict[str, torch.Tensor], inv: float, grad_norm: float) -> float:
    """The norm `gradient_clipping` divides by: the step's `grad_norm`, except where each rank
    holds its own gradients (`Optimizer.local_gradients`) in fp16/bf16, which DeepSpeed's FP16
    optimizers clip by the rank's own norm (its fp32 engine by the mean of the ranks' norms, which
    `grad_norm` is then: `norm_and_loss`), `specs/optim.md` §1-bit optimizers."""
    if clip > 0 and setup.local and setup.param_dtype in _HALF:
        return _local_norm(grads, inv)
    return grad_norm


def clip_coefficient(clip: float, grad_norm):
    """What the gradients are multiplied by for `gradient_clipping` (as
    `torch.nn.utils.clip_grad_norm_`): `clip / (norm + 1e-6)` when below 1, else 1; a float for a
    float norm, a tensor for a tensor norm (inside a graph)."""
    if clip <= 0:
        return 1.0
    coef = clip / (grad_norm + 1e-6)
    return torch.clamp(coef, max=1.0) if isinstance(coef, torch.Tensor) else min(coef, 1.0)


def clip_factor(clip: float, grad_norm, unscale):
    """(what the reduced gradients are multiplied by before the optimizer, the norm of the result):
    one factor for unscaling and `gradient_clipping`; floats eagerly, tensors in a graph."""
    coef = clip_coefficient(clip, grad_norm)
    return unscale * coef, grad_norm * coef


def loss_scale_after(state: TrainState, policy: StepPolicy, overflow: bool, step_no: int, rank: int):
    """The next loss-scale state (None without fp16 scaling). A non-finite gradient norm without
    loss scaling cannot be skipped silently: it raises."""
    if state.loss_scale is None:
        if overflow:
            raise ShardingError(
                f"non-finite gradient norm at step {step_no} (rank {rank}) without fp16 loss scaling; "
                "the loss or the model produced inf/NaN"
            )
        return None
    return update_loss_scale(state.loss_scale, overflow, policy.loss_scale)


def next_state(state: TrainState, params, master, opt_state, loss_scale) -> TrainState:
    """The state after an applied step: new parameters, master and optimizer state, the step
    count advanced, the next loss scale."""
    return state.replace(params=params, master=master, opt_state=opt_state,
                         step=torch.tensor(int(state.step) + 1, dtype=torch.int64), loss_scale=loss_scale)


class Timer:
    """Wall-clock seconds per phase (`wall_clock_breakdown`); a no-op when off. On accelerators it
    synchronizes the device at phase boundaries, which is why it is opt-in."""

    def __init__(self, on: bool, device: torch.device):
        self.on = on
        self.sync = on and device.type == "cuda"
        self.totals = {"forward": 0.0, "backward": 0.0, "comm": 0.0, "optimizer": 0.0}
        self._t = 0.0

    def start(self) -> None:
        if self.on:
            if self.sync:
                torch.cuda.synchronize()
            self._t = time.perf_counter()

    def stop(self, phase: str) -> None:
        if self.on:
            if self.sync:
                torch.cuda.synchronize()
            self.totals[phase] += time.perf_counter() - self._t
