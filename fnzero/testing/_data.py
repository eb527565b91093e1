"""Real text that ships with Python, as byte-level token batches."""

from __future__ import annotations

import torch

__all__ = ["text_corpus", "token_batches"]


def text_corpus() -> bytes:
    """English prose from Python's own documentation (`pydoc_data.topics`, ~1 MB, ships with CPython)."""
    from pydoc_data import topics

    return "\n\n".join(topics.topics[k] for k in sorted(topics.topics)).encode("utf-8")


def token_batches(batch_size: int, seq_len: int, *, seed: int = 0, text: bytes | None = None, split: str = "train"):
    """An endless iterator of `{"x": (B, T) int64, "y": (B, T) int64}` byte-level windows (vocab 256).

    The last 10% of the text is the validation split. The same seed gives the same batches.
    """
    data = torch.frombuffer(bytearray(text if text is not None else text_corpus()), dtype=torch.uint8).to(torch.int64)
    cut = int(len(data) * 0.9)
    data = data[:cut] if split == "train" else data[cut:]
    g = torch.Generator().manual_seed(seed)
    while True:
        starts = torch.randint(0, len(data) - seq_len - 1, (batch_size,), generator=g)
        window = torch.stack([data[s : s + seq_len + 1] for s in starts.tolist()])
        yield {"x": window[:, :-1].contiguous(), "y": window[:, 1:].contiguous()}
