"""What 1-bit Adam, 0/1 Adam and 1-bit LAMB share (`specs/optim.md` §1-bit optimizers): their
hyper-parameter checks, the compressed exchange the step passes them as the extra
`compressed_all_reduce=` (it returns `(results, worker_errors, server_errors)`, each result flat over
the tensor's padded length), and their common step start (step 1 only initialises)."""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Sequence

import optree
import torch

from fnzero._errors import ConfigError

from . import _validate as check
from ._base import Optimizer, advance, flat_args
from ._transform import GradientTransformation, Implementations

__all__ = ["exchange_from", "exchange", "steps", "no_effect_kwargs", "empty_error", "first_compressed_count",
           "StepStart", "step_start", "compressed_from", "hyper", "chain_form"]

# Keys DeepSpeed's 1-bit optimizers take that change nothing in their arithmetic (bias_correction,
# eps_inside_sqrt and max_grad_norm are stored and never read there) or choose a transport.
_NO_EFFECT = frozenset({"bias_correction", "eps_inside_sqrt", "max_grad_norm", "cuda_aware", "comm_backend_name"})


def no_effect_kwargs(opt: str, extra: dict[str, Any]) -> None:
    """Accept DeepSpeed's keys that mean nothing here (the config warns about them); refuse AMSGrad
    (DeepSpeed raises too) and anything unknown."""
    for key, value in extra.items():
        if key in _NO_EFFECT:
            continue
        if key == "amsgrad":
            if value:
                raise ConfigError(f"{opt}: amsgrad={value!r} is not supported (DeepSpeed refuses it too)")
            continue
        raise ConfigError(f"{opt}: unknown parameter {key!r}")


def steps(opt: str, name: str, value: Any, lo: int = 0) -> int:
    """A step count or interval: an int >= lo."""
    if isinstance(value, bool) or not isinstance(value, int) or value < lo:
        raise ConfigError(f"{opt}: {name}={value!r} must be an integer >= {lo}")
    return value


def first_compressed_count(freeze_step: int) -> int:
    """The applied-step count from which 1-bit Adam and 1-bit LAMB compress: DeepSpeed checks
    `step >= freeze_step` after each step but the first (its initialisation step), so step t is
    compressed when t − 1 >= max(freeze_step, 2)."""
    return max(freeze_step, 2)


ExchangeFn = Callable[[Sequence[torch.Tensor], Sequence[torch.Tensor], Sequence[torch.Tensor]], Any]


def exchange_from(opt: str, extras: dict[str, Any]) -> ExchangeFn:
    fn = extras.get("compressed_all_reduce")
    if fn is None:
        raise ConfigError(
            f"{opt} exchanges its momentum itself and needs the step's compressed_all_reduce= extra (fnzero.train_step "
            "passes it; a loop of your own passes functools.partial(fnzero.sharding.compressed_all_reduce, comm))")
    return fn


def empty_error(like: torch.Tensor) -> torch.Tensor:
    """An error buffer not allocated yet (0 elements stand for zeros; the exchange sizes it)."""
    return like.new_zeros(0)


def exchange(fn: ExchangeFn, tensors: list[torch.Tensor], worker: list[torch.Tensor], server: list[torch.Tensor]):
    """`tensors` averaged by the compressed exchange, in their own shapes: (results, worker, server)."""
    out = fn(tensors, worker, server)
    results = [r[: t.numel()].view_as(t) for r, t in zip(out[0], tensors)]
    return results, list(out[1]), list(out[2])


class StepStart(NamedTuple):
    """A step's numbers once its count advanced: t (1-based), lr, beta1, the params' leaves and
    structure, the gradients as leaves in the params' dtypes."""

    t: int
    lr: float
    b1: float
    p: list
    treedef: Any
    g: list


def step_start(opt: str, grads, opt_state, params, lr, momentum, default_lr: float, beta1: float) -> StepStart | None:
    """Advance the count; None on step 1, DeepSpeed's initialisation step, which moves nothing else."""
    t = advance(opt_state.count)
    if t == 1:
        return None
    treedef, p, g = flat_args(grads, opt_state, params)
    return StepStart(t, default_lr if lr is None else float(lr),
                     beta1 if momentum is None else check.momentum_override(opt, momentum), p, treedef, g)


def compressed_from(first: int) -> Callable[[Any], bool]:
    """`Optimizer.local_gradients` of 1-bit Adam and LAMB: from applied-step count `first` on."""
    return lambda state: int(state.count) >= first


def hyper(opt: str, lr: Any, betas: Any, eps: Any, weight_decay: Any) -> tuple[float, float, float, float, float]:
    """(lr, beta1, beta2, eps, weight_decay), checked."""
    b1, b2 = check.betas(opt, betas)
    return (check.number(opt, "lr", lr), b1, b2, check.number(opt, "eps", eps),
            check.number(opt, "weight_decay", weight_decay))


def chain_form(opt: Optimizer) -> GradientTransformation:
    """The chain of a 1-bit optimizer: it declares `opt` as its implementation (what runs it) and
    its `local_gradients`. These optimizers exchange and step whole parameters (0/1 Adam undoes
    its local steps), so there are no finer transforms; the chain's own update is `opt`'s step
    as updates (new − old parameters), which another chain may compose."""

    def update(updates, state, params=None, **extra):
        new, state = opt.update(updates, state, params, **extra)
        return optree.tree_map(torch.sub, new, params), state

    return GradientTransformation(opt.init, update, elementwise=False, implementations=Implementations(lambda: opt),
                                  local_gradients=opt.local_gradients)
