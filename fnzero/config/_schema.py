"""The key tree of the config models: valid dotted paths, and the unknown-key check.

Unknown keys are found here, on the raw dict, rather than from pydantic's `extra_forbidden`
errors, because here we know the full dotted path and the sibling keys to suggest from,
including inside `optimizer.params`, whose model depends on `optimizer.type`.
"""

from __future__ import annotations

import typing
from functools import lru_cache
from typing import Any

from pydantic import BaseModel

from ._models import Config
from ._optim_models import OPTIMIZER_PARAMS
from ._problems import Problems, join_path, suggest
from ._sched_models import SCHEDULER_PARAMS

__all__ = ["check_unknown", "all_paths", "canonical_type", "HIDDEN_FIELDS"]

HIDDEN_FIELDS = {"world_size"}  # model fields that are not DeepSpeed keys


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
        if name in HIDDEN_FIELDS:
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
    return None


def check_unknown(raw: dict[str, Any], problems: Problems) -> None:
    """Report (and remove) every key the models do not define, naming its dotted path."""
    stack: list[tuple[dict[str, Any], type[BaseModel], str]] = [(raw, Config, "")]
    while stack:
        node, model, path = stack.pop()
        fields = _fields(model)
        for key in list(node):
            if key not in fields:
                message = _special(path, key)
                if message is None:
                    where = f"`{join_path(path, key)}`"
                    message = (
                        f"{where} is not a known key{suggest(key, fields)}"
                        if suggest(key, fields)
                        else f"{where} is not a known key; valid keys here: {', '.join(sorted(fields))}"
                    )
                problems.add(message)
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

