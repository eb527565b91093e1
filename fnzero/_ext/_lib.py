"""Loading the compiled extension ``fnzero._cext``, and why it is not there when it is not."""

from __future__ import annotations

import contextlib
import contextvars
import os
from typing import Any, Iterator

__all__ = ["LEVELS", "lib", "ffi", "reason", "available", "best_level", "active_level", "force_simd"]

LEVELS = ("scalar", "avx2", "avx512")  # index = FNZ_SIMD_* value in cpu_adam.h

ffi: Any = None
lib: Any = None
reason: str | None = None  # why the extension is unavailable; None when it loaded
module_file: str | None = None  # the built extension's file, where it was found

if os.environ.get("FNZERO_DISABLE_CEXT", "") not in ("", "0"):
    reason = "disabled by FNZERO_DISABLE_CEXT"
else:
    try:
        import fnzero._cext as _cext  # type: ignore[import-not-found]  (built by cffi at install)

        ffi, lib, module_file = _cext.ffi, _cext.lib, _cext.__file__
    except ImportError as e:  # not built (no compiler at install) or built for another Python
        reason = f"not built ({e}); reinstall with a C compiler to get it"

ABI_VERSION = 4  # 2: fnz_fused.thread_pool, fnz_cpu_thread_pool; 3: fnz_crc32; 4: fnz_stream_adam_shape16
if lib is not None and lib.fnz_cpu_abi_version() != ABI_VERSION:
    reason = f"ABI version {lib.fnz_cpu_abi_version()} != {ABI_VERSION} expected; rebuild it"
    ffi = lib = None


def available() -> bool:
    """True when the compiled kernels are loaded (and not disabled by FNZERO_DISABLE_CEXT)."""
    return lib is not None


def supported_levels() -> list[str]:
    return [name for i, name in enumerate(LEVELS) if lib is not None and lib.fnz_simd_supported(i)]


def best_level() -> str:
    return LEVELS[lib.fnz_simd_best()] if lib is not None else "none"


# [Note: why a context variable] Forcing a SIMD level is a test and benchmark override of the
# process-wide runtime dispatch, read inside every kernel call (`force_simd`); threading it
# through every optimizer and store call would put a testing knob in every signature.
_forced: contextvars.ContextVar[str | None] = contextvars.ContextVar("fnzero_forced_simd", default=None)


def active_level() -> str:
    """The SIMD level the kernels use now: a forced one, else the best; "none" without the extension."""
    return _forced.get() or best_level()


@contextlib.contextmanager
def force_simd(level: str) -> Iterator[None]:
    """Run the kernels at `level` ("scalar", "avx2", "avx512") inside the block (tests)."""
    if lib is None:
        raise ValueError(f"force_simd({level!r}): the C extension is unavailable: {reason}")
    if level not in LEVELS:
        raise ValueError(f"force_simd: unknown level {level!r}; one of {LEVELS}")
    if level not in supported_levels():
        raise ValueError(f"force_simd: {level!r} is not supported by this CPU (it has {supported_levels()})")
    token = _forced.set(level)
    try:
        yield
    finally:
        _forced.reset(token)
