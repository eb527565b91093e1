"""A Hugging Face Trainer's `checkpoint-N/` around a DeepSpeed checkpoint: its own counts checked
against DeepSpeed's when `load` resumes from it (`specs/checkpoint-format.md` §DeepSpeed,
"Resuming in fnzero", "A Hugging Face Trainer's directory").

The Trainer writes `trainer_state.json` (plain JSON; `global_step`: the optimizer steps it took,
overflow-skipped ones included) and, when the schedule is its own (a torch `LambdaLR`, not one of
DeepSpeed's config), `scheduler.pt` (the scheduler's state dict; `last_epoch`: the steps it was
stepped, which DeepSpeed's engine does once per applied step). Both are read (the second with the
weights-only reader, `_ds_pickle.py`); `training_args.bin` and `rng_state*.pth` never are.
"""

from __future__ import annotations

import json
import os
import warnings

from .._errors import CheckpointError
from ._ds_pickle import load_ds_file
from ._safe import entry_kind, read_small

__all__ = ["TrainerStateWarning", "check_trainer_dir"]

_STATE_BYTES = 256 << 20  # trainer_state.json holds the whole log history


class TrainerStateWarning(UserWarning):
    """The Trainer's step count is not DeepSpeed's (fnzero resumes DeepSpeed's)."""


def check_trainer_dir(root: str, global_steps: int, applied: int) -> None:
    """`root` (the directory holding the tag) checked where it is a Trainer's: its `global_step`
    against DeepSpeed's `global_steps` (a `TrainerStateWarning` naming both), its `scheduler.pt`
    position against the `applied` optimizer steps (a `CheckpointError` naming both)."""
    if entry_kind(os.path.join(root, "trainer_state.json")) is None:
        return
    state = _trainer_state(root)
    step = state.get("global_step")
    if type(step) is not int:
        raise CheckpointError(f"{os.path.join(root, 'trainer_state.json')}: 'global_step' should be an int, "
                              f"not {step!r}")
    if step != global_steps:
        warnings.warn(f"{root}: the Trainer's global_step {step} (trainer_state.json) is not DeepSpeed's "
                      f"global_steps {global_steps}; fnzero resumes DeepSpeed's count ({applied} applied "
                      f"optimizer steps), so a data position taken from the Trainer's would not match it",
                      TrainerStateWarning, stacklevel=4)
    if entry_kind(os.path.join(root, "scheduler.pt")) is not None:
        _check_scheduler(root, applied)


def _trainer_state(root: str) -> dict:
    where = os.path.join(root, "trainer_state.json")
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        raw = read_small("trainer_state.json", fd, where, _STATE_BYTES)
    finally:
        os.close(fd)
    try:
        state = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{where}: not JSON ({str(e)[:120]})") from None
    if not isinstance(state, dict):
        raise CheckpointError(f"{where}: a JSON {type(state).__name__}, not the Trainer's state object")
    return state


def _check_scheduler(root: str, applied: int) -> None:
    """A torch scheduler starts at `last_epoch` 0 (`_step_count` 1) and is stepped after each
    applied optimizer step; fnzero's schedule is a function of that step, so another position is
    a run that the files do not describe at one point."""
    where = os.path.join(root, "scheduler.pt")
    sd = load_ds_file(root, "scheduler.pt")
    if not isinstance(sd, dict):
        raise CheckpointError(f"{where}: not a scheduler's state dict (a {type(sd).__name__})")
    for key, want in (("last_epoch", applied), ("_step_count", applied + 1)):
        got = sd.get(key)
        if got is None:
            continue
        if type(got) is not int:
            raise CheckpointError(f"{where}: '{key}' should be an int, not {got!r}")
        if got != want:
            raise CheckpointError(f"{where}: the Trainer's schedule has {key} {got}, but the optimizer took "
                                  f"{applied} steps ({key} {want} expected); fnzero's schedule is a function of "
                                  "the step and cannot resume another position")
