"""Model factories: a zero-argument callable that builds the same model every time it is called
(sharded tests build one copy per rank), with a loss and a batch that fit it."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ._context import seeded
from ._models import GPT, MLP, GPTConfig

__all__ = ["ModelFactory"]


@dataclasses.dataclass(frozen=True)
class ModelFactory:
    """`factory()` -> a fresh `nn.Module`, identical on every call (it seeds torch's RNG itself,
    under the simulated world's RNG lock, so concurrent ranks get the same weights).

    kind: "mlp" (`sizes` are the layer widths) or "gpt" (`gpt` holds GPTConfig keywords).
    tied: the GPT's head shares the embedding. frozen: state_dict names of parameters built
    with requires_grad=False. `loss(apply, batch)` and `batch(rows, seed)` fit the model.
    """

    kind: str
    sizes: tuple[int, ...] = ()
    gpt: tuple[tuple[str, Any], ...] = ()
    frozen: tuple[str, ...] = ()
    dtype: torch.dtype = torch.float64
    seed: int = 0

    def __call__(self) -> nn.Module:
        with seeded(self.seed):
            model = MLP(list(self.sizes)) if self.kind == "mlp" else GPT(GPTConfig(**dict(self.gpt)))
        named = dict(model.named_parameters())
        for name in self.frozen:
            named[name].requires_grad_(False)
        return model.to(self.dtype)

    @property
    def tied(self) -> bool:
        return bool(dict(self.gpt).get("tied", False))

    def loss(self, apply, batch) -> torch.Tensor:
        """Mean squared error (MLP) or next-token cross-entropy (GPT): a mean over rows, as the
        equivalence with one process on the concatenated batch requires."""
        out = apply(batch["x"])
        if self.kind == "mlp":
            return F.mse_loss(out.to(batch["y"].dtype), batch["y"])
        return F.cross_entropy(out.flatten(0, -2).to(torch.float64 if out.dtype == torch.float64 else torch.float32), batch["y"].flatten())

    def batch(self, rows: int, seed: int = 0) -> dict[str, torch.Tensor]:
        """A batch of `rows` examples for this model (deterministic in `seed`)."""
        g = torch.Generator().manual_seed(seed)
        if self.kind == "mlp":
            x = torch.randn(rows, self.sizes[0], generator=g, dtype=torch.float64).to(self.dtype)
            y = torch.randn(rows, self.sizes[-1], generator=g, dtype=torch.float64).to(self.dtype)
            return {"x": x, "y": y}
        c = dict(self.gpt)
        tokens = torch.randint(0, c["vocab_size"], (rows, c["seq_len"] + 1), generator=g)
        return {"x": tokens[:, :-1].contiguous(), "y": tokens[:, 1:].contiguous()}

    def __repr__(self) -> str:
        if self.kind == "mlp":
            desc = f"MLP{list(self.sizes)}"
        else:
            desc = "GPT(" + ", ".join(f"{k}={v}" for k, v in self.gpt) + ")"
        extra = f", frozen={list(self.frozen)}" if self.frozen else ""
        return f"ModelFactory({desc}{extra}, {str(self.dtype).removeprefix('torch.')})"
