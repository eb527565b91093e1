"""What several commands share: loading a config and reporting every error in it, failing with one
line, and parsing an option's value."""

from __future__ import annotations

import argparse
import sys
from typing import Any, Callable

__all__ = ["load_config_or_report", "fail", "arg_type", "whole_numbers"]


def load_config_or_report(path: str, world_size: int | None, prefix: str = "", auto: Any = None,
                          auto_hint: str | None = None) -> Any:
    """The config at `path` (its "auto" keys filled from `auto`), or None after printing each of its
    errors to stderr, and `auto_hint` after them when one is about "auto" keys left unfilled."""
    from .._errors import ConfigError
    from ..config import load_config

    try:
        return load_config(path, world_size=world_size, auto=auto)
    except ConfigError as e:
        errors = getattr(e, "errors", None) or [str(e)]
        print(f"{prefix}{path}: {len(errors)} error(s)", file=sys.stderr)
        for err in errors:
            print(f"  - {err}", file=sys.stderr)
        if auto_hint and any(' "auto"' in err for err in errors):
            print(f"  ({auto_hint})", file=sys.stderr)
        return None


def fail(command: str, message: str, status: int = 2) -> int:
    """Print `fnzero COMMAND: MESSAGE` to stderr; returns `status`, the command's exit status."""
    print(f"fnzero {command}: {message}", file=sys.stderr)
    return status


def arg_type(parse: Callable[..., Any], **kw: Any) -> Callable[[str], Any]:
    """`parse(text, **kw)` as an argparse `type`: argparse turns its ValueError, as
    ArgumentTypeError, into `fnzero COMMAND: error: ...` on stderr and exit status 2."""

    def conv(text: str) -> Any:
        try:
            return parse(text, **kw)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    return conv


def whole_numbers(text: str, too_small: str | None = None) -> list[int]:
    """The comma-separated whole numbers in `text` (`1,2, 4`); with `too_small`, the ValueError
    `'TEXT': TOO_SMALL` unless there is one at least and each is at least 1."""
    try:
        out = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise ValueError(f"{text!r} is not a comma-separated list of whole numbers") from None
    if too_small is not None and (not out or min(out) < 1):
        raise ValueError(f"{text!r}: {too_small}")
    return out
