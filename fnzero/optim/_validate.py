"""Hyper-parameter checks shared by the optimizer factories.

Factories check everything at construction so a bad value fails where it was written,
naming the optimizer, the parameter and the value (``adamw: betas[1]=1.5 must be in [0, 1)``),
instead of turning into NaNs a thousand steps into a run.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from fnzero._errors import ConfigError

# DeepSpeed/torch implementation switches that choose a kernel or a storage format but not
# the arithmetic. Configs written for DeepSpeed carry them, so they are accepted and dropped.
_IGNORED_FLAGS = frozenset(
    {"torch_adam", "fused", "fp32_optimizer_states", "set_grad_none", "foreach", "capturable", "differentiable"}
)
# Switches that would change the arithmetic into something fnzero does not implement: only
# their off value is accepted.
_MUST_BE_FALSE = frozenset({"amsgrad", "maximize"})


def number(opt: str, name: str, value: Any, *, lo: float = 0.0, hi: float | None = None, hi_open: bool = False) -> float:
    """`value` as a finite float in [lo, hi] (or [lo, hi) with hi_open), else ConfigError."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{opt}: {name}={value!r} must be a number")
    v = float(value)
    upper_ok = hi is None or (v < hi if hi_open else v <= hi)
    if not (math.isfinite(v) and v >= lo and upper_ok):
        if hi is None:
            rng = f">= {lo:g}"
        else:
            rng = f"in [{lo:g}, {hi:g}{')' if hi_open else ']'}"
        raise ConfigError(f"{opt}: {name}={value!r} must be {rng}")
    return v


def betas(opt: str, value: Any) -> tuple[float, float]:
    """A pair of decay rates, each in [0, 1): 1 would freeze the average, >1 makes it diverge."""
    try:
        b = tuple(value)
    except TypeError:
        raise ConfigError(f"{opt}: betas={value!r} must be a pair of numbers, e.g. (0.9, 0.999)") from None
    if len(b) != 2:
        raise ConfigError(f"{opt}: betas={value!r} must be a pair of numbers, e.g. (0.9, 0.999)")
    return (
        number(opt, "betas[0]", b[0], hi=1.0, hi_open=True),
        number(opt, "betas[1]", b[1], hi=1.0, hi_open=True),
    )


def flag(opt: str, name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"{opt}: {name}={value!r} must be true or false")
    return value


def extra_kwargs(opt: str, extra: Mapping[str, Any]) -> None:
    """Accept DeepSpeed's implementation flags; reject anything else so typos are not silently lost."""
    for key, value in extra.items():
        if key in _IGNORED_FLAGS:
            continue
        if key in _MUST_BE_FALSE:
            if value:
                raise ConfigError(f"{opt}: {key}={value!r} is not supported; only {key}=False is")
            continue
        raise ConfigError(f"{opt}: unknown parameter {key!r}")


def momentum_override(opt: str, value: Any, *, hi_open: bool = True) -> float:
    """A per-step momentum (from a OneCycle schedule) must obey the same range as the factory's."""
    return number(opt, "momentum", value, hi=1.0, hi_open=hi_open)
