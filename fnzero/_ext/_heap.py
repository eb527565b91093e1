"""The host heap: glibc's allocator told to give freed memory back to the OS (ctypes; a no-op
on other C libraries). Used below every layer that frees large tensors: construction, the step,
`init_distributed`; re-exported by `fnzero.memory`."""

from __future__ import annotations

import functools
import sys

__all__ = ["allocator_env", "heap_is_tuned", "return_freed_memory", "trim_between_passes", "trim_freed_memory"]


_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
# Whether `return_freed_memory` changed glibc's thresholds in this process. [Note: why module
# state] It mirrors the C library's process-wide allocator setting, which has no getter; a
# parameter could only repeat what the process already is. The step reads it through
# `heap_is_tuned()`, and a step can still opt out with its policy's `trim_heap=False`.
_TUNED = False


@functools.cache
def _glibc():
    """glibc through ctypes, or None (not Linux, or a libc without malloc_trim such as musl)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        libc.malloc_trim  # noqa: B018
    except (OSError, AttributeError):
        return None
    return libc


def return_freed_memory(mmap_threshold: int = 4 << 20) -> bool:
    """Make glibc give large freed blocks back to the OS: allocations of `mmap_threshold` bytes or
    more are served by mmap and unmapped on free. Returns whether the setting took effect. Why, and
    what it saves: `specs/sharding.md` §Memory, "Host allocator".
    """
    global _TUNED
    libc = _glibc()
    if libc is None:  # not glibc (musl, ...): nothing to tune
        return False
    ok = libc.mallopt(_M_MMAP_THRESHOLD, int(mmap_threshold)) == 1
    ok = ok and libc.mallopt(_M_TRIM_THRESHOLD, int(mmap_threshold)) == 1
    _TUNED = bool(ok)
    return bool(ok)


def allocator_env(environ: dict | None = None) -> dict:
    """Environment for processes started by `fnzero launch`: glibc's `malloc.hugetlb=1` tunable
    (transparent huge pages for mmap-served blocks; read by glibc at process start only, hence an
    environment variable). Existing GLIBC_TUNABLES are kept; FNZERO_NO_HUGEPAGES=1 opts out."""
    import os

    env = dict(os.environ if environ is None else environ)
    if env.get("FNZERO_NO_HUGEPAGES") == "1":
        return env
    tunables = env.get("GLIBC_TUNABLES", "")
    if "glibc.malloc.hugetlb" not in tunables:
        env["GLIBC_TUNABLES"] = ":".join(t for t in (tunables, "glibc.malloc.hugetlb=1") if t)
    return env


def trim_freed_memory() -> None:
    """Give the heap's free pages back to the OS now (glibc `malloc_trim`; a no-op elsewhere).
    `shard` calls it after releasing the model's own parameter storage."""
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)


def heap_is_tuned() -> bool:
    """Whether `return_freed_memory` set glibc's thresholds in this process."""
    return _TUNED


def trim_between_passes() -> None:
    """Called on CPU by the step between a micro-batch's forward and its backward (when its
    policy's `trim_heap` holds): return the holes forward's temporaries left in the heap before
    backward's peak (`specs/sharding.md` §Memory). Only under `return_freed_memory`'s policy, so an
    opt-out stays an opt-out."""
    if _TUNED:
        trim_freed_memory()

