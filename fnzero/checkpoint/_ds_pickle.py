"""DeepSpeed's `torch.save` files read without DeepSpeed and without running anything from them
(`specs/checkpoint-format.md` §DeepSpeed, "Reading the files").

torch's own weights-only unpickler does the reading: it admits tensors, storages, dtypes and plain
containers, and calls nothing else. The few DeepSpeed classes a checkpoint holds are admitted by
their qualified name and built as fnzero's plain-data stand-ins below, so DeepSpeed is never
imported; any other global is a `CheckpointError` naming the file and the global. The files are
opened as `_safe.py` opens fnzero's own (no links below the root, regular files only) and mapped
(`mmap`), so a tensor's bytes are read only when used.
"""

from __future__ import annotations

import os
import pickle
import re
import threading
import zipfile

import torch

from .._errors import CheckpointError
from ._safe import open_file

__all__ = ["load_ds_file", "LossScalerState", "FragmentAddress", "SubparamShapeData"]


class _Data:
    """A DeepSpeed object's attributes as plain data: pickle's BUILD sets them, nothing runs."""

    def __setstate__(self, state) -> None:
        if isinstance(state, tuple) and len(state) == 2:  # (dict, slots), as pickle's own BUILD
            state = {**(state[0] or {}), **(state[1] or {})}
        if not isinstance(state, dict):
            raise pickle.UnpicklingError(f"{type(self).__name__}: state is a {type(state).__name__}, not a dict")
        self.__dict__.update(state)

    def get(self, key, default=None):
        return self.__dict__.get(key, default)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.__dict__})"


class LossScalerState(_Data):
    """`deepspeed.runtime.fp16.loss_scaler.LossScaler` / `DynamicLossScaler`: `cur_scale`,
    `dynamic`, and for the dynamic one `cur_iter`, `scale_window`, ..."""


class FragmentAddress(_Data):
    """`deepspeed.utils.tensor_fragment.fragment_address`: `numel`, `start` in a rank's partition."""


class SubparamShapeData(_Data):
    """`deepspeed.checkpoint.universal_checkpoint.SubparamShape` (`patterns`, `shape`,
    `partition_dim`): how DeepSpeed re-cuts a fused parameter of a universal checkpoint for tensor
    parallelism. The tensor beside it is whole, which is all fnzero reads."""


def _zero_stage(value):
    """`deepspeed.runtime.zero.config.ZeroStageEnum(value)` as the int it wraps."""
    if type(value) is not int or value not in (0, 1, 2, 3):
        raise pickle.UnpicklingError(f"ZeroStageEnum({value!r}) is not a ZeRO stage")
    return value


_DEEPSPEED_GLOBALS = [
    (_zero_stage, "deepspeed.runtime.zero.config.ZeroStageEnum"),
    (LossScalerState, "deepspeed.runtime.fp16.loss_scaler.LossScaler"),
    (LossScalerState, "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler"),
    (FragmentAddress, "deepspeed.utils.tensor_fragment.fragment_address"),
    (SubparamShapeData, "deepspeed.checkpoint.universal_checkpoint.SubparamShape"),
]
# torch's allowlist (`safe_globals`) is one set for the process, put back as it was on exit: ranks
# that are threads of one process (`fnzero.testing.simulated_world`) load one file at a time, or
# one rank's exit would take the names away while another still reads.
_ALLOWLIST_LOCK = threading.Lock()
_GLOBAL = re.compile(r"GLOBAL ([\w.]+)|unrecognized function ([^\s]+)|got <class '([\w.]+)'>|whose module ([\w.]+)")


def _refusal(where: str, e: Exception) -> CheckpointError:
    text = str(e)
    m = _GLOBAL.search(text)
    if m:
        name = next(g for g in m.groups() if g)
        return CheckpointError(f"{where}: refuses to load the global {name!r} (fnzero admits tensors, plain "
                               f"containers and DeepSpeed's loss scaler, ZeRO stage, fragment address and "
                               f"sub-parameter shape only; "
                               f"nothing from the file was run)")
    first = text.strip().splitlines()[0][:200] if text.strip() else type(e).__name__
    return CheckpointError(f"{where}: not a readable torch.save file ({first})")


def _check_zip(fd: int, size: int, where: str) -> None:
    """A torch zip archive whose central directory reads (a truncated one does not)."""
    with os.fdopen(os.dup(fd), "rb") as f:
        if size < 22 or f.read(4) != b"PK\x03\x04":
            raise CheckpointError(f"{where}: not a torch zip archive (truncated, or not written by torch.save)")
        try:
            f.seek(0)
            names = zipfile.ZipFile(f).namelist()
        except (zipfile.BadZipFile, OSError, ValueError) as e:
            raise CheckpointError(f"{where}: damaged zip archive ({e}); the file is truncated or corrupt") from None
    if not any(n.endswith("/data.pkl") for n in names):
        raise CheckpointError(f"{where}: a zip archive without data.pkl, not a torch.save file")


def load_ds_file(directory: str, name: str, dir_fd: int | None = None):
    """The object `torch.save` stored in `directory/name`, read as above."""
    where = os.path.join(directory, name)
    own_fd = dir_fd is None
    if own_fd:
        dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        fd, size = open_file(name, dir_fd, where)
    except FileNotFoundError:
        raise CheckpointError(f"{where}: missing") from None
    finally:
        if own_fd:
            os.close(dir_fd)
    try:
        _check_zip(fd, size, where)
        # The descriptor opened without following links is what torch reads, through its /proc name.
        path = f"/proc/self/fd/{fd}" if os.path.exists(f"/proc/self/fd/{fd}") else where
        with _ALLOWLIST_LOCK, torch.serialization.safe_globals(_DEEPSPEED_GLOBALS):
            return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except CheckpointError:
        raise
    except (pickle.UnpicklingError, RuntimeError, ValueError, TypeError, EOFError, KeyError, AttributeError,
            IndexError, OSError) as e:
        raise _refusal(where, e) from None
    finally:
        os.close(fd)
