"""Hypothesis strategies for sharded training code: awkward tensors and pytrees, small models,
valid configs, world sizes and batches (`specs/testing.md` §Strategies). Tensor values come from
a drawn seed: sharding bugs live in shapes and layouts, not in particular floats.
"""

from __future__ import annotations

import functools
from typing import Any, Sequence

import torch
from hypothesis import strategies as st

import fnzero

from ._factories import ModelFactory

__all__ = ["tensors", "pytrees", "models", "configs", "world_sizes", "batches"]

_SEEDS = st.integers(0, 2**31 - 1)


def _as_strategy(x: Any) -> st.SearchStrategy:
    return x if isinstance(x, st.SearchStrategy) else st.just(x)


def _values(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    return torch.randint(-100, 100, shape, generator=g).to(dtype)


def tensors(
    dtypes: Sequence[torch.dtype] = (torch.float32, torch.float64),
    *,
    max_dims: int = 3,
    min_side: int = 0,
    max_side: int = 9,
    shapes: st.SearchStrategy | None = None,
) -> st.SearchStrategy[torch.Tensor]:
    """Tensors of awkward shapes: 0-dim scalars, empty tensors (a side of 0 unless `min_side`>0),
    numel below any world size, odd and prime sides. Values are standard normal (floats) or small
    integers, drawn from a seed."""
    shape_st = shapes if shapes is not None else st.lists(st.integers(min_side, max_side), max_size=max_dims).map(tuple)
    return st.builds(_values, shape_st, st.sampled_from(list(dtypes)), _SEEDS)


_KEYS = st.text(alphabet="abcdefwxyz_", min_size=1, max_size=5)


def pytrees(
    leaves: st.SearchStrategy | None = None,
    *,
    max_leaves: int = 8,
    allow_empty: bool = True,
    allow_none: bool = False,
) -> st.SearchStrategy[Any]:
    """Nested dicts, lists and tuples of `leaves` (default: `tensors()`), including empty
    containers and a bare leaf as the whole tree. `allow_none` adds None leaves (fnzero treats
    None as a leaf)."""
    base = leaves if leaves is not None else tensors()
    if allow_none:
        base = base | st.none()
    if allow_empty:
        base = base | st.sampled_from([{}, [], ()]).map(lambda e: type(e)())
    return st.recursive(
        base,
        lambda kids: st.lists(kids, max_size=3)
        | st.lists(kids, max_size=3).map(tuple)
        | st.dictionaries(_KEYS, kids, max_size=3),
        max_leaves=max_leaves,
    )


@st.composite
def _mlp(draw, max_width: int, max_layers: int, frozen: bool | None, dtype: torch.dtype):
    sizes = tuple(draw(st.lists(st.integers(1, max_width), min_size=2, max_size=max_layers + 1)))
    names = [f"layers.{i}.{w}" for i in range(len(sizes) - 1) for w in ("weight", "bias")]
    freeze = draw(st.booleans()) if frozen is None else frozen
    chosen: tuple[str, ...] = ()
    if freeze and len(names) > 1:  # keep at least one trainable parameter
        chosen = (draw(st.sampled_from(names)),)
    return ModelFactory("mlp", sizes=sizes, frozen=chosen, dtype=dtype, seed=draw(_SEEDS))


@st.composite
def _gpt(draw, tied: bool | None, frozen: bool | None, dtype: torch.dtype):
    n_head = draw(st.integers(1, 3))
    # d_model >= 4: LayerNorm over 1 or 2 features is (almost) constant, so every parameter before
    # it gets a true gradient of ~0, and Adam turns the rounding noise of that ~0 into steps of
    # ~1e-9: a model that tests float64 noise, not sharding.
    cfg = dict(
        vocab_size=draw(st.integers(3, 40)),
        seq_len=draw(st.integers(1, 8)),
        d_model=n_head * draw(st.integers(-(-4 // n_head), 4)),
        n_layer=draw(st.integers(1, 2)),
        n_head=n_head,
        mlp_ratio=draw(st.integers(1, 2)),
        tied=draw(st.booleans()) if tied is None else tied,
    )
    freeze = draw(st.booleans()) if frozen is None else frozen
    chosen = (draw(st.sampled_from(["wpe.weight", "ln_f.weight", "blocks.0.ln1.bias"])),) if freeze else ()
    return ModelFactory("gpt", gpt=tuple(sorted(cfg.items())), frozen=chosen, dtype=dtype, seed=draw(_SEEDS))


def models(
    kinds: Sequence[str] = ("mlp", "gpt"),
    *,
    tied: bool | None = None,
    frozen: bool | None = None,
    dtype: torch.dtype = torch.float64,
    max_width: int = 9,
    max_layers: int = 3,
) -> st.SearchStrategy[ModelFactory]:
    """`ModelFactory`s: MLPs of drawn widths (1..max_width, down to a single element) and small
    GPTs (drawn vocab, context, width, heads, layers). `tied=None` draws whether a GPT's head is
    tied to its embedding (True: GPTs only); `frozen=None` draws whether one parameter is frozen.
    Each factory builds an identical model on every call: pass it where one copy per rank is built.
    """
    if tied:
        kinds = ["gpt"]
    options = []
    if "mlp" in kinds:
        options.append(_mlp(max_width, max_layers, frozen, dtype))
    if "gpt" in kinds:
        options.append(_gpt(tied, frozen, dtype))
    if not options:
        raise ValueError(f"kinds must include 'mlp' or 'gpt', got {list(kinds)}")
    return st.one_of(options)


_PRECISION_BLOCKS = {
    "fp32": {},
    # A small initial scale: the default 2**16 would skip the first steps of a tiny model on overflow.
    "fp16": {"fp16": {"enabled": True, "initial_scale_power": 8}},
    "bf16": {"bf16": {"enabled": True}},
}


def _config(stage, precision, k, clip, optimizer, persistence, micro, lr):
    d = {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": k,
        "gradient_clipping": clip,
        "optimizer": {"type": optimizer, "params": {"lr": lr}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": persistence},
        **_PRECISION_BLOCKS[precision],
    }
    if optimizer in ("Adam", "AdamW"):
        d["optimizer"]["params"].update(betas=[0.9, 0.95], eps=1e-8, weight_decay=0.1)
    return fnzero.load_config(d, world_size=1)


def configs(
    stages: Sequence[int] = (0, 1, 2, 3),
    *,
    precisions: Sequence[str] = ("fp32",),
    accumulation: Sequence[int] | st.SearchStrategy = (1, 2, 3),
    clipping: Sequence[float] | st.SearchStrategy = (0.0, 0.05, 1.0),
    optimizers: Sequence[str] = ("AdamW",),
    persistence: Sequence[int] = (0,),
    micro_batch: int | st.SearchStrategy = 2,
    lr: float = 1e-2,
) -> st.SearchStrategy[fnzero.Config]:
    """Valid `fnzero.Config`s (through `fnzero.load_config`, world size 1) for every combination of
    ZeRO stage, precision ("fp32", "fp16", "bf16"), gradient accumulation steps, clipping (0: off),
    optimizer and stage-3 persistence threshold (0: every unit sharded). Sequences are sampled;
    hypothesis strategies are drawn. `assert_stage_equivalent` re-derives batch sizes for its world.
    """
    def pick(x):
        return x if isinstance(x, st.SearchStrategy) else st.sampled_from(list(x))

    bad = set(precisions) - set(_PRECISION_BLOCKS)
    if bad:
        raise ValueError(f"unknown precisions {sorted(bad)}; choose from {sorted(_PRECISION_BLOCKS)}")
    return st.builds(
        _config, pick(stages), pick(precisions), pick(accumulation), pick(clipping), pick(optimizers),
        pick(persistence), _as_strategy(micro_batch), st.just(lr),
    )


def world_sizes(lo: int = 1, hi: int = 8) -> st.SearchStrategy[int]:
    """World sizes from `lo` to `hi`, shrinking towards `lo`."""
    if lo < 1 or hi < lo:
        raise ValueError(f"need 1 <= lo <= hi, got lo={lo}, hi={hi}")
    return st.integers(lo, hi)


def _tokens(rows, seq, vocab, seed):
    g = torch.Generator().manual_seed(seed)
    t = torch.randint(0, vocab, (rows, seq + 1), generator=g)
    return {"x": t[:, :-1].contiguous(), "y": t[:, 1:].contiguous()}


@functools.lru_cache(maxsize=1)
def _corpus() -> bytes:
    from ._data import text_corpus

    return text_corpus()  # ~1 MB read once, not per drawn example


def _text(rows, seq, seed):
    from ._data import token_batches

    return next(token_batches(rows, seq, seed=seed, text=_corpus()))


def _features(rows, features, targets, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return {
        "x": torch.randn(rows, features, generator=g, dtype=torch.float64).to(dtype),
        "y": torch.randn(rows, targets, generator=g, dtype=torch.float64).to(dtype),
    }


def batches(
    *,
    vocab: int | None = None,
    seq: int | None = None,
    rows: int | st.SearchStrategy = st.integers(1, 4),
    text: bool = False,
    features: int | None = None,
    targets: int = 1,
    dtype: torch.dtype = torch.float64,
) -> st.SearchStrategy[dict[str, torch.Tensor]]:
    """Global batches `{"x", "y"}` with `rows` rows (any count: `assert_stage_equivalent` extends
    a batch cyclically to a multiple of world size x accumulation).

    Tokens: `vocab` and `seq` give `x` (rows, seq) int64 and `y` = `x` shifted by one; `text=True`
    takes byte windows of real prose (`token_batches`, vocab 256) instead of uniform tokens.
    Features: `features` (and `targets`) give float `x` (rows, features) and `y` (rows, targets).
    """
    rows_st = _as_strategy(rows)
    if features is not None:
        return st.builds(_features, rows_st, st.just(features), st.just(targets), st.just(dtype), _SEEDS)
    if seq is None:
        raise ValueError("batches needs seq= (token batches) or features= (float batches)")
    if text:
        if vocab not in (None, 256):
            raise ValueError(f"text batches are bytes: vocab is 256, got {vocab}")
        return st.builds(_text, rows_st, st.just(seq), _SEEDS)
    if vocab is None:
        raise ValueError("token batches need vocab=")
    return st.builds(_tokens, rows_st, st.just(seq), st.just(vocab), _SEEDS)
