"""`fnzero.checkpoint.load`: one call resumes fnzero's own checkpoints (`_load.py`) and DeepSpeed's
(`_ds_resume.py`), told apart by their files (`specs/checkpoint-format.md` §Loading, §DeepSpeed
"Resuming in fnzero"). Its own module so that neither reader imports the other.
"""

from __future__ import annotations

import os
from typing import Any

from .._state import TrainState
from ._ds_layout import is_deepspeed
from ._ds_resume import load_deepspeed
from ._load import load as load_fnzero

__all__ = ["load"]


def load(
    path: str | os.PathLike,
    like: TrainState,
    *,
    tag: str | None = None,
    verify: bool = True,
    restore_rng: bool = True,
    keep_frozen: bool = False,
    config=None,
) -> tuple[TrainState, Any]:
    """Read checkpoint `path/tag` (default: `latest`) into a state laid out like `like`; returns
    `(state, client_state)`. Any world size, stage and precision of the same model; every rank calls
    it (no collectives). `verify` checks crc32 of every segment read. `restore_rng` sets torch's CPU
    (and CUDA) generator to the state saved by rank `rank % saved_world_size`. `keep_frozen`: keep
    `like`'s frozen parameters instead of reading them (a checkpoint saved with
    `exclude_frozen_parameters`, into a state whose frozen weights are the base model's).

    A DeepSpeed checkpoint directory (`global_stepN/`, or the directory whose `latest` names it) of
    an Adam/AdamW run at ZeRO stage 0-3 in fp32, bf16 or fp16 (a PipelineModule's, a MoE model's too)
    is read too, as DeepSpeed would resume it: `client_state` is what its `save_checkpoint` was given; its files hold no checksums (`verify`)
    and no RNG state (`restore_rng`). An fp16 run's loss scaler becomes the state's loss scale;
    `config`, the one the step will run (optional, DeepSpeed checkpoints only), has its fp16 block
    checked against the scaler's policy, which DeepSpeed would resume. A DeepSpeed universal checkpoint
    (`ds_to_universal`'s or `to_deepspeed_universal`'s: its `latest_universal`, or read first where
    `config.checkpoint.load_universal` is set) resumes at any world size, stage and tensor-parallel
    mesh; its frozen parameters are `like`'s own, as DeepSpeed takes them from the model."""
    if isinstance(like, TrainState) and is_deepspeed(path):
        return load_deepspeed(path, like, tag=tag, keep_frozen=keep_frozen, config=config)
    return load_fnzero(path, like, tag=tag, verify=verify, restore_rng=restore_rng, keep_frozen=keep_frozen)
