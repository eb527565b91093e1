"""`load_config`: source -> parsed dict -> aliases/auto/unknown keys -> models -> cross-field rules.

Every stage adds to one `Problems` list instead of raising, so one ConfigError lists every
mistake (specs/config.md §Errors).
"""

from __future__ import annotations

import difflib
import math
import re
import warnings
from collections.abc import Mapping
from typing import Any

from pydantic_core import PydanticCustomError

from ._auto import fill_auto
from ._expert import expert_world_rule
from ._legacy import normalize
from ._models import Config
from ._noop import ConfigWarning, warn_no_effect
from ._optim_models import OPTIMIZER_PARAMS, OPTIMIZER_TYPES, OptimizerConfig
from ._parse import read_source
from ._problems import Problems, config_error
from ._rules import cross_checks, resolve, zero_world_rule
from ._sched_models import SCHEDULER_PARAMS, SCHEDULER_TYPES, SchedulerConfig
from ._schema import canonical_type, check_unknown
from ._translate import validate_into
from ._types import _as_int, describe

__all__ = ["load_config", "read_config"]

TRIAD = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")


def load_config(src: Any, world_size: int | None = None, auto: Mapping[str, Any] | None = None) -> Config:
    """Load, validate and resolve a DeepSpeed config.

    `src` is a path, a dict, JSON text (comments and trailing commas allowed) or base64 text
    (specs/config.md §Sources). `world_size` sizes the batch triad (default 1: this layer never
    asks torch.distributed; `fnzero.load_config` passes the running world's size). `auto` maps
    dotted DeepSpeed paths to the values of `"auto"` placeholders (a dict or an `AutoValues`,
    specs/config.md §"auto"). Raises one `ConfigError` listing every problem; keys without effect
    warn once each (`ConfigWarning`).

    >>> from fnzero.config import load_config
    >>> cfg = load_config({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2}, world_size=2)
    >>> cfg.train_batch_size, cfg.gradient_clipping
    (16, 1.0)
    """
    return read_config(src, world_size, auto, stacklevel=3)


def read_config(src: Any, world_size: int | None, auto: Mapping[str, Any] | None, *, stacklevel: int) -> Config:
    """`load_config` for callers that wrap it: its warnings point `stacklevel` frames up."""
    if isinstance(src, Config) and auto is None and world_size in (None, src.world_ranks):
        return src
    if isinstance(src, Config):
        src = src.to_dict()
    world = _world(world_size)
    raw, label = read_source(src)
    problems = Problems()
    deprecations = normalize(raw, problems)
    unresolved = fill_auto(raw, auto, problems)
    check_unknown(raw, problems)
    ranks, world = _data_parallel_world(raw, world, world_size is not None, problems)
    if "optimizer" in raw:
        raw["optimizer"] = _build_typed(raw["optimizer"], "optimizer", problems)
    if "scheduler" in raw:
        raw["scheduler"] = _build_typed(raw["scheduler"], "scheduler", problems)
    if unresolved & set(TRIAD):
        raw.update(dict.fromkeys(TRIAD, 1))  # already reported as "auto"; do not also demand a batch size
    else:
        raw.update(_batch_triad(raw, world, problems, ranks))
    raw["world_size"], raw["world_ranks"] = world, ranks
    cfg = validate_into(Config, raw, (), problems)
    if cfg is None:
        problems.extend(_cross_checks_of_the_rest(raw, problems.items))
    problems.raise_if_any(label)
    assert cfg is not None
    cfg = resolve(cfg)
    problems.extend(cross_checks(cfg))
    if world_size is not None:  # without a world there is nothing for autoep_size to divide
        problems.extend(expert_world_rule(cfg.expert_parallel, cfg.world_size) + zero_world_rule(cfg))
    problems.raise_if_any(label)
    for message in deprecations:  # only for a config that loaded: a refused one is not also warned about
        warnings.warn(message, ConfigWarning, stacklevel=stacklevel)
    warn_no_effect(cfg, stacklevel=stacklevel)
    return cfg


def _cross_checks_of_the_rest(raw: dict[str, Any], found: list[str]) -> list[str]:
    """The cross-field problems among the keys that did validate, so one run reports every error
    (specs/config.md §Errors says which rules run)."""
    bad = {m.group(1) for m in (re.match(r"`([A-Za-z0-9_.]+)", line) for line in found) if m}
    for left_out in (bad, {path.split(".")[0] for path in bad}):
        cfg = validate_into(Config, _without_keys(raw, left_out), (), Problems())
        if cfg is None:
            continue
        try:
            lines = cross_checks(resolve(cfg))
        except Exception:  # a rule that needs what was left out: nothing more to say
            continue
        return [line for line in lines if not any(f"`{path}" in line for path in left_out)]
    return []


def _without_keys(raw: dict[str, Any], paths: set[str]) -> dict[str, Any]:
    """`raw` without the keys at these dotted paths, copied where it changes; a path through a
    value that is not a plain dict (a typed optimizer) leaves out that value whole."""
    out = dict(raw)
    for path in paths:
        node, parts = out, path.split(".")
        for part in parts[:-1]:
            if not isinstance(node.get(part), dict):
                node.pop(part, None)
                break
            node[part] = node = dict(node[part])
        else:
            node.pop(parts[-1], None)
    return out


def _data_parallel_world(raw: dict[str, Any], world: int, given: bool, problems: Problems) -> tuple[int, int]:
    """(the job's ranks, the data-parallel ranks among them, which the batch triad counts: specs/config.md
    §Batch triad). No world size given: one tensor-parallel group times one sequence-parallel group times one
    pipeline."""
    sizes = (("`tensor_parallel.autotp_size`", _size_key(raw, "tensor_parallel", "autotp_size")),
             ("`pipeline.stages`", _size_key(raw, "pipeline", "stages")),
             ("`sequence_parallel_size`", _size_key(raw, None, "sequence_parallel_size")))
    model_parallel = math.prod(v for _, v in sizes)
    if model_parallel == 1:
        return world, world  # off, or a bad value the field's own validation reports
    if not given:
        return model_parallel, 1
    if world % model_parallel:
        on = [f"{key} {v}" for key, v in sizes if v > 1]
        product = " (their product)" if len(on) > 1 else ""
        problems.add(f"{' x '.join(on)} does not divide the world size {world}: each data-parallel rank of the mesh "
                     f"is {model_parallel} ranks{product}, so the world must be a multiple of {model_parallel}")
        return world, world
    return world, world // model_parallel


def _size_key(raw: dict[str, Any], block: str | None, key: str) -> int:
    """An axis size from the raw config, at `block.key` or (block None) the top level: 1 when absent, "auto",
    or a bad value its field's validation reports. An integral float counts as its integer, as the field
    reads it (§Types), so the triad divides by the size the mesh will have."""
    node = raw if block is None else raw.get(block)
    v = node.get(key, 1) if isinstance(node, dict) else 1
    try:
        size = _as_int(v)
    except PydanticCustomError:
        return 1
    return size if size > 1 else 1


def _world(world_size: Any) -> int:
    if world_size is None:
        return 1
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise config_error([f"world_size must be a positive integer, got {describe(world_size)}"])
    return world_size


_TABLES = {"optimizer": (OPTIMIZER_PARAMS, OPTIMIZER_TYPES, OptimizerConfig),
           "scheduler": (SCHEDULER_PARAMS, SCHEDULER_TYPES, SchedulerConfig)}


def _build_typed(value: Any, section: str, problems: Problems) -> Any:
    """`optimizer` / `scheduler` dict -> model with the params model its `type` selects, or None."""
    table, names, model = _TABLES[section]
    if value is None:
        return None
    if not isinstance(value, dict):
        problems.add(f'`{section}` must be a JSON object {{"type": ..., "params": {{...}}}}, got {describe(value)}')
        return None
    if "type" not in value:
        problems.add(f"`{section}.type` is required; use one of {', '.join(names)}")
        return None
    kind = canonical_type(value["type"], table)
    if kind is None:
        got = value["type"]
        lowered = {n.lower(): n for n in names}
        close = difflib.get_close_matches(got.lower(), list(lowered), n=1, cutoff=0.6) if isinstance(got, str) else []
        hint = f"; did you mean `{lowered[close[0]]}`?" if close else ""
        problems.add(
            f"`{section}.type` {describe(got)} is not implemented by fnzero; "
            f"use one of {', '.join(names)} (matched case-insensitively){hint}"
        )
        return None
    params = value.get("params")
    params = {} if params is None else params
    if not isinstance(params, dict):
        problems.add(f"`{section}.params` must be a JSON object {{...}}, got {describe(params)}")
        return None
    if section == "optimizer":
        _optimizer_flags(kind, params, value, problems)
    built = validate_into(table[kind], params, (section, "params"), problems)
    if built is None:
        return None
    rest = {k: v for k, v in value.items() if k not in ("type", "params")}
    return validate_into(model, {"type": kind, "params": built, **rest}, (section,), problems)


def _optimizer_flags(kind: str, params: dict[str, Any], value: dict[str, Any], problems: Problems) -> None:
    """Specific messages for optimizer switches fnzero rejects (then dropped to avoid a second report)."""
    if kind == "AdamW" and params.get("adam_w_mode") is False:
        problems.add(
            "`optimizer.params.adam_w_mode` is false with type AdamW, which always decouples weight decay; "
            "use type Adam with adam_w_mode false for L2-style decay, or drop adam_w_mode"
        )
        del params["adam_w_mode"]
    if kind in ("Adam", "AdamW") and params.get("torch_adam") is True and params.get("bias_correction") is False:
        # (true is accepted: it is what torch does, and what `to_json` writes.)
        problems.add(
            "`optimizer.params.bias_correction` is false with `torch_adam: true`, but DeepSpeed then builds "
            "torch.optim.AdamW/Adam, which always corrects bias (and fails on the argument); remove "
            "bias_correction, or torch_adam"
        )
        del params["bias_correction"]
    if params.get("amsgrad") is True:
        problems.add("`optimizer.params.amsgrad` is true, but AMSGrad is not implemented (DeepSpeed's fused Adam rejects it too); set it to false")
        del params["amsgrad"]
    if value.get("legacy_fusion") is True:
        problems.add("`optimizer.legacy_fusion` is true, a DeepSpeed kernel fnzero does not implement; set it to false")
        del value["legacy_fusion"]


def _positive(raw: dict[str, Any], key: str, problems: Problems) -> int | None:
    if raw.get(key) is None:
        return None
    value = raw[key]
    try:
        number = _as_int(value)
    except PydanticCustomError as err:
        problems.add(f"`{key}` {err.message()}")
        return 0
    if number <= 0:
        problems.add(f"`{key}` must be > 0, got {number}; use a positive integer")
        return 0
    return number


def _all_ranks_hint(tbs: int, per_rank: int, world: int, ranks: int) -> str:
    """Why a train_batch_size counted over every rank is wrong when tensor or pipeline parallelism is on."""
    if ranks == world or tbs != per_rank * ranks:
        return ""
    # DeepSpeed's DeepSpeedConfig without an mpu (the Hugging Face Trainer's path) counts every rank (but
    # world / sequence_parallel_size when that key is given), and so does hf_auto_values(world_size=<all
    # ranks>); with an mpu (DeepSpeed's own AutoTP example) it counts the data-parallel ranks only, as fnzero
    # does: the ranks of one model-parallel group see the same samples.
    return (f" ({tbs} counts all {ranks} ranks, but the ranks of one tensor-parallel or sequence-parallel group or "
            f"pipeline see the same samples, so the world here is the {world} data-parallel ranks; with "
            f"hf_auto_values pass world_size={world})")


def _batch_triad(raw: dict[str, Any], world: int, problems: Problems, ranks: int) -> dict[str, int]:
    """Derive the missing members of train_batch_size = micro x gas x world, as DeepSpeed does, but exactly
    (specs/config.md §Batch triad); `world` is the data-parallel ranks among the job's `ranks`."""
    tbs, micro, gas = (_positive(raw, key, problems) for key in TRIAD)
    placeholder = dict.fromkeys(TRIAD, 1)  # keeps validating the rest after a triad problem
    if 0 in (tbs, micro, gas):
        return placeholder
    if tbs is None and micro is None:
        problems.add(
            "set `train_batch_size` or `train_micro_batch_size_per_gpu` (DeepSpeed requires at least one); "
            "the other and `gradient_accumulation_steps` are derived from it"
        )
        return placeholder
    if tbs is not None and micro is not None and gas is not None:
        if tbs != micro * gas * world:
            problems.add(
                f"train_batch_size {tbs} != {micro} (micro) × {gas} (gas) × {world} (world) = {micro * gas * world}; "
                "fix one of them or drop one and let fnzero derive it" + _all_ranks_hint(tbs, micro * gas, world, ranks)
            )
            return placeholder
    elif tbs is not None and micro is not None:
        if tbs % (micro * world):
            problems.add(
                f"train_batch_size {tbs} is not divisible by {micro} (micro) × {world} (world) = {micro * world}, "
                "so gradient_accumulation_steps would not be whole; change train_batch_size or the micro batch"
            )
            return placeholder
        gas = tbs // (micro * world)
    elif tbs is not None:
        gas = 1 if gas is None else gas
        if tbs % (gas * world):
            problems.add(
                f"train_batch_size {tbs} is not divisible by {gas} (gas) × {world} (world) = {gas * world}, "
                "so train_micro_batch_size_per_gpu would not be whole; change train_batch_size or gradient_accumulation_steps"
            )
            return placeholder
        micro = tbs // (gas * world)
    else:
        assert micro is not None
        gas = 1 if gas is None else gas
        tbs = micro * gas * world
    return {"train_batch_size": tbs, "train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": gas}
