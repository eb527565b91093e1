"""`fnzero.load_config` and `fnzero.hf_auto_values`: the config layer's functions, with the world
size of the world this code runs in when the caller names none.

The config layer never asks torch.distributed (`specs/architecture.md`); the sharding layer knows
the world (a simulated rank's provided collectives, torch.distributed's default group, else one
process), so it passes the size down, as DeepSpeed reads its world when it builds its config.
"""

from __future__ import annotations

import functools
from typing import Any, Mapping

from ...config import AutoValues, Config, hf_auto_values as config_auto_values, read_config
from ..comm import current_world_size

__all__ = ["load_config", "hf_auto_values"]


def load_config(src: Any, world_size: int | None = None, auto: Mapping[str, Any] | None = None) -> Config:
    """Load, validate and resolve a DeepSpeed config (`src`: path, dict, JSON or base64 text;
    `auto`: values for `"auto"` keys) exactly as `fnzero.config.load_config`, except that
    `world_size` defaults to the world this code runs in: a simulated rank's, torch.distributed's
    default group's, else 1. Raises one `ConfigError` listing every problem.

    >>> import fnzero
    >>> fnzero.load_config({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2}).train_batch_size
    8
    """
    return read_config(src, current_world_size() if world_size is None else world_size, auto, stacklevel=3)


@functools.wraps(config_auto_values, assigned=("__doc__",))
def hf_auto_values(*, world_size: int | None = None, **values: Any) -> AutoValues:
    return config_auto_values(world_size=current_world_size() if world_size is None else world_size, **values)

