"""Learning-rate schedules with DeepSpeed's exact numbers, as pure functions of the step.

A `Schedule` maps k, the number of optimizer steps already *applied* (fp16 overflow skips do
not count), to the lr of the next one: ``schedule(k)`` / ``schedule.lr(k)``, and for OneCycle
also ``schedule.momentum(k)``. The factories take DeepSpeed's parameter names and reproduce
its engine's lrs step for step, first steps included; specs/schedules.md has the formulas.

>>> from fnzero import schedules
>>> s = schedules.warmup_lr(warmup_min_lr=0.0, warmup_max_lr=1e-3, warmup_num_steps=100)
>>> s(0), s(1), round(s(50), 8), s(1000)
(0.0, 0.0, 0.00084949, 0.001)
"""

from ._base import Schedule, constant
from ._config import from_config
from ._one_cycle import lr_range_test, one_cycle
from ._warmup import warmup_cosine_lr, warmup_decay_lr, warmup_lr

__all__ = [
    "Schedule", "constant", "warmup_lr", "warmup_decay_lr", "warmup_cosine_lr", "one_cycle", "lr_range_test",
    "from_config",
]
