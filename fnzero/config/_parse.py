"""Turning a user's config source into a plain dict (specs/config.md §Sources, §Syntax).

What comes out is a tree of dict/list/str/int/float/bool/None with string keys, at most MAX_DEPTH
deep, so later stages never recurse without bound or meet odd types.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
import os
from collections.abc import Mapping
from typing import Any

from fnzero._errors import ConfigError

from ._problems import config_error, join_path
from ._types import describe

__all__ = ["read_source", "strip_lenient", "MAX_DEPTH"]

MAX_DEPTH = 64  # far deeper than any DeepSpeed section; deeper input is junk, not config


def _fail(message: str, source: str | None = None) -> ConfigError:
    return config_error([message], source)


def _line_col(text: str, index: int) -> tuple[int, int]:
    line = text.count("\n", 0, index) + 1
    col = index - (text.rfind("\n", 0, index) + 1) + 1
    return line, col


def strip_lenient(text: str, source: str | None = None) -> str:
    """Blank out comments and trailing commas outside strings, keeping every offset unchanged."""
    out = list(text)
    i, n = 0, len(text)
    in_string = False
    last_comma = -1  # index of a comma not yet followed by a significant character
    while i < n:
        ch = text[i]
        if in_string:
            if ch == "\\":
                i += 2
                continue
            if ch == '"':
                in_string = False
            i += 1
            continue
        if ch == '"':
            in_string = True
            last_comma = -1
        elif ch == "/" and text.startswith("//", i):
            end = text.find("\n", i)
            end = n if end == -1 else end
            for k in range(i, end):
                out[k] = " "
            i = end
            continue
        elif ch == "/" and text.startswith("/*", i):
            end = text.find("*/", i + 2)
            if end == -1:
                line, col = _line_col(text, i)
                raise _fail(f"line {line}, column {col}: `/*` comment is never closed; add `*/` to end it", source)
            for k in range(i, end + 2):
                if out[k] != "\n":
                    out[k] = " "
            i = end + 2
            continue
        elif ch == ",":
            last_comma = i
        elif ch in "]}":
            if last_comma >= 0:
                out[last_comma] = " "  # trailing comma before a closing bracket
            last_comma = -1
        elif not ch.isspace():
            last_comma = -1
        i += 1
    return "".join(out)


def _no_constant(name: str) -> Any:
    raise _fail(f"`{name}` is not a valid JSON number; DeepSpeed configs need finite numbers, so write one")


def _parse_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise _fail(f"number {text} is out of range for a 64-bit float; use a smaller value")
    return value


def _pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for key, value in pairs:
        if key in result:
            raise _fail(f"duplicate key `{key}` in one JSON object; keep only one of them")
        result[key] = value
    return result


def parse_text(text: str, source: str | None = None) -> Any:
    """Lenient JSON text -> Python value, with line/column in syntax errors."""
    if not text.strip():
        raise _fail("config is empty; it must be a JSON object such as {\"train_batch_size\": 8}", source)
    cleaned = strip_lenient(text, source)
    if not cleaned.strip():
        raise _fail("config holds only comments; it must be a JSON object such as {\"train_batch_size\": 8}", source)
    try:
        return json.loads(
            cleaned, object_pairs_hook=_pairs, parse_constant=_no_constant, parse_float=_parse_float
        )
    except ConfigError as err:
        raise config_error(getattr(err, "errors", [str(err)]), source) from None
    except json.JSONDecodeError as err:
        raise _fail(
            f"line {err.lineno}, column {err.colno}: {err.msg}; fix the JSON syntax there "
            "(quote keys with double quotes, separate entries with commas)",
            source,
        ) from None
    except RecursionError:
        raise _fail(f"JSON is nested too deeply (more than {MAX_DEPTH} levels); this is not a DeepSpeed config", source) from None
    except ValueError as err:  # e.g. an integer literal with thousands of digits
        raise _fail(f"unreadable JSON number ({err}); use a value within 64-bit range", source) from None


def _looks_like_json(text: str) -> bool:
    head = text.lstrip()
    return head[:1] in ("{", "[") or head.startswith(("//", "/*"))


_JSON_MARKS = frozenset('{}[]":')


def _try_base64(text: str) -> str | None:
    """The decoded text when `text` is base64 of UTF-8 text that is meant as JSON (specs/config.md
    §Sources), else None."""
    compact = "".join(text.split())
    if not compact or len(compact) % 4 == 1:
        return None
    padded = (compact + "=" * (-len(compact) % 4)).encode("ascii", "replace")
    for altchars in (b"-_", b"+/"):
        try:
            decoded = base64.b64decode(padded, altchars=altchars, validate=True).decode("utf-8")
        except (binascii.Error, ValueError, UnicodeError):
            continue
        decoded = decoded.removeprefix("\ufeff")  # a byte-order mark, as utf-8-sig drops from files
        if _looks_like_json(decoded):
            return decoded
        if decoded.strip() and all(ch.isprintable() or ch in "\t\r\n" for ch in decoded) and _JSON_MARKS & set(decoded):
            return decoded
    return None


def _read_file(path: str) -> str:
    if os.path.isdir(path):
        raise _fail(f"config path {path!r} is a directory; pass the path of a JSON file")
    try:
        with open(path, "rb") as handle:
            raw = handle.read()
    except OSError as err:
        raise _fail(f"cannot read config file {path!r}: {err.strerror or err}; check the path and its permissions") from None
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        raise _fail(f"config file {path!r} is not UTF-8 text (byte {err.start}); save it as UTF-8 JSON") from None


def _source_text(src: Any) -> tuple[str, str | None]:
    """(text, label for messages) for a path or string source."""
    if isinstance(src, os.PathLike):
        path = os.fspath(src)
        if isinstance(path, bytes):
            path = path.decode("utf-8", "replace")
        if not os.path.exists(path):
            raise _fail(f"config file {path!r} does not exist; check the path")
        return _read_file(path), path
    if isinstance(src, bytes):
        try:
            src = src.decode("utf-8")
        except UnicodeDecodeError:
            raise _fail("config bytes are not UTF-8 text; pass JSON text, a dict or a path") from None
    text: str = src
    if _looks_like_json(text):
        return text, None
    if "\x00" not in text and len(text) < 4096 and os.path.isfile(text):
        return _read_file(text), text
    decoded = _try_base64(text)
    if decoded is not None:
        return decoded, "(base64)"
    stripped = text.strip()
    if not stripped:
        return text, None
    try:
        json.loads(stripped)
    except (ValueError, RecursionError):
        raise _fail(
            f"config file {describe(stripped)} does not exist, and the text is neither JSON nor base64-encoded JSON; "
            "pass an existing path, a dict, JSON text or base64 text"
        ) from None
    return text, None  # a bare JSON scalar such as `42`; rejected as non-object below


def read_source(src: Any) -> tuple[dict[str, Any], str | None]:
    """Any accepted source -> (plain validated dict tree, label for messages)."""
    if isinstance(src, Mapping):
        value, label = src, None
    elif isinstance(src, (str, bytes, os.PathLike)):
        text, label = _source_text(src)
        value = parse_text(text, label)
    else:
        raise _fail(
            f"cannot load a config from {describe(src)}; pass a path, a dict, JSON text or base64-encoded JSON text"
        )
    if not isinstance(value, Mapping):
        raise _fail(f"the top level of a config must be a JSON object {{...}}, got {describe(value)}", label)
    return plain_tree(value, label), label


def plain_tree(root: Mapping[str, Any], label: str | None = None) -> dict[str, Any]:
    """Deep copy to plain JSON types, iteratively, rejecting odd types, NaN and excessive depth."""
    result: dict[str, Any] = {}
    stack: list[tuple[Any, Any, str, int]] = [(root, result, "", 0)]
    while stack:
        node, target, path, depth = stack.pop()
        if depth >= MAX_DEPTH:
            raise _fail(f"`{path[:200]}` is nested more than {MAX_DEPTH} levels deep; this is not a DeepSpeed config", label)
        items = node.items() if isinstance(node, Mapping) else enumerate(node)
        for key, value in items:
            if isinstance(node, Mapping) and not isinstance(key, str):
                raise _fail(f"key {describe(key)} under `{path or '(top level)'}` is not a string; config keys must be strings", label)
            sub = join_path(path, key)
            if isinstance(value, Mapping):
                child: Any = {}
                stack.append((value, child, sub, depth + 1))
            elif isinstance(value, (list, tuple)):
                child = [None] * len(value)
                stack.append((value, child, sub, depth + 1))
            elif value is None or isinstance(value, (bool, int, str)):
                child = value
            elif isinstance(value, float):
                if sub == "steps_per_print" and value == math.inf:
                    child = None  # (what Accelerate writes to silence DeepSpeed's progress line: never print)
                elif not math.isfinite(value):
                    raise _fail(f"`{sub}`: {value!r} is not a finite number; use a finite value", label)
                else:
                    child = value
            else:
                raise _fail(f"`{sub}`: {describe(value)} is not a JSON value; use numbers, strings, booleans, lists or objects", label)
            target[key] = child
    return result
