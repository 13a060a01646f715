"""Compiled-or-reference choice for wanlink's Cython extensions: one mechanism, used by each of them.

An extension is used when it imports and carries the ABI number its Python side expects; otherwise, or
when ``WANLINK_PUREPYTHON=1`` is set (read once, when the choice is made), its pure-Python reference is.
Tests and benchmarks switch the process-wide implementation with :meth:`Choice.use`.
"""
import importlib
import warnings
from typing import Any, Callable

from wanlink.errors import ConfigError, UnsupportedError
from wanlink.settings import from_env

IMPLEMENTATIONS = ("compiled", "reference")
FORCE_REFERENCE_VARIABLE = "WANLINK_PUREPYTHON"


class Choice:
    """Which implementation of one extension this process uses.

    ``what`` names it in messages ("kernels", "frame decoder"); ``module`` is the compiled module's
    import name, which must have ``abi_attribute == abi``; ``take`` picks what callers use from a module
    (the module itself, or one of its classes); ``reference`` is what the reference provides.
    ``advice``, when given, makes a stale build warn with that advice, and a missing one too unless
    ``warn_if_missing`` is false (a platform where no build is expected); ``None`` keeps both silent
    (for an extension whose state another one already reports).
    """

    def __init__(self, what: str, module: str, abi_attribute: str, abi: int, reference: Any, *,
                 take: Callable[[Any], Any] = lambda module: module, advice: str | None = None,
                 warn_if_missing: bool = True):
        self.what, self.module, self.reference, self.take = what, module, reference, take
        self.forced = from_env().pure_python
        self._advice, self._warn_if_missing = advice, warn_if_missing
        self._compiled = None if self.forced else self._import(abi_attribute, abi)
        self.name = self.available()[0]
        self.active = self.load(self.name)

    def _import(self, abi_attribute: str, abi: int) -> Any:
        try:
            module = importlib.import_module(self.module)
        except ImportError as exc:
            if self._warn_if_missing:
                self._warn(f"wanlink's compiled {self.what} ({self.module}) are missing ({exc}); "
                           "using the reference. ")
            return None
        if getattr(module, abi_attribute, None) != abi:
            self._warn(f"{self.module} is stale ({abi_attribute} is {getattr(module, abi_attribute, None)!r}, "
                       f"this wanlink needs {abi}); using the reference. ")
            return None
        return self.take(module)

    def _warn(self, what_happened: str) -> None:
        if self._advice is not None:
            warnings.warn(what_happened + self._advice, RuntimeWarning, stacklevel=5)

    def available(self) -> list[str]:
        """Implementations usable in this process, best first (only "reference" when forced)."""
        return (["compiled"] if self._compiled is not None else []) + ["reference"]

    def load(self, name: str) -> Any:
        """What implements ``name`` ("compiled" or "reference")."""
        if name == "reference":
            return self.reference
        if name == "compiled":
            if self._compiled is None:
                reason = (f"{FORCE_REFERENCE_VARIABLE} is set" if self.forced
                          else f"{self.module} is not built (or stale)")
                raise UnsupportedError(f"compiled {self.what} unavailable: {reason}")
            return self._compiled
        raise ConfigError(f"unknown {self.what} implementation {name!r}; expected one of {IMPLEMENTATIONS}")

    def use(self, name: str) -> str:
        """Switch the process-wide implementation; returns the previous name."""
        implementation = self.load(name)
        previous, self.active, self.name = self.name, implementation, name
        return previous
