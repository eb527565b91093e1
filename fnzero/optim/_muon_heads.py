"""Which parameters DeepSpeed 0.19.8's `per_head_muon` orthogonalises per attention head, and into
how many heads (deepspeed/__init__.py `set_optimizer_flags`; specs/optim.md §Muon), read once from
the model (`muon_head_counts`) and handed to the chain as data."""

from __future__ import annotations

from typing import Any

from fnzero._errors import ConfigError

from ._muon import uses_muon

__all__ = ["muon_head_counts"]

# A projection whose rows are blocked by heads: Q, K, V, and MLA's two up-projections. The output
# projection is not (its heads are on its input dimension). Matched on the leaf module's name.
_QUERY = ("q_proj", "query", "wq")
_KV = ("k_proj", "key", "wk", "v_proj", "value", "wv")
_MLA_Q, _MLA_KV = ("q_b_proj",), ("kv_b_proj",)
# A fused QKV matrix, or an MLA down-projection: not uniform heads, so the full-matrix path.
_NOT_HEAD_BLOCKED = ("qkv_proj", "query_key_value", "c_attn", "in_proj_qkv", "wqkv", "q_a_proj", "kv_a_proj",
                     "kv_a_proj_with_mqa")
# AutoTPMeta's probe order for the head counts (module_inject/tp_shard.py).
_HEAD_ATTRS = ("num_attention_heads", "num_heads", "n_heads", "n_head", "attention_heads")
_KV_HEAD_ATTRS = ("num_key_value_heads", "num_kv_heads", "multi_query_group_num")


def _first(config: Any, names: tuple[str, ...]) -> Any:
    for name in names:
        value = getattr(config, name, None)
        if value is not None:
            return value
    return None


def _kind(leaf: str) -> str | None:
    """The attention matrix the leaf module's name claims to be (DeepSpeed's `_classify_leaf`)."""
    def claims(names):
        return any(leaf.startswith(n) for n in names)
    if claims(_NOT_HEAD_BLOCKED):
        return "not-head-blocked"
    for kind, names in (("mla_q", _MLA_Q), ("mla_kv", _MLA_KV), ("kv", _KV), ("query", _QUERY)):
        if claims(names):
            return kind
    return None


def _candidates(kind: str, text: Any, heads: int, kv_heads: int) -> list[tuple[int, int]]:
    """Every (heads, head width) the config allows this kind of projection (`_geometry_candidates`)."""
    head_dim = getattr(text, "head_dim", None)
    hidden = getattr(text, "hidden_size", None)
    if head_dim is None and hidden is not None and heads and hidden % heads == 0:
        head_dim = hidden // heads
    nope, rope, v_dim = (getattr(text, k, None) for k in ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"))
    out = []
    if kind in ("query", "mla_q") and nope is not None and rope is not None:
        out.append((heads, nope + rope))
    if kind == "mla_kv" and nope is not None and v_dim is not None:
        out.append((heads, nope + v_dim))
    if kind in ("query", "kv") and head_dim is not None:
        out.append((heads if kind == "query" else kv_heads, head_dim))
    return [(h, w) for h, w in out if h and h >= 1 and w and w >= 1]


def _resolve(name: str, shape: tuple[int, ...], text: Any, heads: int, kv_heads: int) -> tuple[int | None, str]:
    """(heads, "") for a projection the shape confirms, else (None, why not)."""
    parts = name.split(".")
    kind = _kind((parts[-2] if len(parts) >= 2 else parts[-1]).lower())
    if kind is None or kind == "not-head-blocked":
        return None, kind or "not-attention"
    if len(shape) != 2:
        return None, "not-2d"
    exact = {h for h, w in _candidates(kind, text, heads, kv_heads) if shape[0] == h * w}
    if len(exact) != 1:
        return None, "width-mismatch" if not exact else "ambiguous"
    return exact.pop(), ""


def muon_head_counts(model: Any) -> dict[str, int]:
    """Parameter name -> attention heads for each Muon parameter (`uses_muon`) that DeepSpeed's
    `per_head_muon` splits per head: a Q/K/V projection (or MLA's `q_b_proj` / `kv_b_proj`) by
    its leaf module's name, whose rows equal heads x head width from `model.config` (its
    `text_config` when it has one): `num_attention_heads` (or `num_heads`, `n_heads`, `n_head`) for
    Q, `num_key_value_heads` (else the same) for K and V, `head_dim` (else hidden_size / heads),
    MLA's `qk_nope_head_dim + qk_rope_head_dim` / `+ v_head_dim`. A ConfigError, as DeepSpeed's
    ValueError, when the model has no `config` with a head count or no projection is resolved."""
    config = getattr(model, "config", None)
    text = getattr(config, "text_config", None) or config
    heads = _first(text, _HEAD_ATTRS) if text is not None else None
    named = [(n, tuple(p.shape)) for n, p in model.named_parameters()]
    if heads is None:
        raise ConfigError("per_head_muon: the model has no `config` with an attention head count "
                          f"({', '.join(_HEAD_ATTRS)}), so no projection's heads can be resolved; unset per_head_muon")
    kv_heads = _first(text, _KV_HEAD_ATTRS) or heads
    counts, skipped = {}, {}
    for name, shape in named:
        if uses_muon(name, shape):
            n, why = _resolve(name, shape, text, heads, kv_heads)
            if n is None:
                skipped[name] = why
            else:
                counts[name] = n
    if not counts:
        raise ConfigError("per_head_muon: no attention projection could be resolved (q/k/v projections by "
                          "name whose rows are heads x head width of the model's config); unset per_head_muon. "
                          f"Examined: {dict(sorted(skipped.items())) or 'no Muon parameter'}")
    return counts
