"""pydantic `ValidationError` -> fnzero's one-line-per-problem messages.

pydantic's own wording ("Input should be greater than or equal to 0") names neither the
DeepSpeed key path nor the fix; this maps each error type to a message that does.
"""

from __future__ import annotations

from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from ._problems import Problems, join_path
from ._types import describe

__all__ = ["validate_into", "translate"]

M = TypeVar("M", bound=BaseModel)


def _one(error: Any, prefix: tuple[Any, ...]) -> str:
    kind = error["type"]
    loc = tuple(prefix) + tuple(error["loc"])
    path = join_path(*loc) or "(top level)"
    got = describe(error.get("input"))
    ctx = error.get("ctx") or {}
    if kind.startswith("fnz_"):
        return f"`{path}` {error['msg']}"
    if kind == "extra_forbidden":
        # Normally removed (with a suggestion) by _schema.check_unknown before we get here.
        return f"`{path}` is not a known key; remove it"
    if kind == "missing":
        return f"`{path}` is required here and has no default; add it"
    if kind == "literal_error":
        return f"`{path}` must be one of {ctx.get('expected')}, got {got}"
    bounds = {
        "greater_than_equal": (">=", "ge"), "greater_than": (">", "gt"),
        "less_than_equal": ("<=", "le"), "less_than": ("<", "lt"),
    }
    if kind in bounds:
        op, name = bounds[kind]
        limit = ctx.get(name)
        return f"`{path}` must be {op} {describe(limit)}, got {got}; use a value {op} {describe(limit)}"
    if kind in ("model_type", "model_attributes_type", "dict_type"):
        return f"`{path}` must be a JSON object {{...}}, got {got}"
    if kind == "value_error":
        message = str(ctx.get("error") or error["msg"]).removeprefix("Value error, ")
        return f"`{path}`: {message}"
    return f"`{path}`: {error['msg']}, got {got}"


def translate(err: ValidationError, prefix: tuple[Any, ...] = ()) -> list[str]:
    out: list[str] = []
    for error in err.errors(include_url=False):
        message = _one(error, prefix)
        if message not in out:
            out.append(message)
    return out


def validate_into(model: type[M], data: Any, prefix: tuple[Any, ...], problems: Problems) -> M | None:
    """Validate `data` as `model`, adding translated problems under `prefix`; None on failure."""
    try:
        return model.model_validate(data)
    except ValidationError as err:
        problems.extend(translate(err, prefix))
        return None
