"""cffi build script of fnzero's C extension, ``fnzero._cext`` (out-of-line API mode).

``ffibuilder`` is what setup.py (and ``python cext/_build.py`` for a quick in-place build)
compiles. The cdef is generated from the public headers, so the headers stay the single
statement of the ABI: preprocessor guards and includes are dropped, and every ``#define`` constant
becomes ``#define NAME ...`` (its value is taken from the real header at compile time).

Flags: -O3 with -fno-math-errno (without it gcc will not vectorise sqrtf: measured 3.6x slower);
no -ffast-math (it would reassociate and change results against torch) and -ffp-contract=off
(no silent FMA, so every SIMD level gives the same bits); no -march: the AVX2/AVX-512 loops are
compiled by per-file target pragmas and picked by cpuid at run time.
"""

from __future__ import annotations

import os
import re

HERE = os.path.dirname(os.path.abspath(__file__))
HEADERS = ("cpu_adam.h", "aio.h")
C_SOURCES = ("cpu_adam.c", "kernels_scalar.c", "kernels_avx2.c", "kernels_avx512.c", "crc32.c", "aio.c")
COMPILE_ARGS = ["-O3", "-fno-math-errno", "-ffp-contract=off", "-std=c99", "-pthread", "-Wall"]
LINK_ARGS = ["-pthread"]
MODULE = "fnzero._cext"


def cdef_text() -> str:
    """The headers, reduced to what cffi's parser takes."""
    out = []
    for name in HEADERS:
        with open(os.path.join(HERE, name)) as f:
            for line in f:
                m = re.match(r"#define\s+(FNZ_\w+)\s", line)
                if m:
                    out.append(f"#define {m.group(1)} ...\n")
                elif not line.startswith("#"):
                    out.append(line)
    return "".join(out)


def sources(root: str | None = None) -> list[str]:
    """C sources, relative to `root` (setuptools wants relative paths) or absolute."""
    paths = [os.path.join(HERE, s) for s in C_SOURCES]
    return [os.path.relpath(p, root) for p in paths] if root else paths


def make_ffibuilder(root: str | None = None):
    import cffi

    ffi = cffi.FFI()
    ffi.cdef(cdef_text())
    ffi.set_source(
        MODULE,
        '#include "cpu_adam.h"\n#include "aio.h"\n',
        sources=sources(root),
        include_dirs=[os.path.relpath(HERE, root) if root else HERE],
        extra_compile_args=COMPILE_ARGS,
        extra_link_args=LINK_ARGS,
    )
    return ffi


ffibuilder = make_ffibuilder()

if __name__ == "__main__":  # python cext/_build.py: build fnzero/_cext*.so in place (development)
    import glob
    import shutil
    import tempfile

    root = os.path.dirname(HERE)
    with tempfile.TemporaryDirectory() as tmp:
        built = make_ffibuilder().compile(tmpdir=tmp, verbose=False)
        shutil.copy(built, os.path.join(root, "fnzero", os.path.basename(built)))
    print("built", glob.glob(os.path.join(root, "fnzero", "_cext*.so")))
