"""`SaveHandle`: what `save` returns, a save's outcome that a caller may wait for. Apart from the
save protocol (`_save.py`) so that the saves one rank of a group writes for the group
(`_mics.py`) can hand the other ranks a finished one without importing the protocol that calls
them."""

from __future__ import annotations

import os
import threading

from .._errors import CheckpointError

__all__ = ["SaveHandle"]


class SaveHandle:
    """The result of `save`. `wait()` blocks until the checkpoint is committed (every rank's data
    durable, index and `latest` in place) and re-raises a failure; `done()` does not block."""

    def __init__(self, path: str, tag: str):
        self.path, self.tag = path, tag
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._finished = threading.Event()

    def _run(self, fn) -> None:
        try:
            fn()
        except BaseException as e:  # noqa: BLE001 - handed to wait()
            self._error = e
        finally:
            self._finished.set()

    def done(self) -> bool:
        return self._finished.is_set()

    def wait(self, timeout: float | None = None) -> str:
        """Block until committed; returns the checkpoint directory."""
        if not self._finished.wait(timeout):
            raise CheckpointError(f"save of {self.tag!r} did not finish within {timeout}s")
        if self._error is not None:
            err = self._error
            if isinstance(err, CheckpointError):
                raise err
            raise CheckpointError(f"saving checkpoint {self.tag!r} failed: {type(err).__name__}: {err}") from err
        return os.path.join(self.path, self.tag)

    def __repr__(self):
        return f"SaveHandle({self.path!r}, tag={self.tag!r}, done={self.done()})"
