"""The one kernel loader of the backends: (spec, arch) -> the loaded kernels, or ``Unsupported``.

Every backend that runs generated kernels (quantize, MoR, dequantize, the sm_90a and sm_100a
GEMMs) asks a ``KernelLoader`` for them. The loader calls the backend's load function (e.g.
``fp4gen.runtime.kernels.kernels_for``) and turns the failures the backend treats as "no kernel
here" into an ``Unsupported(reason)`` value, worded by the backend's ``Reasons``; any other
exception propagates. A failure is remembered per (spec, arch) and not retried. A success is
remembered only where the backend asks for it (``keep_loaded``): the load functions memoize
their own results per kernel cache, so a loader that keeps nothing follows a change of cache.

What the caller does with ``Unsupported`` is its own choice: the quantize and MoR backends fall
back to the oracle (``LogOnce`` says so once per reason), the GEMM backends raise FP4GenError.

One lock guards every table here; the loads themselves run outside it (the load functions lock
what they compile).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Generic, TypeVar

from fp4gen.vocab import Arch, words

ARCHS: tuple[str, ...] = words(Arch)  # every arch fp4gen generates kernels for

S = TypeVar("S", bound=Hashable)
K = TypeVar("K")
T = TypeVar("T")

_lock = threading.Lock()

# the reasons several backends word alike (``Reasons`` templates)
NO_KERNELS_FOR_ARCH = "no generated kernels for {arch} (only {archs})"
TEMPLATE_LACKS = "the template cannot generate {spec.name} ({err})"
DSL_MISSING = "the CuTe DSL cannot be imported ({err})"
BUILD_FAILED = "building {spec.name} for {arch} failed ({error}: {err})"


@dataclass(frozen=True)
class Unsupported:
    """Why no kernel serves a spec on an arch: a value to branch on, not an exception."""

    reason: str

    def __str__(self) -> str:
        return self.reason


@dataclass(frozen=True)
class Reasons:
    """How a backend words what stops a load: ``str.format`` templates with the fields
    ``spec``, ``arch``, ``archs`` (``ARCHS``, comma-separated), ``err`` (the exception) and
    ``error`` (its type's name). A template left None is not caught: the exception propagates
    (or, for ``template``, may be caught by ``build``)."""

    arch: str | None = None  # checked before loading: an arch outside ARCHS (not remembered)
    template: str | None = None  # NotImplementedError: the template cannot generate the spec
    dsl: str | None = None  # ImportError: the CuTe DSL (or a package) cannot be imported
    build: str | None = None  # any other Exception: a compile, link or load failure

    @classmethod
    def falling_back(cls, template: str) -> Reasons:
        """A backend with the oracle to fall back on (quantize, MoR): an arch without kernels,
        a spec the template lacks (worded by ``template``) or no CuTe DSL; a build failure is
        not caught."""
        return cls(arch=NO_KERNELS_FOR_ARCH, template=template, dsl=DSL_MISSING)

    @classmethod
    def building(cls, arch: str | None = None) -> Reasons:
        """A GEMM-path backend (dequantize, sm_90a GEMM): a spec the template lacks, no CuTe
        DSL or any compile, link or load failure; ``arch`` words an arch without kernels
        (None: the caller checks the arch)."""
        return cls(arch=arch, template=TEMPLATE_LACKS, dsl=DSL_MISSING, build=BUILD_FAILED)

    def why(self, err: Exception, spec: object, arch: str) -> str | None:
        """The reason ``err`` means "no kernel", or None when it is not caught."""
        if isinstance(err, NotImplementedError) and self.template is not None:
            text = self.template
        elif isinstance(err, ImportError) and self.dsl is not None:
            text = self.dsl
        elif self.build is not None:
            text = self.build
        else:
            return None
        return text.format(
            spec=spec, arch=arch, archs=", ".join(ARCHS), err=err, error=type(err).__name__
        )


class KernelLoader(Generic[S, K]):
    """Loads the kernels of (spec, arch) through a backend's load function and remembers the
    failures (``failed``) and, with ``keep_loaded``, the successes (``loaded``)."""

    def __init__(self, reasons: Reasons, *, keep_loaded: bool = False) -> None:
        self.reasons = reasons
        self.keep_loaded = keep_loaded
        self.loaded: dict[tuple[S, str], K] = {}
        self.failed: dict[tuple[S, str], Unsupported] = {}

    def get(self, spec: S, arch: str, load: Callable[[S, str], K]) -> K | Unsupported:
        """``load(spec, arch)``, or why it cannot serve (remembered, not retried)."""
        key = (spec, arch)
        if self.keep_loaded:
            found = self.loaded.get(key)
            if found is not None:
                return found
        failed = self.failed.get(key)
        if failed is not None:
            return failed
        if self.reasons.arch is not None and arch not in ARCHS:
            return Unsupported(
                self.reasons.arch.format(spec=spec, arch=arch, archs=", ".join(ARCHS))
            )
        try:
            kernels = load(spec, arch)
        except Exception as err:
            reason = self.reasons.why(err, spec, arch)
            if reason is None:
                raise
            with _lock:
                return self.failed.setdefault(key, Unsupported(reason))
        if not self.keep_loaded:
            return kernels
        with _lock:
            return self.loaded.setdefault(key, kernels)

    def get_current(self, spec: S, load: Callable[[S, str], K]) -> K | Unsupported:
        """``get`` for the arch of the current CUDA device."""
        from fp4gen.compiler.jit import detect_arch

        return self.get(spec, detect_arch(), load)


class LogOnce:
    """Logs ``message % reason`` at INFO the first time each reason comes (``seen``)."""

    def __init__(self, log: logging.Logger, message: str = "%s") -> None:
        self.log = log
        self.message = message
        self.seen: set[str] = set()

    def __call__(self, reason: str) -> None:
        if reason in self.seen:
            return
        with _lock:
            if reason in self.seen:
                return
            self.seen.add(reason)
        self.log.info(self.message, reason)


def compiled_once(
    cache: dict[K, T | str],
    lock: threading.Lock,
    key: K,
    reason: Callable[[], str | None],
    compile_fn: Callable[[], T],
    what: str,
) -> T | str:
    """``cache[key]``, made once per process under ``lock``: ``reason()`` where it names why
    the kernels do not serve, else ``compile_fn()``, or a compile failure's text (a failure is
    a fallback, remembered like a reason). A string is a reason; anything else the compiled."""
    with lock:
        found = cache.get(key)
        if found is None:
            found = reason()
            if found is None:
                try:
                    found = compile_fn()
                except Exception as err:  # noqa: BLE001 (a compile failure is a fallback)
                    found = f"{what} did not compile ({type(err).__name__}: {err})"
            cache[key] = found
    return found


__all__ = [
    "ARCHS",
    "BUILD_FAILED",
    "DSL_MISSING",
    "NO_KERNELS_FOR_ARCH",
    "TEMPLATE_LACKS",
    "KernelLoader",
    "LogOnce",
    "Reasons",
    "Unsupported",
    "compiled_once",
]
