"""Build hook for fnzero's optional C extension (cext/, via cffi); everything else is in pyproject.toml.

The extension is optional: if cffi is missing, the compiler is missing or fails, or
FNZERO_NO_CEXT=1 is set, the install still succeeds, with a warning, and fnzero runs its
pure-torch kernels (same numbers, slower). Plain ``cffi_modules=`` would fail the install instead.
"""

import os
import sys
import traceback

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = os.path.dirname(os.path.abspath(__file__))


def _warn(msg: str) -> None:
    bar = "*" * 78
    print(f"\n{bar}\nWARNING: fnzero: C extension not built: {msg}\n"
          f"fnzero will use its pure-torch kernels (same results, slower).\n{bar}\n", file=sys.stderr)  # fmt: skip


class optional_build_ext(build_ext):
    """Generates the cffi C source, then compiles; any failure becomes a warning."""

    def run(self):
        if os.environ.get("FNZERO_NO_CEXT", "") not in ("", "0"):
            _warn("FNZERO_NO_CEXT is set")
            self.extensions = []
            return
        try:
            self._prepare()
            super().run()
        except Exception as e:  # CompileError, LinkError, ImportError (no cffi), OSError (no cc)
            traceback.print_exc()
            _warn(f"{type(e).__name__}: {e}")
            self.extensions = []

    def _prepare(self):
        import importlib.util

        spec = importlib.util.spec_from_file_location("fnzero_cext_build", os.path.join(ROOT, "cext", "_build.py"))
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)  # needs cffi
        os.makedirs(self.build_temp, exist_ok=True)
        c_file = os.path.join(self.build_temp, "fnzero._cext.c")
        mod.ffibuilder.emit_c_code(c_file)
        for ext in self.extensions:
            if ext.name == mod.MODULE:
                ext.sources = [c_file] + mod.sources(ROOT)
                ext.include_dirs = [os.path.relpath(mod.HERE, ROOT)]
                ext.extra_compile_args = list(mod.COMPILE_ARGS)
                ext.extra_link_args = list(mod.LINK_ARGS)

    def get_outputs(self):  # nothing built -> nothing to install
        return super().get_outputs() if self.extensions else []

    def get_output_mapping(self):  # editable installs ask this
        return super().get_output_mapping() if self.extensions else {}


setup(
    ext_modules=[Extension("fnzero._cext", sources=["cext/cpu_adam.c"])],  # sources filled in by _prepare
    cmdclass={"build_ext": optional_build_ext},
)
