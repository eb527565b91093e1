"""Per-rank activation bytes of a decoder-only transformer's training step, by sequence length,
micro-batch, sequence-parallel size and compute dtype, with or without per-layer activation
checkpointing (`specs/mesh.md` §Sequence memory), and the Ulysses all-to-all bytes beside them.

Pure functions over numbers: no torch. The count is of what autograd saves for backward (each
storage once), op by op, as fnzero's GPT and transformers' Llama save it with torch's SDPA (flash)
kernels; `tests/test_activation_memory.py` measures it with `torch.autograd.graph.saved_tensors_hooks`.

    >>> gpt = TransformerShape(hidden=64, layers=2, heads=4, kv_heads=4, head_dim=16, intermediate=256,
    ...                        vocab=256, family="gpt")
    >>> a1 = activation_bytes(gpt, seq_len=1024, sp=1, dtype="bf16")
    >>> a4 = activation_bytes(gpt, seq_len=1024, sp=4, dtype="bf16")
    >>> round(a1.saved / a4.saved, 2)                    # a quarter of the tokens each; the output copy at sp > 1 costs a little
    3.82
"""

from __future__ import annotations

import dataclasses
from typing import Any

__all__ = ["ActivationBytes", "TransformerShape", "activation_bytes", "dtype_bytes", "longest_sequence",
           "ulysses_bytes"]

FAMILIES = ("gpt", "llama")
_DTYPE_BYTES = {"fp64": 8, "float64": 8, "fp32": 4, "float32": 4, "bf16": 2, "bfloat16": 2, "fp16": 2, "float16": 2}

# transformers model types whose layers are fnzero's GPT's kind (LayerNorm, one-matrix GELU MLP);
# other configs with `rms_norm_eps` are counted as Llama's kind (RMSNorm, gated MLP, rotary).
_GPT_KIND = ("gpt2", "gpt_neox", "gptj", "gpt_bigcode", "opt", "bloom", "falcon", "phi", "starcoder2")


@dataclasses.dataclass(frozen=True)
class TransformerShape:
    """What activation bytes depend on: widths, depth, heads, vocabulary, and the layer's kind.
    `family` "gpt": pre-LN LayerNorm, q|k|v, a GELU MLP of one hidden matrix, learned positions
    (fnzero's GPT); "llama": RMSNorm, separate q, k, v, rotary positions, a gated (SwiGLU) MLP."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    family: str = "llama"

    def __post_init__(self):
        for f in ("hidden", "layers", "heads", "kv_heads", "head_dim", "intermediate", "vocab"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"TransformerShape.{f} must be a positive integer, got {v!r}")
        if self.family not in FAMILIES:
            raise ValueError(f"TransformerShape.family must be one of {', '.join(FAMILIES)}, got {self.family!r}")

    @classmethod
    def from_config(cls, config: Any) -> "TransformerShape":
        """From fnzero's `GPTConfig` (d_model, n_layer, n_head, mlp_ratio) or a transformers config
        (hidden_size, num_hidden_layers, num_attention_heads, num_key_value_heads, head_dim,
        intermediate_size, vocab_size; a multimodal one's text config)."""
        if all(hasattr(config, k) for k in ("d_model", "n_layer", "n_head", "mlp_ratio")):
            return cls(config.d_model, config.n_layer, config.n_head, config.n_head, config.d_model // config.n_head,
                       config.mlp_ratio * config.d_model, config.vocab_size, "gpt")
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        missing = [k for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
                   if getattr(text, k, None) is None]
        if missing:
            raise ValueError(f"{type(config).__name__} is not a decoder-only transformer's config: it has no "
                             f"{', '.join(missing)}")
        h, heads = text.hidden_size, text.num_attention_heads
        kind = "gpt" if getattr(text, "model_type", "") in _GPT_KIND or not hasattr(text, "rms_norm_eps") else "llama"
        inter = getattr(text, "intermediate_size", None) or getattr(text, "n_inner", None) or 4 * h
        return cls(h, text.num_hidden_layers, heads, getattr(text, "num_key_value_heads", None) or heads,
                   getattr(text, "head_dim", None) or h // heads, inter, text.vocab_size, kind)


@dataclasses.dataclass(frozen=True)
class ActivationBytes:
    """One rank's activation bytes for one micro-batch. `layer`: what one layer saves (with
    checkpointing: its input only); `outside`: embedding indices, rotary tables, the final norm and
    the head's input; `loss`: the cross-entropy's log-softmax, target and weight; `recompute`: with
    checkpointing, one layer's full set, alive while backward recomputes it (0 without)."""

    layer: int
    layers: int
    outside: int
    loss: int
    recompute: int

    @property
    def saved(self) -> int:
        """Bytes held for backward when the forward (and loss) has run."""
        return self.layer * self.layers + self.outside + self.loss

    @property
    def peak(self) -> int:
        """`saved` plus the layer being recomputed (checkpointing); gradients and the logits the caller
        holds are not counted."""
        return self.saved + self.recompute


def dtype_bytes(dtype: Any) -> int:
    """Bytes per element of a compute dtype: a torch dtype or fp64, fp32, bf16, fp16."""
    size = getattr(dtype, "itemsize", None)
    if isinstance(size, int):
        return size
    if str(dtype) not in _DTYPE_BYTES:
        raise ValueError(f"compute dtype must be one of fp64, fp32, bf16, fp16 (or a torch dtype), got {dtype!r}")
    return _DTYPE_BYTES[str(dtype)]


def _check(shape: TransformerShape, seq_len: int, micro_batch: int, sp: int) -> None:
    for name, v in (("seq_len", seq_len), ("micro_batch", micro_batch), ("sp", sp)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive integer, got {v!r}")
    if seq_len % sp:
        raise ValueError(f"a sequence of {seq_len} tokens does not divide over {sp} sequence-parallel ranks")
    if shape.heads % sp or (shape.kv_heads % sp and sp % shape.kv_heads):
        raise ValueError(f"{shape.heads} attention heads and {shape.kv_heads} key/value heads do not spread over {sp} "
                         "sequence-parallel ranks by Ulysses alone (heads divisible by sp, kv heads dividing or divided "
                         "by it); training runs them with ring attention, whose activations this estimate does not "
                         "model yet")


def _norm(shape: TransformerShape, t: int, p: int, acc: int) -> int:
    """A norm's saved tensors, its output (the next matrix's input) included."""
    if shape.family == "gpt":  # LayerNorm: input, mean and rstd (accumulation dtype), output
        return 2 * t * shape.hidden * p + 2 * t * acc
    # transformers' RMSNorm: the float32 copy, rsqrt (float32), the copy cast back, the weighted output
    return t * shape.hidden * 4 + t * 4 + 2 * t * shape.hidden * p


def _layer(shape: TransformerShape, t: int, sp: int, p: int, acc: int) -> int:
    """Everything one layer saves for backward, without checkpointing."""
    hd = shape.heads * shape.head_dim
    kv = max(shape.kv_heads, sp)  # Ulysses repeats kv heads fewer than the ranks
    # q, k, v as the attention kernel saves them: at sp 1 views of the projections (GPT: one q|k|v
    # matrix), at sp > 1 the one tensor the all-to-all delivered; its output, and its log-sum-exp.
    attention = t * (shape.heads + 2 * kv) * shape.head_dim * p + t * hd * p + t * shape.heads * acc
    if sp > 1:  # the output's exchange back makes the out-projection's input a copy (at sp 1 a view)
        attention += t * hd * p
    # GPT: fc's output (GELU's input) and GELU's output; Llama: gate, up, silu(gate), silu(gate) * up.
    mlp = t * shape.intermediate * p * (2 if shape.family == "gpt" else 4)
    return 2 * _norm(shape, t, p, acc) + attention + mlp


def activation_bytes(shape: TransformerShape, *, seq_len: int, micro_batch: int = 1, sp: int = 1, dtype: Any = "bf16",
                     checkpointing: bool = False, loss: bool = True) -> ActivationBytes:
    """One rank's activation bytes for a micro-batch of `micro_batch` sequences of `seq_len` tokens
    split over `sp` Ulysses ranks (t = micro_batch * seq_len / sp tokens each), computed in `dtype`.
    `checkpointing`: every layer recomputed in backward (transformers' gradient checkpointing,
    `fnzero.remat` around each block). `loss`: the cross-entropy over the vocabulary counted (in
    float32 at least: transformers upcasts 16-bit logits)."""
    _check(shape, seq_len, micro_batch, sp)
    p = dtype_bytes(dtype)
    acc = max(p, 4)  # norms' statistics and attention's log-sum-exp accumulate in float32 at least
    t = micro_batch * seq_len // sp
    full = _layer(shape, t, sp, p, acc)
    outside = t * 8 + _norm(shape, t, p, acc)  # token indices (int64); the final norm and the head's input
    if shape.family == "gpt":
        outside += seq_len // sp * 8  # the learned positions' indices (one row, int64)
    else:
        outside += 2 * t * shape.head_dim * p  # rotary cos and sin, computed once for every layer
    lse = t * shape.vocab * acc + t * 8 + acc if loss else 0  # log-softmax, the targets, the total weight
    if checkpointing:
        return ActivationBytes(t * shape.hidden * p, shape.layers, outside, lse, full)
    return ActivationBytes(full, shape.layers, outside, lse, 0)


def ulysses_bytes(shape: TransformerShape, *, seq_len: int, micro_batch: int = 1, sp: int = 1,
                  dtype: Any = "bf16") -> int:
    """Bytes one rank sends in one layer's forward all-to-alls: q|k|v packed, then the output back,
    each to the sp - 1 other ranks (`specs/mesh.md` §Sequence). Backward sends the same again, and a
    checkpointed layer's recomputation one forward more."""
    _check(shape, seq_len, micro_batch, sp)
    t = micro_batch * seq_len // sp
    kv = max(shape.kv_heads, sp)
    per_rank = t * (2 * shape.heads + 2 * kv) * shape.head_dim * dtype_bytes(dtype)
    return per_rank * (sp - 1) // sp


def longest_sequence(shape: TransformerShape, memory: int, *, micro_batch: int = 1, sp: int = 1, dtype: Any = "bf16",
                     checkpointing: bool = False, loss: bool = True, limit: int = 1 << 40) -> int:
    """The longest sequence (a multiple of `sp`) whose `activation_bytes(...).peak` fits `memory`
    bytes; 0 when not even `sp` tokens fit. The bytes grow with the length, so a bisection finds it.

    >>> gpt = TransformerShape(64, 2, 4, 4, 16, 256, 256, "gpt")
    >>> s = longest_sequence(gpt, 2**30, sp=2)
    >>> activation_bytes(gpt, seq_len=s, sp=2).peak <= 2**30 < activation_bytes(gpt, seq_len=s + 2, sp=2).peak
    True
    """
    def fits(n: int) -> bool:
        return activation_bytes(shape, seq_len=n * sp, micro_batch=micro_batch, sp=sp, dtype=dtype,
                                checkpointing=checkpointing, loss=loss).peak <= memory

    _check(shape, sp, micro_batch, sp)
    lo, hi = 0, 1  # lengths in units of sp tokens: lo fits (or is 0), hi does not
    while fits(hi):
        lo, hi = hi, hi * 2
        if hi * sp > limit:
            raise ValueError(f"no bound below {limit} tokens: {memory} bytes is more than any length needs")
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo * sp
