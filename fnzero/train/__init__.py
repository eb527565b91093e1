"""Training: the pure step `(state, batch) -> (state, metrics)` and what transforms it.

    train_step / TrainStep     the eager step (`_step.py`), one phase per placement decision
    jit / JittedStep           torch.compile of a step: per unit, the loss, or the whole step
                               (`_jit.py`, `_whole_step.py`; `specs/jit.md`)
    remat                      activation checkpointing as a function transform (`sharding/zero/_remat.py`)

The first state, the optimizer a step runs, its loss scaling and the policies it reads from a
config are the state layer's (`fnzero/state/`), below this one.
"""

from __future__ import annotations

from ._jit import CompileRecord, JittedStep, JitWarning, jit
from ..sharding import remat
from ._step import TrainStep, split_micro_batches, train_step

__all__ = ["CompileRecord", "JittedStep", "JitWarning", "TrainStep", "jit", "remat", "split_micro_batches", "train_step"]
