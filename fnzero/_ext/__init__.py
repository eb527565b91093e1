"""fnzero's C extension (cext/, built by cffi at install) behind thin, checked torch wrappers.

Private: fnzero's optimizers and offload engine call these. Every kernel has a pure-torch
fallback with the same numbers, used when the extension is missing (no compiler at install),
disabled (``FNZERO_DISABLE_CEXT=1``) or declined per call (``use_cext=False``).
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

from ._aio import ALIGN, AioEngine, AioHandle, AioRequest, aligned_empty, direct_supported, fsync_dir, is_aligned
from ._kernels import adagrad_step_, adam_step_, crc32, lion_step_, stream_adam_shape_, to_16bit
from . import _lib
from ._lib import LEVELS, available, force_simd, supported_levels


# What fnzero's other packages use of this package: they import it from here, its face, and
# never from its private modules (`specs/architecture.md` §Package faces).
from ._aio import wait_every
from ._heap import allocator_env, return_freed_memory, trim_between_passes, trim_freed_memory

__all__ = [
    "ALIGN", "AioEngine", "AioHandle", "AioRequest", "LEVELS", "adagrad_step_", "adam_step_", "aligned_empty", "crc32",
    "available", "build_info", "direct_supported", "force_simd", "fsync_dir", "is_aligned", "lion_step_", "report_lines",
    "simd_level", "stream_adam_shape_", "supported_levels", "to_16bit",
]  # fmt: skip

AIO_BACKEND = "pthread pool (pread/pwrite)"


def simd_level() -> str:
    """The SIMD level the kernels run at now ("avx512", "avx2", "scalar"), or "none" without the extension."""
    return _lib.active_level()


def build_info(path: str | os.PathLike | None = None) -> dict[str, Any]:
    """What was built and what it can do here; ``path``: a directory to probe O_DIRECT in
    (default: the temp directory)."""
    probe_dir = os.fspath(path) if path is not None else tempfile.gettempdir()
    try:
        o_direct = direct_supported(probe_dir)
    except OSError as e:
        o_direct = f"unknown ({e})"
    return {
        "available": _lib.available(),
        "reason": _lib.reason,
        "module": _lib.module_file,
        "abi_version": _lib.lib.fnz_cpu_abi_version() if _lib.available() else None,
        "simd": simd_level(),
        "simd_supported": supported_levels(),
        "threads": _threads() if _lib.available() else "torch intra-op",
        "aio_backend": AIO_BACKEND if _lib.available() else "synchronous os.pread/os.pwrite",
        "o_direct": o_direct,
        "o_direct_path": probe_dir,
    }


def _threads() -> str:
    if _lib.lib.fnz_cpu_thread_pool():
        return "the process's OpenMP pool (torch's), a few large tiles per call"
    return "pthreads (no OpenMP runtime loaded), a few large tiles per call"


def report_lines() -> list[str]:
    """Lines for ``fnzero report``."""
    info = build_info()
    if info["available"]:
        head = f"cext              built, SIMD {info['simd']} (CPU supports {', '.join(info['simd_supported'])})"
        head += f"; threads: {info['threads']}"
    else:
        head = f"cext              not in use: {info['reason']} (pure-torch fallback, same numbers)"
    od = {True: "yes", False: "no (buffered)", None: "n/a"}.get(info["o_direct"], info["o_direct"])  # type: ignore[arg-type]
    return [head, f"  aio             {info['aio_backend']}; O_DIRECT in {info['o_direct_path']}: {od}"]
