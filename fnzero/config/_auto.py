"""Filling DeepSpeed's `"auto"` placeholders from the caller's `auto=` mapping.

HuggingFace's Trainer writes `"auto"` into DeepSpeed configs and replaces it with values it
knows (batch size, lr, ...) before DeepSpeed reads the file. fnzero has no trainer doing that,
so the caller passes the values explicitly, keyed by dotted DeepSpeed path; anything left as
`"auto"` is an error rather than a silently dropped key (which is what DeepSpeed does).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from ._parse import plain_tree
from ._problems import Problems, join_path, suggest
from ._schema import all_paths
from ._types import describe

__all__ = ["fill_auto", "find_auto", "AUTO"]

AUTO = "auto"
_EXAMPLE = 'load_config(..., auto={"optimizer.params.lr": 3e-4, "train_micro_batch_size_per_gpu": 8})'


def _same(a: Any, b: Any) -> bool:
    # 1 and 1.0 agree; true and 1 do not (JSON keeps booleans apart from numbers).
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return a == b
    return json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)


def find_auto(raw: dict[str, Any]) -> list[tuple[str, tuple[Any, ...]]]:
    """(dotted path, key tuple) of every value that is the string "auto", sorted by path."""
    found: list[tuple[str, tuple[Any, ...]]] = []
    stack: list[tuple[Any, tuple[Any, ...]]] = [(raw, ())]
    while stack:
        node, keys = stack.pop()
        items = list(node.items()) if isinstance(node, dict) else list(enumerate(node))
        for key, value in items:
            sub = keys + (key,)
            if isinstance(value, str) and value.strip().lower() == AUTO:
                found.append((join_path(*sub), sub))
            elif isinstance(value, (dict, list)):
                stack.append((value, sub))
    return sorted(found, key=lambda item: item[0])


def fill_auto(raw: dict[str, Any], auto: Mapping[str, Any] | None, problems: Problems) -> set[str]:
    """Apply `auto` to `raw` in place, then report and remove every "auto" still left; returns their paths."""
    if auto is not None:
        if not isinstance(auto, Mapping):
            problems.add(f"`auto` must be a dict of dotted DeepSpeed paths to values, got {describe(auto)}; e.g. {_EXAMPLE}")
            auto = {}
        valid = all_paths()
        for path, value in auto.items():
            if not isinstance(path, str) or path not in valid:
                hint = suggest(str(path), valid)
                problems.add(
                    f"auto key {describe(path)} is not a DeepSpeed config path{hint or '; use dotted paths such as `optimizer.params.lr`'}"
                )
                continue
            try:
                value = plain_tree({"v": value})["v"]
            except ValueError as err:  # ConfigError: not a JSON value
                problems.add(f"auto value for `{path}`: {getattr(err, 'errors', [str(err)])[0]}")
                continue
            _set(raw, path, value, problems)
    left = find_auto(raw)
    for path, _ in left:
        problems.add(
            f'`{path}` is "auto", a placeholder a trainer (e.g. HuggingFace) fills in; fnzero has no trainer '
            f'doing that, so pass the value: load_config(..., auto={{"{path}": <value>}}), e.g. {_EXAMPLE}'
        )
    for _, keys in left:
        _drop(raw, keys)  # reported once here; do not also report it as a wrong type
    return {path for path, _ in left}



def _set(raw: dict[str, Any], path: str, value: Any, problems: Problems) -> None:
    *head, leaf = path.split(".")
    node: Any = raw
    walked = ""
    for part in head:
        walked = join_path(walked, part)
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            problems.add(f"auto sets `{path}`, but `{walked}` in the config is {describe(child)}, not an object; make it an object")
            return
        node = child
    current = node.get(leaf, AUTO)
    if isinstance(current, str) and current.strip().lower() == AUTO:
        node[leaf] = value
    elif not _same(current, value):
        problems.add(
            f"`{path}` is {describe(current)} in the config but auto= supplies {describe(value)}; "
            f'remove one of them, or write "auto" in the config to take the supplied value'
        )


def _drop(raw: dict[str, Any], keys: tuple[Any, ...]) -> None:
    node: Any = raw
    for key in keys[:-1]:
        node = node[key]
    if isinstance(node, list):
        node[keys[-1]] = None
    else:
        del node[keys[-1]]
