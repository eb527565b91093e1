"""What several commands share: loading a config and reporting every error in it."""

from __future__ import annotations

import sys
from typing import Any

__all__ = ["load_config_or_report"]


def load_config_or_report(path: str, world_size: int, prefix: str = "") -> Any:
    """The config at `path`, or None after printing each of its errors to stderr."""
    from .._errors import ConfigError
    from ..config import load_config

    try:
        return load_config(path, world_size=world_size)
    except ConfigError as e:
        errors = getattr(e, "errors", None) or [str(e)]
        print(f"{prefix}{path}: {len(errors)} error(s)", file=sys.stderr)
        for err in errors:
            print(f"  - {err}", file=sys.stderr)
        return None
