"""What several commands share: loading a config and reporting every error in it."""

from __future__ import annotations

import sys
from typing import Any

__all__ = ["load_config_or_report", "fail"]


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
