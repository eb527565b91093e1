"""`fnzero.pipeline_loss(sm)`: the loss function of a pipelined model, run by a schedule
(`specs/mesh.md` §Pipeline). The training step calls its `forward_backward` instead of running
the loss per micro-batch; everything after (reductions by placement, the norm, the optimizer) is
the step's own, on this stage's units.
"""

from __future__ import annotations

from typing import Any

import torch

from .._errors import ConfigError, ShardingError
from ..sharding import padded_size, within
from ._p2p import boundary_tensors, recv_activation, recv_grads, send_activation, send_grads
from ._schedule import schedule

__all__ = ["PipelineLoss", "pipeline_loss", "sum_tied_gradients", "units_for_norm"]


def pipeline_loss(sm, schedule: str = "1f1b") -> "PipelineLoss":
    """The loss function of `fnzero.train_step` for a sharded `PipelineModule`: this rank's stage
    runs `schedule` ("1f1b", "gpipe", or "interleaved" for a PipelineModule with virtual_stages > 1)
    over the step's micro-batches (gradient_accumulation_steps of them). A ConfigError names the
    numbers when 1F1B has fewer micro-batches than stages, or interleaving a count that is not a
    multiple of the stages.

    >>> step = fnzero.train_step(fnzero.pipeline_loss(sm), cfg)   # doctest: +SKIP
    >>> state, metrics = step(state, (inputs, labels))            # doctest: +SKIP
    """
    return PipelineLoss(sm, schedule)


class PipelineLoss:
    """What `fnzero.train_step` runs for a pipeline model: each micro-batch's forward and backward
    in `schedule`'s order, activations and their gradients crossing stage boundaries point to
    point. A batch is `(inputs, labels)`: the first stage reads `inputs`, the last `labels`
    (other stages may pass None for either)."""

    def __init__(self, sm, schedule_name: str = "1f1b"):
        if getattr(sm, "pp", None) is None:
            raise ShardingError("fnzero.pipeline_loss needs the ShardedModule of a fnzero.pipeline.PipelineModule "
                                "(fnzero.shard(PipelineModule(layers, loss_fn), ...))")
        self.sm, self.info, self.schedule_name = sm, sm.pp, schedule_name
        if self.info.chunks > 1 and self.info.stages < 2:
            raise ConfigError(f"{self.info.chunks} virtual stages need at least 2 pipeline stages to interleave")
        k = getattr(getattr(sm, "config", None), "gradient_accumulation_steps", None)
        if k is not None:  # a ConfigError now, not at step 1
            schedule(schedule_name, self.info.stages, int(k), self.info.stage_index, self.info.chunks)

    def __call__(self, params, batch):
        raise ShardingError("a pipeline loss runs inside fnzero.train_step(fnzero.pipeline_loss(sm), config), which runs "
                            "its schedule; it is not called per micro-batch")

    def forward_backward(self, leaves: dict[str, torch.Tensor], micro: list[Any], scale: float, has_aux: bool,
                         collector, trim_heap: bool, timer) -> tuple[torch.Tensor, list[Any]]:
        """Run this stage's schedule over the micro-batches; returns (Σ loss as float64 — zero
        except on the last stage —, no auxes). Waits for every send before returning. With
        `wall_clock_breakdown`, waits for a neighbour count as "comm" and only this stage's own
        passes as "forward"/"backward", so the idle share of a step (the bubble) can be measured."""
        if has_aux:
            raise ShardingError("has_aux is not supported with pipeline parallelism: the loss is computed on the last "
                                "stage only")
        info = self.info
        run = _Run(self, leaves, micro, scale, collector, timer)
        handles = collector.attach(leaves)
        try:
            for act in schedule(self.schedule_name, info.stages, len(micro), info.stage_index, info.chunks):
                (run.forward if act.kind == "F" else run.backward)(act.micro, act.chunk)
            timer.start()
            for s in run.sends:
                s.wait()
            collector.finish_backward()
        finally:
            for h in handles:
                h.remove()
            for r in run.runs:
                r.release()
        return run.loss_sum, []


class _Run:
    """One step's pass of a stage through its schedule: what is in flight between its actions."""

    def __init__(self, loss: PipelineLoss, leaves, micro, scale, collector, timer):
        self.sm, self.info, self.leaves, self.micro = loss.sm, loss.info, leaves, micro
        self.scale, self.collector, self.timer = scale, collector, timer
        self.loss_sum = torch.zeros((), dtype=torch.float64)
        self.runs: list = []  # the apply runs to release after backward
        self.sends: list = []  # pending point-to-point sends
        self.saved: dict[tuple[int, int], tuple[Any, Any]] = {}  # (micro, chunk) -> (its input, its output or loss)
        p, s = self.info.stages, self.info.stage_index
        self.prev, self.next = (s - 1) % p, (s + 1) % p  # the chunk before rank 0's chunk c is rank p-1's chunk c-1

    def forward(self, j: int, c: int) -> None:
        info, timer = self.info, self.timer
        inputs, labels = _pair(self.micro[j], j)
        timer.start()  # waiting for the previous stage is communication (the bubble), not compute
        x = inputs if info.first(c) else recv_activation(info.comm, self.prev, self.sm.sharding.device, f"act{j}.{c}")
        timer.stop("comm")
        timer.start()
        with within(step_runs=self.runs):
            out = self.sm.apply(self.leaves, x, chunk=c)
            if info.last(c):
                out = info.loss_fn(out, labels)
                _check_loss(out)
                if self.sm.sp is not None:
                    out = _share(out, labels, self.sm.sp)
                self.loss_sum += out.detach().to(torch.float64).cpu()
        if not info.last(c):
            self.sends += send_activation(info.comm, out, self.next, info.stage_index, f"act{j}.{c}")
        self.saved[(j, c)] = (x, out)
        timer.stop("forward")

    def backward(self, j: int, c: int) -> None:
        info, timer = self.info, self.timer
        timer.start()
        self.collector.last_micro_batch = j == len(self.micro) - 1  # the chunk's units' last gradients
        x, out = self.saved.pop((j, c))
        if info.last(c):
            scaled = out * self.scale if self.scale != 1.0 else out
            if scaled.requires_grad:
                scaled.backward()
        else:
            outs = boundary_tensors(out, info.stage_index)[0]
            timer.stop("backward")
            timer.start()
            grads = recv_grads(info.comm, outs, self.next, f"grad{j}.{c}")
            timer.stop("comm")
            timer.start()
            needs = [t for t in outs if t.requires_grad]
            if needs:
                torch.autograd.backward(needs, grads)
        if not info.first(c):
            self.sends += send_grads(info.comm, x, self.prev, f"grad{j}.{c}")
        timer.stop("backward")


def _pair(mb: Any, j: int) -> tuple[Any, Any]:
    if isinstance(mb, tuple) and len(mb) == 2:
        return mb
    if mb is None:
        return None, None
    raise ShardingError(f"micro-batch {j} of a pipeline step is a {type(mb).__name__}; a pipeline batch is the tuple "
                        "(inputs, labels) (DeepSpeed's train_batch convention)")


def _share(mean: torch.Tensor, labels: Any, sp) -> torch.Tensor:
    """With a sequence axis, the loss_fn's mean over this rank's labels (those not -100, for token
    ids) made its share of the group's mean (`SPLayout.loss_share`)."""
    if not isinstance(labels, torch.Tensor):
        raise ShardingError("with sequence parallelism a pipeline's labels are a tensor of this rank's run of the "
                            f"tokens (fnzero.shard_sequence), not {type(labels).__name__}")
    count = (labels != -100).sum() if not labels.is_floating_point() else torch.tensor(labels.numel())
    total = torch.where(count > 0, mean * count.to(mean.device, mean.dtype), torch.zeros_like(mean))
    return sp.loss_share(total, count)


def _check_loss(loss: Any) -> None:
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise ShardingError(f"the pipeline's loss_fn must return a scalar tensor, got {type(loss).__name__}"
                            f"{tuple(loss.shape) if isinstance(loss, torch.Tensor) else ''}")


def sum_tied_gradients(grads: dict[str, torch.Tensor], plan, pp) -> dict[str, torch.Tensor]:
    """Each weight shared by several stages gets the sum of their gradients (one all-reduce over
    the pipeline per tied weight; stages that do not hold it add zeros), so every copy takes the
    same update. Its unit is laid out alike on each holder: the same elements in each shard."""
    n = plan.world_size
    for tie in pp.ties:
        if tie.module is not None:
            unit = next(u for u in plan.units if u.module == tie.module)
            g = grads[unit.name]
        else:
            padded = padded_size(tie.numel, n)  # the holders' unit holds only this weight
            size = padded // n if plan.placement.optimizer else padded
            g = torch.zeros(size, dtype=next(iter(grads.values())).dtype, device=next(iter(grads.values())).device)
        total = pp.comm.all_reduce(g)
        if tie.module is not None:
            grads[unit.name] = total
    return grads


def units_for_norm(plan, pp) -> tuple:
    """The units whose gradients count in the global norm: a tied weight once, on the first stage
    holding it."""
    if pp is None or not pp.ties:
        return plan.units
    skip = {t.module for t in pp.ties if t.module is not None and t.stages[0] != pp.stage_index}
    return tuple(u for u in plan.units if u.module not in skip)
