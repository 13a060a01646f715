"""Build hook: compiles cython_ext/_kernels.pyx into wanlink._kernels and cython_ext/_wire.pyx into
wanlink._wire (the frame decoder) when Cython and a C compiler work.

The package is fully usable without them (wanlink.kernels falls back to the NumPy reference,
10-100x slower; wanlink.proto.decoder to the pure-Python decoder), so a skipped or failed build does
not fail the install; it says so, and why, in one line per extension starting "wanlink: compiled
kernels". ``WANLINK_NO_EXT=1`` skips the build on purpose.
"""
import os
import sys
import sysconfig
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

HERE = Path(__file__).parent
KERNEL_SOURCE = Path("cython_ext") / "_kernels.pyx"
WIRE_SOURCE = Path("cython_ext") / "_wire.pyx"


def _say(message: str) -> None:
    print(f"wanlink: compiled kernels {message}", file=sys.stderr, flush=True)


def _targets_x86_64() -> bool:
    """True when the interpreter being built for (so the compiler's target) is x86-64."""
    return sysconfig.get_platform().lower().endswith(("x86_64", "amd64"))


def compile_args() -> list[str]:
    # -ffp-contract=off: no fused multiply-add, so results match the NumPy reference bit for bit.
    args = ["-O3", "-ffp-contract=off"]
    if sys.platform.startswith("linux") and _targets_x86_64():
        args.append("-march=x86-64-v2")  # SSE4.2/POPCNT baseline; the AVX2 scorer is chosen at run time
    if sys.platform != "darwin":
        args.append("-fopenmp")
    return args


class OptionalBuildExt(build_ext):
    """build_ext that reports what it built, and warns instead of failing, so wanlink installs without a compiler."""

    def run(self):
        try:
            super().run()
        except Exception as exc:  # noqa: BLE001 - any build failure falls back to NumPy
            _say(f"NOT built ({exc}); wanlink will use the slow NumPy reference")

    def build_extension(self, ext):
        try:
            super().build_extension(ext)
        except Exception as exc:  # noqa: BLE001
            _say(f"NOT built: compiling {ext.name} failed ({exc}); wanlink will use the slow NumPy reference")
            return
        _say(f"built: {ext.name} for {sysconfig.get_platform()} with {' '.join(ext.extra_compile_args)}")


def kernel_extensions() -> list:
    if os.environ.get("WANLINK_NO_EXT") == "1":
        _say("skipped: WANLINK_NO_EXT=1 is set; wanlink will use the slow NumPy reference")
        return []
    try:
        import numpy
        from Cython.Build import cythonize
    except ImportError as exc:
        _say(f"skipped: {exc.name} is not installed in the build environment; "
             "wanlink will use the slow NumPy reference")
        return []
    extensions = []
    if (HERE / KERNEL_SOURCE).exists():
        openmp = [] if sys.platform == "darwin" else ["-fopenmp"]
        extensions.append(Extension(
            "wanlink._kernels",
            [str(KERNEL_SOURCE)],
            include_dirs=[numpy.get_include()],
            extra_compile_args=compile_args(),
            extra_link_args=openmp,
            define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")],
        ))
    else:
        _say(f"skipped: {KERNEL_SOURCE} is missing from this source tree; wanlink will use the slow NumPy reference")
    if (HERE / WIRE_SOURCE).exists():
        extensions.append(Extension("wanlink._wire", [str(WIRE_SOURCE)], extra_compile_args=["-O2"]))
    else:
        _say(f"skipped: {WIRE_SOURCE} is missing from this source tree; wanlink will decode frames in Python")
    if not extensions:
        return []
    return cythonize(extensions, compiler_directives={"language_level": "3"}, quiet=True)


setup(ext_modules=kernel_extensions(), cmdclass={"build_ext": OptionalBuildExt})
