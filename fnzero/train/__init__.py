"""Training: the pure step `(state, batch) -> (state, metrics)` and what transforms it.

    train_step / TrainStep     the eager step (`_step.py`), one phase per placement decision
    jit / JittedStep           torch.compile of a step: per unit, the loss, or the whole step
                               (`_jit.py`, `_whole_step.py`; `specs/jit.md`)
    remat                      activation checkpointing as a function transform (`sharding/_remat.py`)
    loss scaling               fp16 dynamic loss scale (`_loss_scale.py`; `specs/loss-scaling.md`)
    policies                   what the step reads from a config, once (`_policy.py`)
"""

from __future__ import annotations

from ._jit import CompileRecord, JittedStep, JitWarning, jit
from ..sharding.zero._remat import remat
from ._step import TrainStep, split_micro_batches, train_step

__all__ = ["CompileRecord", "JittedStep", "JitWarning", "TrainStep", "jit", "remat", "split_micro_batches", "train_step"]
