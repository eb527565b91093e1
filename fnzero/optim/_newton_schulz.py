"""Newton–Schulz orthogonalisation as DeepSpeed 0.19.8's Muon computes it
(runtime/zero/muon/original_muon.py), "standard" or "gram", over the last two dimensions; the
compute dtype is fnzero's (float64 for float64, else float32: specs/optim.md §Muon)."""

from __future__ import annotations

import torch

__all__ = ["NS_COEFFICIENTS", "NS_METHODS", "ns_compute_dtype", "orthogonalize"]

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_METHODS = ("gram", "standard")
_NORM_EPS = 1e-7  # added to the Frobenius norm before dividing, as DeepSpeed
_GRAM_RESTART = 2  # the iteration at which Gram NS rebuilds X from Q, as DeepSpeed


def ns_compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the iteration runs in for an update of `dtype`."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _standard(x: torch.Tensor, steps: int) -> torch.Tensor:
    a, b, c = NS_COEFFICIENTS
    for _ in range(steps):
        gram = x @ x.mT
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x


def _gram(x: torch.Tensor, steps: int) -> torch.Tensor:
    """The iteration on R = X X^T (rows x rows), accumulating the polynomial in Q; X = Q X at
    the restart and at the end. Equal to `_standard` in exact arithmetic."""
    a, b, c = NS_COEFFICIENTS
    eye = torch.eye(x.size(-2), dtype=x.dtype, device=x.device)
    r, q = x @ x.mT, None
    for i in range(steps):
        if i == _GRAM_RESTART:
            x = q @ x
            r, q = x @ x.mT, None
        z = b * r + c * r @ r
        q = z + a * eye if q is None else a * q + z @ q
        if i < steps - 1 and i + 1 != _GRAM_RESTART:
            rz = a * r + z @ r
            r = a * rz + z @ rz
    return q @ x


def orthogonalize(g: torch.Tensor, steps: int = 5, method: str = "gram") -> torch.Tensor:
    """`g` (>= 2-D; leading dimensions are a batch) mapped close to U V^T of its SVD by `steps`
    Newton–Schulz iterations, in `ns_compute_dtype(g.dtype)`. "gram" iterates on the Gram
    matrix where the (wide) matrix has more columns than rows, else as "standard"."""
    tall = g.size(-2) > g.size(-1)
    x = g.to(ns_compute_dtype(g.dtype))
    if tall:
        x = x.mT
    x = x / (torch.linalg.matrix_norm(x, keepdim=True) + _NORM_EPS)
    if method == "gram" and x.size(-1) > x.size(-2):
        x = _gram(x, steps)
    else:
        x = _standard(x, steps)
    return x.mT if tall else x
