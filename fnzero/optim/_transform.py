"""Gradient transformations, optax style: small pure `(init, update)` pairs that compose with `chain`
(specs/optim.md §Chains). Step numbers are read from the states' counts as tensors, so the same
`update` runs eagerly and traced.

    >>> import torch
    >>> from fnzero import optim
    >>> tx = optim.chain(optim.scale_by_adam(), optim.add_decayed_weights(0.1), optim.scale_by_learning_rate(1e-2))
    >>> params = {"w": torch.ones(2)}
    >>> updates, state = tx.update({"w": torch.ones(2)}, tx.init(params), params)
    >>> [round(x, 6) for x in optim.apply_updates(params, updates)["w"].tolist()]
    [0.989, 0.989]
"""

from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple

import optree
import torch

from ._base import Optimizer, Params, zeros_count

__all__ = [
    "GradientTransformation", "chain", "apply_updates", "scale", "scale_by_learning_rate", "scale_by_adam",
    "add_decayed_weights", "trace", "scale_by_lion", "scale_by_rss", "scale_by_lr_decay", "scale_by_trust_ratio",
    "scale_by_bias_correction", "clip_by_global_norm", "scale_by_loss_scale", "CountState", "ScaleByAdamState",
    "TraceState", "ScaleByLionState", "ScaleByRssState", "as_optimizer", "not_elementwise", "Implementations",
]


class Implementations(NamedTuple):
    """Builders of the `Optimizer` that runs a chain on the `device` (torch's fused kernels) and on the
    `host` (fnzero's C kernels), None where it declares none (then `as_optimizer` runs it)."""

    device: Callable[[], Optimizer] | None = None
    host: Callable[[], Optimizer] | None = None


class GradientTransformation(NamedTuple):
    """init(params) -> state; update(updates, state, params=None, **extra) -> (updates, state).

    `elementwise`: a flat shard can be updated on its own; `name`: how messages name it; `parts`: a
    chain's transforms, or a `partition`'s two chains; `route`: a `partition`'s `(select,
    outside_extra)`; `implementations`: `Implementations` or None; `local_gradients`: as
    `Optimizer.local_gradients` (specs/optim.md §Chains)."""

    init: Callable[[Params], Any]
    update: Callable[..., tuple[Params, Any]]
    elementwise: bool = True
    name: str = ""
    parts: tuple = ()
    route: tuple | None = None
    implementations: Implementations | None = None
    local_gradients: Callable[[Any], bool] | None = None

    @property
    def exchanges_gradients(self) -> bool:
        """It exchanges what it needs itself (`Optimizer.exchanges_gradients`)."""
        return self.local_gradients is not None


def _named(factory: Callable[..., GradientTransformation]) -> Callable[..., GradientTransformation]:
    """A transform factory whose results are named by the call that made them, so an error can
    say which transform of a chain it means (`not_elementwise`)."""

    @functools.wraps(factory)
    def make(*args, **kwargs):
        shown = ", ".join([*map(repr, args), *(f"{k}={v!r}" for k, v in kwargs.items())])
        return factory(*args, **kwargs)._replace(name=f"{factory.__name__}({shown})")

    return make


def not_elementwise(tx: GradientTransformation | Optimizer) -> list[str]:
    """The transforms of `tx` (a chain's, recursively; an `Optimizer`'s chain, none for a fused
    one) that read whole tensors, by name."""
    if isinstance(tx, Optimizer):
        return [] if tx.transform is None else not_elementwise(tx.transform)
    if tx.elementwise:
        return []
    if not tx.parts:
        return [tx.name or "a transform without a name"]
    return [name for t in tx.parts for name in not_elementwise(t)]


class CountState(NamedTuple):
    """The state of a transform that only counts its updates."""

    count: torch.Tensor  # updates applied so far (0-dim int64)


class ScaleByAdamState(NamedTuple):
    """`scale_by_adam`: the update count and Adam's two moments, trees like params."""

    count: torch.Tensor
    mu: Params  # first moment
    nu: Params  # second moment


class TraceState(NamedTuple):
    """`trace`: the update count and the momentum buffer."""

    count: torch.Tensor
    trace: Params  # the momentum buffer


class ScaleByLionState(NamedTuple):
    """`scale_by_lion`: the update count and Lion's moment."""

    count: torch.Tensor
    mu: Params


class ScaleByRssState(NamedTuple):
    """`scale_by_rss`: the update count and the running sum of squared gradients."""

    count: torch.Tensor
    sum_of_squares: Params


def _map(fn, *trees):
    return optree.tree_map(fn, *trees)


def _step_number(count: torch.Tensor) -> torch.Tensor:
    """This update's 1-based number, float64, as a tensor (a trace keeps the count an input)."""
    return (count + 1).to(torch.float64)


def _stateless(fn: Callable[..., Params], elementwise: bool = True) -> GradientTransformation:
    return GradientTransformation(lambda params: (), lambda u, s, params=None, **extra: (fn(u, params, extra), s),
                                  elementwise)


def chain(*transforms: GradientTransformation) -> GradientTransformation:
    """Apply `transforms` in order; the state is the tuple of their states, the extras go to all.
    It exchanges gradients where a part does; it declares no implementations (it computes more)."""

    def init(params):
        return tuple(t.init(params) for t in transforms)

    def update(updates, state, params=None, **extra):
        new_state = []
        for t, s in zip(transforms, state):
            updates, s = t.update(updates, s, params, **extra)
            new_state.append(s)
        return updates, tuple(new_state)

    local = [(i, t.local_gradients) for i, t in enumerate(transforms) if t.local_gradients is not None]
    return GradientTransformation(init, update, all(t.elementwise for t in transforms),
                                  f"chain({', '.join(t.name or '?' for t in transforms)})", tuple(transforms),
                                  local_gradients=(lambda s: any(f(s[i]) for i, f in local)) if local else None)


def apply_updates(params: Params, updates: Params) -> Params:
    """`params + updates`, leaf by leaf, in each parameter's dtype."""
    return _map(lambda p, u: p + u.to(p.dtype), params, updates)


@_named
def scale(factor: float) -> GradientTransformation:
    """`factor * updates`."""
    return _stateless(lambda u, p, e: _map(lambda x: x * factor, u))


@_named
def scale_by_learning_rate(lr: float = 1e-3) -> GradientTransformation:
    """`-lr * updates`; the step's `lr=` extra (its schedule) replaces the default."""

    def fn(u, p, extra):
        step_lr = extra.get("lr")
        step_lr = lr if step_lr is None else step_lr
        return _map(lambda x: x * -step_lr, u)

    return _stateless(fn)


@_named
def add_decayed_weights(weight_decay: float) -> GradientTransformation:
    """`updates + weight_decay * params`: before the adaptive scaling it is an L2 penalty (Adam),
    after it decoupled weight decay (AdamW)."""
    if weight_decay == 0.0:
        return _stateless(lambda u, p, e: u)
    return _stateless(lambda u, p, e: _map(lambda x, w: x + weight_decay * w.to(x.dtype), u, p))


@_named
def scale_by_adam(b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8, bias_correction: bool = True,
                  eps_inside_sqrt: bool = False) -> GradientTransformation:
    """Adam's direction `m_hat / (sqrt(v_hat) + eps)` (eps under the root with `eps_inside_sqrt`;
    without bias correction m and v as they are). `momentum=` replaces b1 for the step."""

    def init(params):
        with torch.no_grad():
            return ScaleByAdamState(zeros_count(), _map(torch.zeros_like, params), _map(torch.zeros_like, params))

    def update(u, s, params=None, **extra):
        beta1 = b1 if extra.get("momentum") is None else extra["momentum"]
        t = _step_number(s.count)
        mu = _map(lambda m, g: m + (g.to(m.dtype) - m) * (1.0 - beta1), s.mu, u)
        nu = _map(lambda v, g: v * b2 + g.to(v.dtype) * g.to(v.dtype) * (1.0 - b2), s.nu, u)
        bc1 = 1.0 - beta1**t if bias_correction else 1.0
        bc2 = 1.0 - b2**t if bias_correction else 1.0

        def direction(m, v):
            denom = (v / bc2 + eps).sqrt() if eps_inside_sqrt else (v / bc2).sqrt() + eps
            return (m / bc1) / denom

        return _map(direction, mu, nu), ScaleByAdamState(s.count + 1, mu, nu)

    return GradientTransformation(init, update)


@_named
def trace(momentum: float, dampening: float = 0.0, nesterov: bool = False) -> GradientTransformation:
    """SGD momentum as torch.optim.SGD keeps it: the buffer starts at the first gradient, then
    `buf = momentum * buf + (1 - dampening) * g`; the update is `buf` (or `g + momentum * buf`)."""

    def init(params):
        with torch.no_grad():
            return TraceState(zeros_count(), _map(torch.zeros_like, params))

    def update(u, s, params=None, **extra):
        mom = momentum if extra.get("momentum") is None else extra["momentum"]
        first = s.count == 0  # a tensor: the buffer starts at the first gradient, chosen elementwise
        buf = _map(lambda b, g: torch.where(first.to(b.device), g.to(b.dtype), b * mom + g.to(b.dtype) * (1.0 - dampening)),
                   s.trace, u)
        out = _map(lambda g, b: g + b * mom, u, buf) if nesterov else buf
        return out, TraceState(s.count + 1, buf)

    return GradientTransformation(init, update)


@_named
def scale_by_lion(b1: float = 0.9, b2: float = 0.99) -> GradientTransformation:
    """Lion's direction `sign(b1 * m + (1 - b1) * g)`, then `m = b2 * m + (1 - b2) * g`."""

    def init(params):
        with torch.no_grad():
            return ScaleByLionState(zeros_count(), _map(torch.zeros_like, params))

    def update(u, s, params=None, **extra):
        beta1 = b1 if extra.get("momentum") is None else extra["momentum"]
        out = _map(lambda m, g: torch.sign(m * beta1 + g.to(m.dtype) * (1.0 - beta1)), s.mu, u)
        mu = _map(lambda m, g: m * b2 + g.to(m.dtype) * (1.0 - b2), s.mu, u)
        return out, ScaleByLionState(s.count + 1, mu)

    return GradientTransformation(init, update)


@_named
def scale_by_rss(initial_accumulator_value: float = 0.0, eps: float = 1e-10) -> GradientTransformation:
    """Adagrad's direction: `g / (sqrt(sum of g^2) + eps)`, the sum started at the initial value."""

    def init(params):
        with torch.no_grad():
            return ScaleByRssState(zeros_count(), _map(lambda p: torch.full_like(p, initial_accumulator_value), params))

    def update(u, s, params=None, **extra):
        acc = _map(lambda a, g: a + g.to(a.dtype) * g.to(a.dtype), s.sum_of_squares, u)
        return _map(lambda g, a: g / (a.sqrt() + eps), u, acc), ScaleByRssState(s.count + 1, acc)

    return GradientTransformation(init, update)


@_named
def scale_by_lr_decay(lr_decay: float) -> GradientTransformation:
    """Adagrad's `lr_decay`: the t-th update (1-based) is divided by `1 + (t - 1) * lr_decay`."""

    def update(u, s, params=None, **extra):
        t = _step_number(s.count)
        return _map(lambda x: x / (1.0 + (t - 1.0) * lr_decay), u), CountState(s.count + 1)

    return GradientTransformation(lambda params: CountState(zeros_count()), update)


@_named
def scale_by_bias_correction(b1: float, b2: float) -> GradientTransformation:
    """Lamb's step-size correction `sqrt(1 - b2^t) / (1 - b1^t)`, applied to the whole update."""

    def update(u, s, params=None, **extra):
        beta1 = b1 if extra.get("momentum") is None else extra["momentum"]
        t = _step_number(s.count)
        factor = (1.0 - b2**t).sqrt() / (1.0 - beta1**t)
        return _map(lambda x: x * factor, u), CountState(s.count + 1)

    return GradientTransformation(lambda params: CountState(zeros_count()), update)


@_named
def scale_by_trust_ratio(min_coeff: float = 0.01, max_coeff: float = 10.0) -> GradientTransformation:
    """Lamb's per-tensor trust ratio `||p|| / ||u||`, clamped; 1 where either norm is zero. It
    reads whole tensors, so the chain is not elementwise."""

    def ratio(u, p):
        w, n = torch.linalg.vector_norm(p.to(u.dtype)), torch.linalg.vector_norm(u)
        ok = (w != 0) & (n != 0)
        return u * torch.where(ok, (w / torch.where(ok, n, 1.0)).clamp(min_coeff, max_coeff), 1.0)

    return _stateless(lambda u, p, e: _map(ratio, u, p), elementwise=False)


@_named
def clip_by_global_norm(max_norm: float) -> GradientTransformation:
    """Scale the updates by `max_norm / (norm + 1e-6)` when below 1 (torch's clip_grad_norm_).
    The norm is the step's `global_norm=` extra (over every rank's shard); without it, this
    tree's own norm."""

    def fn(u, p, extra):
        norm = extra.get("global_norm")
        if norm is None:
            leaves = optree.tree_leaves(u)
            norm = torch.stack([torch.linalg.vector_norm(x, dtype=torch.float64) for x in leaves]).square().sum().sqrt() \
                if leaves else 0.0
        coef = max_norm / (norm + 1e-6)
        if isinstance(coef, torch.Tensor):  # traced (or a tensor norm): no branch on its value
            return _map(lambda x: x * coef.clamp(max=1.0).to(x.device), u)
        return u if coef >= 1.0 else _map(lambda x: x * coef, u)

    return _stateless(fn)


@_named
def scale_by_loss_scale() -> GradientTransformation:
    """Divide by the step's `loss_scale=` extra (fp16 training); nothing without it."""

    def fn(u, p, extra):
        s = extra.get("loss_scale")
        return u if s is None or (not isinstance(s, torch.Tensor) and s == 1.0) else _map(lambda x: x / s, u)

    return _stateless(fn)


def as_optimizer(tx: GradientTransformation) -> Optimizer:
    """Run a chain where fnzero runs an optimizer (`fnzero.train_step(..., optimizer=)`,
    `sm.init_state(optimizer=)`): `update` returns new parameters, `update_` writes them into the
    given ones. The step's `lr`, `momentum` and `global_norm` (of the gradients the chain is
    given, over every rank) arrive as the chain's extras, with the compressed all-reduce for a
    chain that exchanges its own gradients (`local_gradients`). The chain's `update` is written in
    tensor ops throughout, so it is also the `graph_update` that `fnzero.jit(scope="step")`
    traces into the whole-step graph (a transform of a user's that reads a Python number from
    a tensor cannot be traced: that step then compiles the loss only, and says why)."""

    def update_(grads, opt_state, params, lr=None, *, momentum=None, **extra):
        with torch.no_grad():
            updates, new_state = tx.update(grads, opt_state, params, lr=lr, momentum=momentum, **extra)
            optree.tree_map(lambda p, u: p.add_(u.to(p.dtype)), params, updates)
        return params, new_state

    def update(grads, opt_state, params, lr=None, *, momentum=None, **extra):
        with torch.no_grad():
            updates, new_state = tx.update(grads, opt_state, params, lr=lr, momentum=momentum, **extra)
            return apply_updates(params, updates), new_state

    # A chain that exchanges its own gradients steps by Python numbers (the 1-bit optimizers'):
    # it cannot run traced.
    return Optimizer(init=tx.init, update=update, update_=update_, elementwise=tx.elementwise,
                     graph_update=None if tx.exchanges_gradients else update, transform=tx,
                     local_gradients=tx.local_gradients)
