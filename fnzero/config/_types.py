"""Scalar field types shared by every config model, and the strict frozen base model (specs/config.md §Types).

Every type refuses the coercions pydantic would otherwise do (`true` -> 1, `"3"` -> 3): in a config
file such a value is almost always a mistake the user wants to hear about.
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Callable

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, field_validator
from pydantic_core import PydanticCustomError

__all__ = ["Model", "Int", "Float", "Bool", "Str", "Pair", "StrList", "PosInt", "NonNegInt", "NonNegFloat", "INT64_MAX",
           "describe", "before", "lowered"]

INT64_MAX = 2**63 - 1


class Model(BaseModel):
    """Base of every config model: frozen, strict, unknown keys rejected."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, validate_default=False)


def before(fn: Callable[[Any], Any], *fields: str) -> Any:
    """A model's validator passing the values given for `fields` through `fn` before their types check them."""
    return field_validator(*fields, mode="before")(classmethod(lambda cls, v: fn(v)))


def lowered(value: Any) -> Any:
    """A string lower-cased (DeepSpeed lower-cases these keys' values); anything else as it is."""
    return value.lower() if isinstance(value, str) else value


def describe(value: Any) -> str:
    """A short JSON-ish rendering of a user value for messages (bounded; never recurses deeply)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        text = value if len(value) <= 40 else value[:37] + "..."
        return '"' + text.replace('"', '\\"') + '"'
    if isinstance(value, (int, float)):
        text = repr(value)
        return text if len(text) <= 40 else text[:37] + "..."
    if isinstance(value, (list, tuple)) and len(value) <= 6 and all(
        v is None or isinstance(v, (bool, int, float, str)) for v in value
    ):
        text = "[" + ", ".join(describe(v) for v in value) + "]"
        if len(text) <= 60:
            return text
    if isinstance(value, dict):
        return "an object" if value else "{}"
    if isinstance(value, (list, tuple)):
        return "a list" if value else "[]"
    return f"a {type(value).__name__}"


def _kind(value: Any) -> str:
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, (dict, list, tuple)) or value is None:
        return describe(value)
    return f"a {type(value).__name__}"


def _wrong_kind(code: str, want: str, value: Any, hint: str) -> PydanticCustomError:
    """The one message for a value of the wrong JSON kind: `must be <want>, got <value> (<kind>); <hint>`."""
    return PydanticCustomError(code, f"must be {want}, got {{got}} ({{kind}}); {{hint}}",
                               {"got": describe(value), "kind": _kind(value), "hint": hint})


def _number_hint(value: Any) -> str:
    return "write it without quotes" if isinstance(value, str) and _looks_numeric(value) else "write a JSON number"


def _as_int(value: Any) -> int:
    if isinstance(value, bool):
        raise PydanticCustomError(
            "fnz_int", "must be an integer, got the boolean {got}; write a number such as 1", {"got": describe(value)}
        )
    if isinstance(value, float):
        if math.isfinite(value) and value.is_integer():
            value = int(value)
        else:
            raise PydanticCustomError(
                "fnz_int", "must be an integer, got {got}; write a whole number", {"got": describe(value)}
            )
    if isinstance(value, int):
        if abs(value) > INT64_MAX:
            raise PydanticCustomError(
                "fnz_int", "got {got}, which is out of range for a 64-bit integer; use a smaller value",
                {"got": describe(value)},
            )
        return value
    raise _wrong_kind("fnz_int", "an integer", value, _number_hint(value))


def _as_float(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _wrong_kind("fnz_float", "a number", value, _number_hint(value))
    try:
        result = float(value)
    except OverflowError:
        result = math.inf
    if not math.isfinite(result):
        raise PydanticCustomError(
            "fnz_float", "must be a finite number, got {got}; use a value within float range", {"got": describe(value)}
        )
    return result


def _as_bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    quoted = isinstance(value, str) and value.lower() in ("true", "false")
    raise _wrong_kind("fnz_bool", "true or false", value, "write it without quotes" if quoted else "use true or false")


def _as_str(value: Any) -> str:
    if isinstance(value, str):
        return value
    raise _wrong_kind("fnz_str", "a string", value, "put the value in double quotes")


def _as_pair(value: Any) -> tuple[Any, ...]:
    # JSON arrays arrive as lists; the models keep a tuple so they stay hashable and immutable.
    if isinstance(value, (list, tuple)) and len(value) == 2:
        return tuple(value)
    raise PydanticCustomError(
        "fnz_pair", "must be a list of two numbers such as [0.9, 0.999], got {got}", {"got": describe(value)}
    )


def _as_str_list(value: Any) -> tuple[str, ...]:
    if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
        return tuple(value)
    raise PydanticCustomError(
        "fnz_str_list", "must be a list of strings, got {got}", {"got": describe(value)}
    )


def _looks_numeric(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


Int = Annotated[int, BeforeValidator(_as_int)]
Float = Annotated[float, BeforeValidator(_as_float)]
Bool = Annotated[bool, BeforeValidator(_as_bool)]
Str = Annotated[str, BeforeValidator(_as_str)]
Pair = Annotated[tuple[Float, Float], BeforeValidator(_as_pair)]
StrList = Annotated[tuple[str, ...], BeforeValidator(_as_str_list)]
PosInt = Annotated[Int, Field(gt=0)]
NonNegInt = Annotated[Int, Field(ge=0)]
NonNegFloat = Annotated[Float, Field(ge=0.0)]
