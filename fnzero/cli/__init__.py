"""The `fnzero` command; its parts and conventions are the opening of `specs/cli.md`.

Handlers import torch and the rest of fnzero only when they run, so `--help` and `config` stay fast.
"""

from __future__ import annotations

from ._main import build_parser, main

__all__ = ["build_parser", "main"]
