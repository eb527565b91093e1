"""What a `generate` call decodes with: its arguments, else the `generation_config` given, else the
model's own `generation_config`, else transformers' defaults, in the precedence of transformers'
`generate()` (`specs/generation.md` §Settings).

Only settings fnzero implements may differ from their neutral value: a generation config asking
for beams, a repetition penalty or another logits processor is one `ConfigError` naming them,
rather than tokens that silently differ from what transformers would produce.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from .._errors import ConfigError

__all__ = ["GenerationSettings", "resolve_settings", "HF_DEFAULTS"]

# transformers' model-agnostic defaults (`GenerationConfig._get_default_generation_params`) for the
# settings fnzero reads; `max_new_tokens` is the default 20 new tokens of a config without a length.
HF_DEFAULTS: dict[str, Any] = {"do_sample": False, "temperature": 1.0, "top_k": 50, "top_p": 1.0, "use_cache": True}
DEFAULT_NEW_TOKENS = 20

# Settings that change the chosen tokens in transformers' `generate()` and that fnzero does not
# implement, with the value at which they do nothing.
_UNSUPPORTED: dict[str, Any] = {
    "num_beams": 1, "num_return_sequences": 1, "repetition_penalty": 1.0, "encoder_repetition_penalty": 1.0,
    "no_repeat_ngram_size": 0, "encoder_no_repeat_ngram_size": 0, "min_length": 0, "min_new_tokens": None,
    "bad_words_ids": None, "suppress_tokens": None, "begin_suppress_tokens": None, "forced_bos_token_id": None,
    "forced_eos_token_id": None, "min_p": None, "typical_p": 1.0, "epsilon_cutoff": 0.0, "eta_cutoff": 0.0,
    "top_h": None, "sequence_bias": None, "guidance_scale": 1.0, "renormalize_logits": False,
    "exponential_decay_length_penalty": None, "remove_invalid_values": False, "stop_strings": None,
    "max_time": None, "penalty_alpha": None, "watermarking_config": None, "prefill_chunk_size": None,
}  # fmt: skip


@dataclasses.dataclass(frozen=True)
class GenerationSettings:
    """The resolved decoding settings of one `generate` call."""

    max_new_tokens: int
    do_sample: bool
    temperature: float
    top_k: int
    top_p: float
    eos_token_ids: tuple[int, ...]  # empty: no end-of-sequence stop
    pad_token_id: int | None  # what finished rows emit (the first eos when unset, as transformers)
    use_cache: bool


def _field(source: Any, name: str) -> Any:
    if source is None:
        return None
    if isinstance(source, Mapping):
        return source.get(name)
    return getattr(source, name, None)


def _first(sources: list, name: str) -> Any:
    return next((v for v in (_field(s, name) for s in sources) if v is not None), None)


def _token_ids(value: Any, what: str) -> tuple[int, ...]:
    if value is None:
        return ()
    if hasattr(value, "tolist"):
        value = value.tolist()
    items = value if isinstance(value, (list, tuple)) else [value]
    if not items or any(isinstance(v, bool) or not isinstance(v, int) or v < 0 for v in items):
        raise ConfigError(f"generate: {what} must be a non-negative token id or a non-empty list of them, got {value!r}")
    return tuple(items)


def _check_supported(sources: list) -> None:
    asked = []
    for name, neutral in _UNSUPPORTED.items():
        value = _first(sources, name)
        if value is not None and value != neutral and not (name == "guidance_scale" and value == 1):
            asked.append(f"{name}={value!r}")
    if asked:
        raise ConfigError(
            f"generate: the generation config asks for {', '.join(asked)}, which fnzero.generate does not implement "
            "(it decodes greedily or samples with temperature, top_k and top_p; specs/generation.md §Settings). "
            "Pass a generation_config without them to decode the rest as transformers would."
        )


def _max_new_tokens(explicit: Any, sources: list, prompt_len: int, max_positions: int | None) -> int:
    if explicit is None:
        explicit = _first(sources, "max_new_tokens")
    if explicit is None and _first(sources, "max_length") is not None:
        explicit = _first(sources, "max_length") - prompt_len
        if explicit < 1:
            raise ConfigError(f"generate: max_length {_first(sources, 'max_length')} leaves no room for new tokens "
                              f"after a prompt of {prompt_len}; set max_new_tokens")
    if explicit is None:  # transformers' default: 20 new tokens, within the model's positions
        n = DEFAULT_NEW_TOKENS
        return max(1, min(n, max_positions - prompt_len)) if max_positions is not None else n
    if isinstance(explicit, bool) or not isinstance(explicit, int) or explicit < 1:
        raise ConfigError(f"generate: max_new_tokens must be a positive integer, got {explicit!r}")
    return explicit


def resolve_settings(explicit: dict[str, Any], generation_config: Any, model_config: Any, prompt_len: int,
                     max_positions: int | None) -> GenerationSettings:  # fmt: skip
    """`explicit`: the `generate` keywords (None where not given); `generation_config`: the one
    passed, or None; `model_config`: the model's `generation_config`, or None."""
    sources = [generation_config, model_config]
    _check_supported(sources)
    value = {k: explicit.get(k) if explicit.get(k) is not None else _first(sources, k) for k in HF_DEFAULTS}
    value = {k: HF_DEFAULTS[k] if v is None else v for k, v in value.items()}
    do_sample, temperature, top_k, top_p = value["do_sample"], value["temperature"], value["top_k"], value["top_p"]
    if not isinstance(temperature, (int, float)) or isinstance(temperature, bool) or not temperature > 0:
        raise ConfigError(f"generate: temperature must be a positive number, got {temperature!r} "
                          "(for greedy decoding pass do_sample=False)")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0:
        raise ConfigError(f"generate: top_k must be a non-negative integer (0: off), got {top_k!r}")
    if not isinstance(top_p, (int, float)) or isinstance(top_p, bool) or not 0 <= top_p <= 1:
        raise ConfigError(f"generate: top_p must be within [0, 1], got {top_p!r}")
    eos = _token_ids(explicit.get("eos_token_id") if explicit.get("eos_token_id") is not None
                     else _first(sources, "eos_token_id"), "eos_token_id")
    pad = explicit.get("pad_token_id")
    pad = _first(sources, "pad_token_id") if pad is None else pad
    if pad is not None:
        pad = _token_ids(pad, "pad_token_id")[0]
    elif eos:
        pad = eos[0]  # as transformers: finished rows emit the first end-of-sequence token
    return GenerationSettings(
        max_new_tokens=_max_new_tokens(explicit.get("max_new_tokens"), sources, prompt_len, max_positions),
        do_sample=bool(do_sample), temperature=float(temperature), top_k=top_k, top_p=float(top_p),
        eos_token_ids=eos, pad_token_id=pad, use_cache=bool(value["use_cache"]),
    )
