"""Collecting config problems and turning them into one `ConfigError`.

Validation keeps going after the first problem so `fnzero config validate` can print every
mistake in a file at once; each problem is one self-contained line naming the dotted key.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable

from fnzero._errors import ConfigError

__all__ = ["Problems", "config_error", "suggest", "join_path", "split_by_hint", "listed"]


def join_path(*parts: object) -> str:
    """Dotted DeepSpeed key path; list indices are written `key[3]`."""
    out = ""
    for part in parts:
        if part == "" or part is None:
            continue
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out = f"{out}.{part}" if out else str(part)
    return out


def suggest(word: str, candidates: Iterable[str]) -> str:
    """` did you mean `x`?` for the nearest candidate, or an empty string when none is close."""
    pool = sorted(set(candidates))
    match = difflib.get_close_matches(word, pool, n=1, cutoff=0.6)
    if not match:
        # Truncated names (`stage3_prefetch_bucket`) score low on ratio but are prefixes.
        prefixed = [c for c in pool if len(word) >= 4 and (c.startswith(word) or word.startswith(c))]
        match = prefixed[:1]
    return f"; did you mean `{match[0]}`?" if match else ""


def split_by_hint(path: str, keys: Iterable[str], candidates: Iterable[str]) -> tuple[list[tuple[str, str]], list[str]]:
    """The unknown `keys` of the object at `path`, split into (dotted path, "did you mean" hint) for
    each key with a near candidate, and the dotted paths of those with none. A caller names the
    second group in one line with the candidates listed once: a config with ten stray keys in one
    object would otherwise repeat the whole list of valid keys ten times."""
    pool = list(candidates)
    hinted: list[tuple[str, str]] = []
    bare: list[str] = []
    for key in keys:
        hint = suggest(key, pool)
        if hint:
            hinted.append((join_path(path, key), hint))
        else:
            bare.append(join_path(path, key))
    return hinted, bare


def listed(paths: list[str]) -> str:
    """`a`, `a` and `b`, `a`, `b` and `c`: names in backticks as a sentence lists them."""
    quoted = [f"`{p}`" for p in paths]
    return quoted[0] if len(quoted) == 1 else f"{', '.join(quoted[:-1])} and {quoted[-1]}"


def config_error(errors: list[str], source: str | None = None) -> ConfigError:
    """One ConfigError carrying every problem; `err.errors` holds them as a list."""
    head = f"invalid fnzero/DeepSpeed config{f' {source}' if source else ''}"
    if len(errors) == 1:
        message = f"{head}: {errors[0]}"
    else:
        message = f"{head}: {len(errors)} problems:\n" + "\n".join(f"  - {e}" for e in errors)
    err = ConfigError(message)
    err.errors = list(errors)  # type: ignore[attr-defined]
    return err


class Problems:
    """An ordered, de-duplicated list of problem lines."""

    def __init__(self) -> None:
        self.items: list[str] = []
        self._covered: tuple[str, ...] = ()

    def cover(self, paths: Iterable[str]) -> None:
        """Drop later messages about these dotted paths: one problem already covers them all."""
        self._covered += tuple(f"`{path}`" for path in paths)

    def add(self, message: str) -> None:
        if self._covered and message.startswith(self._covered):
            return
        if message not in self.items:
            self.items.append(message)

    def extend(self, messages: Iterable[str]) -> None:
        for message in messages:
            self.add(message)

    def __bool__(self) -> bool:
        return bool(self.items)

    def raise_if_any(self, source: str | None = None) -> None:
        if self.items:
            raise config_error(self.items, source)
