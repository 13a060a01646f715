"""Build hook: compiles cython_ext/*.pyx into wanlink._kernels when Cython and a C compiler work.

The package is fully usable without the extension (wanlink.kernels falls back to NumPy), so a
failed or skipped build only prints a warning.
"""
import os
import sys
from pathlib import Path

from setuptools import setup
from setuptools.command.build_ext import build_ext

HERE = Path(__file__).parent
KERNEL_SOURCE = HERE / "cython_ext" / "_kernels.pyx"


class OptionalBuildExt(build_ext):
    """build_ext that warns instead of failing, so wanlink installs without a compiler."""

    def run(self):
        try:
            super().run()
        except Exception as exc:  # noqa: BLE001 - any build failure falls back to NumPy
            print(f"wanlink: compiled kernels not built ({exc}); using the NumPy reference", file=sys.stderr)

    def build_extension(self, ext):
        try:
            super().build_extension(ext)
        except Exception as exc:  # noqa: BLE001
            print(f"wanlink: building {ext.name} failed ({exc}); using the NumPy reference", file=sys.stderr)


def kernel_extensions():
    if not KERNEL_SOURCE.exists() or os.environ.get("WANLINK_NO_EXT") == "1":
        return []
    try:
        import numpy
        from Cython.Build import cythonize
        from setuptools import Extension
    except ImportError:
        return []
    openmp = [] if sys.platform == "darwin" else ["-fopenmp"]
    ext = Extension(
        "wanlink._kernels",
        [str(KERNEL_SOURCE.relative_to(HERE))],
        include_dirs=[numpy.get_include()],
        # -ffp-contract=off: no fused multiply-add, so results match the NumPy reference bit for bit.
        extra_compile_args=(["-O3", "-march=x86-64-v2", "-ffp-contract=off", *openmp] if sys.platform.startswith("linux")
                            else ["-O3", "-ffp-contract=off", *openmp]),
        extra_link_args=openmp,
        define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")],
    )
    return cythonize([ext], compiler_directives={"language_level": "3"}, quiet=True)


setup(ext_modules=kernel_extensions(), cmdclass={"build_ext": OptionalBuildExt})
