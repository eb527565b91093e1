"""Scalar sinks for `Monitor`: DeepSpeed's csv_monitor file layout and TensorBoard event files.

Both take DeepSpeed-style events `(name, value, x)` with names like `Train/Samples/train_loss`.
"""

from __future__ import annotations

import csv
import os

__all__ = ["CsvWriter", "TensorboardWriter", "TENSORBOARD_HINT"]

TENSORBOARD_HINT = (
    "`tensorboard.enabled` is true but torch.utils.tensorboard cannot be imported ({err}); "
    "install the optional dependency with `pip install tensorboard`, or set `tensorboard.enabled` to false"
)


class CsvWriter:
    """One CSV file per scalar under `output_path/job_name/`, like DeepSpeed's csvMonitor: the name
    `Train/Samples/train_loss` goes to `Train_Samples_train_loss.csv` with header `step,train_loss`.

    Files are appended to (a resumed run continues them; `specs/monitor.md`).

    >>> import tempfile, pathlib
    >>> d = tempfile.mkdtemp()
    >>> w = CsvWriter(d, "job"); w.write([("Train/Samples/train_loss", 2.5, 8)]); w.close()
    >>> (pathlib.Path(d) / "job" / "Train_Samples_train_loss.csv").read_text().split()
    ['step,train_loss', '8,2.5']
    """

    def __init__(self, output_path: str, job_name: str):
        self.log_dir = os.path.join(output_path, job_name)
        os.makedirs(self.log_dir, exist_ok=True)
        self._files: dict[str, tuple] = {}

    def _writer(self, name: str):
        if name not in self._files:
            fname = os.path.join(self.log_dir, name.replace("/", "_").replace(" ", "_") + ".csv")
            new = not os.path.exists(fname) or os.path.getsize(fname) == 0
            # newline="": the csv module writes its own line endings.
            f = open(fname, "a", newline="")
            w = csv.writer(f)
            if new:
                w.writerow(["step", name.rsplit("/", 1)[-1]])
            self._files[name] = (f, w)
        return self._files[name][1]

    def write(self, events) -> None:
        for name, value, x in events:
            self._writer(name).writerow([x, value])

    def flush(self) -> None:
        for f, _ in self._files.values():
            f.flush()

    def close(self) -> None:
        for f, _ in self._files.values():
            f.close()
        self._files.clear()


def _summary_writer(log_dir: str):
    # Imported lazily: tensorboard is optional and `torch.utils.tensorboard` fails to import without it.
    from torch.utils.tensorboard import SummaryWriter

    return SummaryWriter(log_dir=log_dir)


def check_tensorboard() -> None:
    """Raise ImportError naming the pip package when TensorBoard logging cannot work here."""
    try:
        import torch.utils.tensorboard  # noqa: F401
    except ImportError as e:
        raise ImportError(TENSORBOARD_HINT.format(err=e)) from e


class TensorboardWriter:
    """Scalars into TensorBoard event files under `output_path/job_name` (`runs/job_name` when
    output_path is empty)."""

    def __init__(self, output_path: str, job_name: str):
        self.log_dir = os.path.join(output_path or "runs", job_name)
        self._w = _summary_writer(self.log_dir)

    def write(self, events) -> None:
        for name, value, x in events:
            self._w.add_scalar(name, value, x)

    def flush(self) -> None:
        self._w.flush()

    def close(self) -> None:
        self._w.close()
