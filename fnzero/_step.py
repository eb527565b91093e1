"""`fnzero.train_step`: the pure training step `(state, batch) -> (state, metrics)`.

One mechanism serves every placement (`specs/sharding.md`, `specs/collectives.md`); each unit's
`Placement` says what of it is sharded, and the step reads nothing else:

* The loss is differentiated with respect to fresh aliases of `state.params` (one flat buffer or
  shard per unit), so the input state is never touched.
* A post-accumulate-grad hook on each alias moves the unit's gradient into this step's accumulator
  as soon as backward produces it: with gradients sharded it is reduce-scattered there, so only one
  unit's full gradient exists at a time; with parameters sharded `_GatherUnit`'s backward already
  reduced it to a shard.
* After the last micro-batch, whole-unit gradients are reduced: all-reduced where the optimizer
  state is replicated, reduce-scattered where it is sharded. One scalar all-reduce gives the global
  gradient norm, the fp16 overflow verdict (a non-finite norm on any rank) and the mean loss.
* The optimizer updates this rank's master slice; units whose optimizer state is sharded but
  parameters are not all-gather the new parameters.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import time
from typing import Any, Callable

import optree
import torch

from . import optim as _optim
from . import schedules as _schedules
from ._errors import ShardingError
from ._loss_scale import update_loss_scale
from ._policy import StepPolicy, step_policy
from ._shard._collectives import start_all_gather_into, start_all_reduce, start_reduce_scatter
from ._shard._module import optimizer_view
from ._shard._plan import ShardPlan, UnitPlan
from ._shard._runtime import STEP_RUNS, unit_views
from ._state import TrainState
from .memory import _trim_heap

__all__ = ["TrainStep", "train_step", "split_micro_batches"]


def split_micro_batches(batch: Any, k: int) -> list[Any]:
    """`k` micro-batches: a list of length k is taken as given; otherwise every tensor leaf of the
    pytree is split into k equal parts along dim 0 (other leaves are shared)."""
    if isinstance(batch, list):
        if len(batch) != k:
            raise ShardingError(
                f"a list batch is read as micro-batches: got {len(batch)}, gradient_accumulation_steps is {k}"
            )
        return batch
    if k == 1:
        return [batch]
    leaves, spec = optree.tree_flatten(batch)
    parts = []
    for path, leaf in zip(optree.tree_paths(batch), leaves):
        if isinstance(leaf, torch.Tensor) and leaf.dim() > 0:
            if leaf.shape[0] % k:
                raise ShardingError(
                    f"batch leaf {'.'.join(map(str, path)) or '<root>'} has {leaf.shape[0]} rows, which do not split "
                    f"into gradient_accumulation_steps={k} equal micro-batches"
                )
            parts.append(leaf.split(leaf.shape[0] // k))
        else:
            parts.append([leaf] * k)
    return [optree.tree_unflatten(spec, [p[i] for p in parts]) for i in range(k)]


def _accum_dtype(policy: StepPolicy, param_dtype: torch.dtype) -> torch.dtype:
    if policy.accum_dtype is not None:
        return policy.accum_dtype
    return torch.float32 if param_dtype in (torch.float16, torch.bfloat16) else param_dtype


class _Timer:
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


_HALF = (torch.float16, torch.bfloat16)


def _predivisor(policy: StepPolicy, plan: ShardPlan, n: int, param_dtype: torch.dtype, accum_dtype: torch.dtype) -> float:
    """What gradients are divided by before they are summed across ranks. 16-bit sums over N ranks
    can overflow where each addend does not, so 16-bit wires carry g/N (stage-3 shards divide in
    `_GatherUnit.backward` by the same rule); otherwise `gradient_predivide_factor` with
    `prescale_gradients`, else nothing."""
    grads_sharded = plan.placement.grads  # reduced per micro-batch in the compute dtype
    wire = policy.comm_dtype or (param_dtype if grads_sharded else accum_dtype)
    if n > 1 and (wire in _HALF or (grads_sharded and param_dtype in _HALF)):
        return float(n)
    if policy.prescale_gradients:
        return policy.predivide_factor
    return 1.0


def _prepare_for_comm(g: torch.Tensor, policy: StepPolicy, prediv: float = 1.0) -> torch.Tensor:
    """The gradient as it goes on the wire: communication dtype, divided by the predivisor."""
    cd = policy.comm_dtype
    if cd is not None and g.dtype != cd:
        g = g.to(cd)
    if prediv != 1.0:
        g = g / prediv
    return g


def _grad_shape_numel(u: UnitPlan, reduced: bool) -> int:
    """A unit's gradient: a shard once reduced where the optimizer state is sharded (from the
    start where parameters are), else the whole padded unit."""
    if u.placement.params or (reduced and u.placement.optimizer):
        return u.shard_numel
    return u.padded_numel


def _reduce_whole(comm, g: torch.Tensor, placement) -> torch.Tensor:
    """A whole-unit gradient summed across ranks: all of it where the optimizer state is
    replicated, this rank's shard where it is sharded."""
    return comm.reduce_scatter(g) if placement.optimizer else comm.all_reduce(g)


def train_step(
    loss_fn: Callable[..., Any],
    config: Any,
    *,
    donate: bool = False,
    has_aux: bool = False,
) -> "TrainStep":
    """Build the pure step `(state, batch) -> (new_state, metrics)` for `loss_fn(params, batch)`.

    `loss_fn` returns the mean loss of one micro-batch (or `(loss, aux)` with `has_aux=True`); it
    receives the parameters as `state.params`-shaped aliases and runs the model with
    `sm.apply(params, ...)`. `batch` is this rank's data for one optimizer step: a list of
    `gradient_accumulation_steps` micro-batches, or one pytree split along dim 0.

    Metrics: `loss` (mean over micro-batches and ranks), `lr`, `grad_norm` (global, before
    clipping), `loss_scale`, `skipped` (fp16 overflow), and `aux` when `has_aux`.

    `donate=True` lets the step write into the input state's buffers (like JAX's donate_argnums):
    no second copy of the model state is allocated, and the input state must not be used again.
    """
    return TrainStep(loss_fn, config, donate=donate, has_aux=has_aux)


class TrainStep:
    """The pure step built by `train_step`; call it as `step(state, batch)`.

    Its parts are plain attributes (`loss_fn`, `config`, `donate`, `has_aux`) so transforms such as
    `fnzero.jit` can rebuild it around a different loss function.
    """

    def __init__(self, loss_fn: Callable[..., Any], config: Any, *, donate: bool = False, has_aux: bool = False):
        self.loss_fn = loss_fn
        self.config = config
        self.donate = donate
        self.has_aux = has_aux
        self.policy = step_policy(config)
        self.opt = _optim.from_config(config)
        self.sched = _schedules.from_config(config)
        self.host_opt = None
        if self.policy.offload_optimizer is not None:
            from ._offload._cpu import host_optimizer_from_config

            self.host_opt = host_optimizer_from_config(config)

    def with_loss_fn(self, loss_fn: Callable[..., Any]) -> "TrainStep":
        """The same step (config, optimizer, schedule) around another loss function."""
        new = copy.copy(self)
        new.loss_fn = loss_fn
        return new

    def __call__(self, state: TrainState, batch: Any) -> tuple[TrainState, dict[str, Any]]:
        if not isinstance(state, TrainState):
            raise ShardingError(f"train_step expects a fnzero.TrainState, got {type(state).__name__}")
        if (state.loss_scale is None) != (self.policy.loss_scale is None):
            raise ShardingError(
                "the state's loss scaling does not match this step's config (fp16 on one side only); "
                "build both from the same config"
            )
        with torch.enable_grad():
            return _step(state, batch, self.loss_fn, self.policy, self.opt, self.sched, self.donate, self.has_aux,
                         self.host_opt)


def _step(state: TrainState, batch, loss_fn, policy: StepPolicy, opt, sched, donate: bool, has_aux: bool, host_opt=None):
    sh = state.sharding
    plan, comm = sh.plan, sh.comm
    n, rank = comm.world_size, comm.rank
    k = policy.accumulation_steps
    micro = split_micro_batches(batch, k)
    scale = float(state.loss_scale.scale) if state.loss_scale is not None else 1.0
    param_dtype = next(iter(state.params.values())).dtype if state.params else plan.param_dtype
    accum_dtype = _accum_dtype(policy, param_dtype)

    prediv = _predivisor(policy, plan, n, param_dtype, accum_dtype)
    leaves = {u.name: state.params[u.name].detach().requires_grad_(True) for u in plan.units}
    placement = {u.name: u.placement for u in plan.units}
    acc: dict[str, torch.Tensor] = {}  # this step's gradient per unit (whole unless grads are sharded)
    reduced: dict[str, torch.Tensor] = {}  # whole-unit gradients after their final collective
    # Collectives started from backward hooks run while backward computes the next units
    # (`overlap_comm`); with gradients sharded at most two units' full gradients wait in flight.
    inflight: list[tuple[str, Any, str]] = []
    overlap = policy.overlap_comm and n > 1
    last = [False]
    # Units whose final collective started from backward, and gradient that reached them after
    # it: reentrant checkpointing runs an inner backward per region, so a unit used inside and
    # outside one accumulates more than once. Every rank runs the same graph, hence the same set.
    launched: set[str] = set()
    late: dict[str, torch.Tensor] = {}

    def drain(limit: int) -> None:
        while len(inflight) > limit:
            name, pending, kind = inflight.pop(0)
            g = pending.wait().to(accum_dtype)
            if kind == "shard":
                prev = acc.get(name)
                acc[name] = g if prev is None else prev.add_(g)
            else:
                reduced[name] = g

    def launch_final(name: str) -> None:
        launched.add(name)
        g = _prepare_for_comm(acc[name], policy, prediv)
        if placement[name].optimizer:
            inflight.append((name, start_reduce_scatter(comm, g), "final"))
        else:
            # The accumulator is this step's own buffer: reduce it in place.
            inflight.append((name, start_all_reduce(comm, g, donate=True), "final"))

    handles = []
    for u in plan.units:
        # Sharded gradients of a gathered unit are reduce-scattered as backward produces them;
        # a sharded unit's arrive reduced (`_GatherUnit.backward`); whole ones wait for the end.
        reduce_in_backward = u.placement.grads and not u.placement.params
        whole = not u.placement.grads

        def hook(leaf, name=u.name, reduce_now=reduce_in_backward, whole=whole):
            g = leaf.grad
            leaf.grad = None
            if reduce_now:
                inflight.append((name, start_reduce_scatter(comm, _prepare_for_comm(g, policy, prediv)), "shard"))
                drain(2 if overlap else 0)
                return
            g = g.to(accum_dtype)
            if name in launched:
                late[name] = g if name not in late else late[name].add_(g)
                return
            prev = acc.get(name)
            acc[name] = g if prev is None else prev.add_(g)
            if overlap and last[0] and whole:
                launch_final(name)

        handles.append(leaves[u.name].register_post_accumulate_grad_hook(hook))

    loss_sum = torch.zeros((), dtype=torch.float64)
    auxes = []
    inputs = list(leaves.values())
    runs: list = []  # the loss function's `apply` runs, released when backward is done
    timer = _Timer(policy.timings, sh.device)
    try:
        for i, mb in enumerate(micro):
            last[0] = i == len(micro) - 1
            timer.start()
            token = STEP_RUNS.set(runs)
            try:
                out = loss_fn(leaves, mb)
            finally:
                STEP_RUNS.reset(token)
            timer.stop("forward")
            loss, aux = out if has_aux else (out, None)
            if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                raise ShardingError(
                    f"loss_fn must return a scalar tensor{' (first of the pair, has_aux=True)' if has_aux else ''}, "
                    f"got {type(loss).__name__}{tuple(loss.shape) if isinstance(loss, torch.Tensor) else ''}"
                )
            timer.start()
            if sh.device.type == "cpu":
                _trim_heap()
            if inputs:
                scaled = loss * scale if scale != 1.0 else loss
                if scaled.requires_grad:
                    # No `inputs=`: reentrant checkpointing inside a model (its inner backward
                    # accumulates into the leaves it reaches) refuses it. The aliases are the only
                    # leaves that require grad in a loss built from `params`.
                    scaled.backward()
            loss_sum += loss.detach().to(torch.float64).cpu()
            timer.stop("backward")
            auxes.append(aux)
        timer.start()
        drain(0)
        for name, g in late.items():  # in hook order, the same on every rank
            g = _prepare_for_comm(g, policy, prediv)
            reduced[name].add_(_reduce_whole(comm, g, placement[name]).to(accum_dtype))
    finally:
        for h in handles:
            h.remove()
        for run in runs:
            run.release()

    # -- reduce what is still local -----------------------------------------------------------------
    grads: dict[str, torch.Tensor] = {}
    for u in plan.units:
        g = reduced.get(u.name)
        if g is None:
            g = acc.get(u.name)
            if g is None:  # the unit took no part in the loss
                g = torch.zeros(_grad_shape_numel(u, reduced=True), dtype=accum_dtype, device=sh.device)
            elif not u.placement.grads:
                g = _reduce_whole(comm, _prepare_for_comm(g, policy, prediv), u.placement).to(accum_dtype)
        grads[u.name] = g
    # Gradients stay as reduced (sums of loss-scaled gradients) until one multiply by
    # `inv * clip_coef` just before the optimizer, fused into the kernel when offloading.
    inv = prediv / (n * k * scale)

    # -- one scalar all-reduce: norm, overflow, loss --------------------------------------------------
    # Shards' squares are summed across ranks; a replicated gradient's is already global.
    norm_dtype = torch.float64 if accum_dtype == torch.float64 else torch.float32
    shard_sq = torch.zeros((), dtype=norm_dtype, device=sh.device)
    whole_sq = torch.zeros((), dtype=norm_dtype, device=sh.device)
    for u in plan.units:
        g = grads[u.name]
        if g.numel():
            sq = torch.linalg.vector_norm(g, dtype=norm_dtype).square()
            if u.placement.optimizer:
                shard_sq += sq
            else:
                whole_sq += sq
    vec = torch.stack([shard_sq.to(torch.float64).cpu() * (inv * inv), loss_sum])
    if n > 1:
        vec = comm.all_reduce(vec.to(sh.device)).cpu()
    timer.stop("comm")
    norm_sq = float(vec[0]) + float(whole_sq.to(torch.float64).cpu() * (inv * inv))
    loss_mean = float(vec[1]) / (k * n)
    overflow = not math.isfinite(norm_sq)
    grad_norm = math.sqrt(norm_sq) if not overflow else float("inf")
    step_no = int(state.step)

    metrics: dict[str, Any] = {
        "loss": loss_mean,
        "lr": None,
        "grad_norm": grad_norm,
        "loss_scale": scale if state.loss_scale is not None else None,
        "skipped": bool(overflow),
    }
    if has_aux:
        metrics["aux"] = auxes if k > 1 else auxes[0]
    if timer.on:
        metrics["timings"] = timer.totals  # filled in place until the step returns

    new_ls = loss_scale_after(state, policy, overflow, step_no, rank)
    if overflow:
        metrics["lr"] = float(sched(step_no))
        return state.replace(loss_scale=new_ls), metrics

    factor = inv
    if policy.clip > 0:
        coef = policy.clip / (grad_norm + 1e-6)
        if coef < 1.0:
            factor *= coef

    lr = float(sched(step_no))
    momentum = float(sched.momentum(step_no)) if getattr(sched, "momentum", None) is not None else None
    metrics["lr"] = lr

    timer.start()
    if host_opt is not None:
        new_state = _host_update(state, grads, factor, lr, momentum, host_opt, donate, new_ls)
        timer.stop("optimizer")
        return new_state, metrics
    if factor != 1.0:
        for g in grads.values():
            g.mul_(factor)

    if state.master is not None:
        target = state.master
    else:
        target = optimizer_view(plan, rank, state.params, opt.elementwise)
    if not opt.elementwise:
        grads = _per_param(plan, grads)
        if state.master is not None:
            target = _per_param(plan, target)
    update = opt.update_ if donate else opt.update
    new_target, new_opt_state = update(grads, state.opt_state, target, lr, momentum=momentum)
    timer.stop("optimizer")
    timer.start()
    if not opt.elementwise:
        new_target = _per_unit(plan, new_target, like=state.master if state.master is not None else state.params)

    new_slices = {k: (t.to(param_dtype) if state.master is not None else t) for k, t in new_target.items()}
    new_params = _publish_params(state, new_slices, donate)
    timer.stop("comm")
    new_state = state.replace(
        params=new_params,
        master=new_target if state.master is not None else None,
        opt_state=new_opt_state,
        step=torch.tensor(step_no + 1, dtype=torch.int64),
        loss_scale=new_ls,
    )
    return new_state, metrics


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


def _publish_params(state: TrainState, new_slices: dict[str, torch.Tensor], donate: bool) -> dict[str, torch.Tensor]:
    """The next state's parameters from each unit's updated slice (compute dtype): kept as they are
    where the optimizer updated the whole unit or parameters are held as shards; all-gathered into
    the replicated buffer where only the optimizer state is sharded (into the input state's own
    buffer when donated)."""
    plan, comm = state.sharding.plan, state.sharding.comm
    new_params: dict[str, torch.Tensor] = {}
    pending = {}
    for u in plan.units:  # start every gather first: the backend runs them back to back
        t = new_slices[u.name]
        if not u.placement.optimizer or u.placement.params:
            new_params[u.name] = t
        elif donate:
            # Into the input state's own buffer; the shard is copied first since it may be a
            # view of that very buffer (fp32 training updates the parameters' slice in place).
            pending[u.name] = start_all_gather_into(comm, t.clone(), state.params[u.name])
        else:
            pending[u.name] = comm.all_gather_async(t)
    for name, p in pending.items():
        new_params[name] = p.wait()
    return {u.name: new_params[u.name] for u in plan.units}


def _host_update(state: TrainState, grads, factor: float, lr: float, momentum, host_opt, donate: bool, new_ls):
    """ZeRO-Offload: the host optimizer updates the fp32 master shard with the gradient factor
    and the 16-bit (or device) copy of the new parameters fused into its pass."""
    sh = state.sharding
    plan, comm, rank = sh.plan, sh.comm, sh.rank
    if state.master is not None:
        master = state.master
    else:
        master = optimizer_view(plan, rank, state.params, True)
    # Where each unit's new parameters go: the kernel writes them straight into the next
    # state's buffers (parameter shards, or whole units where the optimizer is replicated), else into a staging shard.
    out = {}
    from ._offload._state import NvmeOptState

    nvme = isinstance(state.opt_state, NvmeOptState)  # the master is on disk
    # `offload_param: nvme`: these units' parameters are the master file itself (placeholders here).
    in_store = {u.name for u in plan.units if nvme and state.opt_state.holds_params and plan.params_sharded(u)}
    for u in plan.units:
        p = state.params[u.name]
        if u.name in in_store:
            out[u.name] = None
        elif state.master is None and not nvme:
            out[u.name] = None  # fp32 on the host: the master *is* the parameter slice
        else:
            numel = master[u.name].numel()
            out[u.name] = p.new_empty(numel) if not donate or p.numel() != numel else p
    if nvme:
        new_master, new_opt = _nvme_update(state, grads, factor, lr, momentum, host_opt, donate, out)
    else:
        new_master, new_opt = host_opt.update(
            grads, state.opt_state, master, lr, momentum=momentum, grad_scale=factor,
            out={k: v for k, v in out.items() if v is not None}, inplace=donate,
        )
    new_slices = {
        u.name: state.params[u.name] if u.name in in_store else out[u.name] if out[u.name] is not None else new_master[u.name]
        for u in plan.units
    }
    new_params = _publish_params(state, new_slices, donate)
    return state.replace(
        params=new_params,
        master=new_master if state.master is not None else None,
        opt_state=new_opt,
        step=torch.tensor(int(state.step) + 1, dtype=torch.int64),
        loss_scale=new_ls,
    )


def _nvme_update(state: TrainState, grads, factor, lr, momentum, host_opt, donate: bool, out):
    """ZeRO-Infinity: the store streams master and moments through the C kernel in sub-groups and
    writes the new parameters into `out`."""
    opt_state = state.opt_state
    store = opt_state.store
    count = int(opt_state.count)
    if (store.last_step or 0) != count:
        raise ShardingError(
            f"this TrainState is at step {count} but its NVMe optimizer files are at step {store.last_step}: "
            "with offload_optimizer device nvme the files are updated in place, so only the newest state "
            "can take a step"
        )
    targets = {k: v for k, v in out.items() if v is not None and v.device.type == "cpu"}
    store.step({k: g.to("cpu") for k, g in grads.items()}, step=count + 1, out=targets, grad_scale=factor,
               **host_opt.kernel_kwargs(lr, momentum))
    for k, v in out.items():
        if v is not None and k not in targets:  # accelerator parameters: copy the host result over
            v.copy_(store.read(k, "master").to(v.dtype))
    return None, dataclasses.replace(opt_state, count=torch.tensor(count + 1, dtype=torch.int64))


def _per_param(plan: ShardPlan, by_unit: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {}
    for u in plan.units:
        views = unit_views(u, by_unit[u.name])
        out.update({s.name: views[s.name] for s in u.slots})
    return out


def _per_unit(plan: ShardPlan, by_param: dict[str, torch.Tensor], like: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {}
    for u in plan.units:
        parts = [by_param[s.name].reshape(-1) for s in u.slots]
        pad = u.padded_numel - u.numel
        if pad:
            parts.append(like[u.name].new_zeros(pad))
        out[u.name] = torch.cat(parts) if parts else like[u.name].new_zeros(0)
    return out
