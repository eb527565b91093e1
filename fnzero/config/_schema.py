"""The key tree of the config models: valid dotted paths, and the unknown-key check.

Unknown keys are found on the raw dict, not from pydantic's `extra_forbidden` errors: here the full
dotted path and the sibling keys to suggest from are known, also inside `optimizer.params`.
"""

from __future__ import annotations

import typing
from functools import lru_cache
from typing import Any

from pydantic import BaseModel

from ._models import Config
from ._optim_models import OPTIMIZER_PARAMS
from ._problems import Problems, join_path, listed, split_by_hint
from ._sched_models import SCHEDULER_PARAMS

__all__ = ["check_unknown", "all_paths", "canonical_type"]

# The objects in which DeepSpeed 0.19.8 ignores a key it does not know (specs/config.md §Unknown keys):
# the top level ("") and the sections it reads key by key. tests/test_config_deepspeed_keys.py holds
# this set to DeepSpeed's own behaviour.
IGNORED_BY_DEEPSPEED = frozenset({
    "", "optimizer", "scheduler", "aio", "activation_checkpointing", "checkpoint", "checkpoint.parallel_write",
    "data_types", "torch_autocast", "flops_profiler", "timers", "pipeline", "expert_parallel",
})
# There, a note such as "_comment" is dropped (no DeepSpeed key starts with "_", so it is never a
# misspelt one); any other unknown key is refused, saying why.
COMMENT_PREFIX = "_"


def _sub_models(annotation: Any) -> list[type[BaseModel]]:
    found: list[type[BaseModel]] = []
    stack = [annotation]
    while stack:
        ann = stack.pop()
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            found.append(ann)
        else:
            stack.extend(typing.get_args(ann))
    return found


def _fields(model: type[BaseModel]) -> dict[str, type[BaseModel] | None]:
    """Field name -> its sub-model class (None for scalars and for the per-type params unions)."""
    out: dict[str, type[BaseModel] | None] = {}
    for name, info in model.model_fields.items():
        if info.exclude:  # fnzero's own record (world_size, world_ranks), left out of to_json: not a DeepSpeed key
            continue
        subs = _sub_models(info.annotation)
        out[name] = subs[0] if len(subs) == 1 else None
    return out


def canonical_type(value: Any, table: dict[str, Any]) -> str | None:
    """DeepSpeed matches optimizer/scheduler type names case-insensitively."""
    if not isinstance(value, str):
        return None
    lowered = {name.lower(): name for name in table}
    return lowered.get(value.strip().lower())


_PARAM_TABLES = {"optimizer": OPTIMIZER_PARAMS, "scheduler": SCHEDULER_PARAMS}


@lru_cache(maxsize=None)
def all_paths() -> frozenset[str]:
    """Every dotted key path a config can hold (params of every optimizer/scheduler type included)."""
    paths: set[str] = set()
    stack: list[tuple[type[BaseModel], str]] = [(Config, "")]
    while stack:
        model, prefix = stack.pop()
        for name, sub in _fields(model).items():
            path = join_path(prefix, name)
            paths.add(path)
            if sub is not None:
                stack.append((sub, path))
    for section, table in _PARAM_TABLES.items():
        for params_model in table.values():
            for name in _fields(params_model):
                paths.add(f"{section}.params.{name}")
    return frozenset(paths)


def _special(path: str, key: str) -> str | None:
    """A better message than "unknown key" for keys people carry over from elsewhere."""
    if path.endswith("params") and key == "max_grad_norm":
        return f"`{join_path(path, key)}` is only a Lamb parameter; clip gradients with the top-level `gradient_clipping` instead"
    if path == "" and key == "seed":
        return "`seed` is not a DeepSpeed config key; seed your run in code (e.g. torch.manual_seed) and remove it"
    if path == "" and key in ("world_size", "world_ranks"):
        return (f"`{key}` is not a DeepSpeed config key; fnzero takes the world from load_config(world_size=...) or "
                "the running process group: remove it")
    return None


def _unknown(path: str, keys: list[str], fields: dict[str, Any]) -> list[str]:
    """One line per unknown key with a near valid key, and one line naming all the others with the
    valid keys listed once."""
    hinted, bare = split_by_hint(path, keys, fields)
    valid = ", ".join(sorted(fields))
    if path not in IGNORED_BY_DEEPSPEED:  # DeepSpeed refuses it too
        lines = [f"`{where}` is not a known key{hint}" for where, hint in hinted]
        if bare:
            verb = "is not a known key" if len(bare) == 1 else "are not known keys"
            lines.append(f"{listed(bare)} {verb}; valid keys here: {valid}")
        return lines
    lines = [f"`{where}` is not a DeepSpeed config key{hint} ({_ignored(path, 1)})" for where, hint in hinted]
    if len(bare) == 1:
        lines.append(f"{listed(bare)} is not a DeepSpeed config key ({_ignored(path, 1)}): remove it, or start its "
                     f"name with `{COMMENT_PREFIX}` to keep it as a comment; the keys are {valid}")
    elif bare:
        lines.append(f"{listed(bare)} are not DeepSpeed config keys ({_ignored(path, len(bare))}): remove them, or "
                     f"start their names with `{COMMENT_PREFIX}` to keep them as comments; the keys are {valid}")
    return lines


def _ignored(path: str, count: int) -> str:
    """Why fnzero refuses `count` unknown keys where DeepSpeed reads the keys it knows and ignores the rest."""
    scope = "top-level keys" if not path else f"keys in `{path}`"
    they, have, them = ("it", "has", "it") if count == 1 else ("they", "have", "them")
    return (f"DeepSpeed ignores {scope} it does not know, so {they} {have} no effect there either; fnzero refuses "
            f"{them} so that a misspelt key is never lost silently")


def check_unknown(raw: dict[str, Any], problems: Problems) -> None:
    """Report (and remove) every key the models do not define, naming its dotted path."""
    stack: list[tuple[dict[str, Any], type[BaseModel], str]] = [(raw, Config, "")]
    while stack:
        node, model, path = stack.pop()
        fields = _fields(model)
        unknown: list[str] = []
        for key in list(node):
            if key not in fields:
                special = _special(path, key)
                if special:
                    problems.add(special)
                elif not (path in IGNORED_BY_DEEPSPEED and key.startswith(COMMENT_PREFIX)):
                    unknown.append(key)
                del node[key]
                continue
            value, sub = node[key], fields[key]
            if isinstance(value, dict):
                if sub is not None:
                    stack.append((value, sub, join_path(path, key)))
                elif key == "params" and path in _PARAM_TABLES:
                    kind = canonical_type(node.get("type"), _PARAM_TABLES[path])
                    if kind is not None:
                        stack.append((value, _PARAM_TABLES[path][kind], join_path(path, key)))
        problems.extend(_unknown(path, unknown, fields))

