"""Ready-to-call quantize kernels for a QuantKernelSpec: ``kernels_for(spec, arch=None)``.

The first call for a spec renders its generated module (``fp4gen.codegen.quantize.render``),
compiles every kernel of it for the arch (the current GPU's by default) and stores the compiled
shared libraries in the kernel cache (``fp4gen.compiler.cache``); later calls in this process
return the same object, and a new process (or another machine with the same cache folder and
toolchain) loads the libraries from the cache without compiling. Loading needs no GPU; calling
does.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

from fp4gen.compiler import jit
from fp4gen.compiler.cache import KernelCache, default_root
from fp4gen.compiler.spec import QuantKernelSpec


@dataclass
class LoadStats:
    """How a LoadedKernels came to be: kernels compiled now vs loaded from the cache."""

    compiled: int = 0
    loaded: int = 0
    compile_seconds: float = 0.0  # compile time of the kernels compiled by this call
    seconds: float = 0.0  # wall time of kernels_for (render, import, compile or load)


@dataclass(eq=False)
class LoadedKernels(Mapping[str, Callable[..., Any]]):
    """The loaded kernels of one spec for one arch: a mapping kernel name -> TVM-FFI function
    (in launch order), plus ``run`` (the generated module's launcher)."""

    spec: QuantKernelSpec
    arch: str
    module: ModuleType
    fns: dict[str, Callable[..., Any]]
    source_path: Path
    stats: LoadStats = field(default_factory=LoadStats)

    def __getitem__(self, name: str) -> Callable[..., Any]:
        return self.fns[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.fns)

    def __len__(self) -> int:
        return len(self.fns)

    def run(self, x: Any, *, seed: int = 0, offset: int = 0) -> dict[str, Any]:
        """Quantize ``x`` (a CUDA tensor): {"data", "scales", "global_scale", ...}."""
        return self.module.run(self.fns, x, seed=seed, offset=offset)


_loaded: dict[tuple[QuantKernelSpec, str, str], LoadedKernels] = {}
_lock = threading.RLock()


def kernels_for(
    spec: QuantKernelSpec,
    arch: str | None = None,
    *,
    cache: KernelCache | None = None,
    render: Callable[[QuantKernelSpec], str] | None = None,
) -> LoadedKernels:
    """The loaded kernels of ``spec`` for ``arch`` (default: the current CUDA device's).

    Raises NotImplementedError when the template cannot generate ``spec`` yet. ``render``
    replaces the template (tests)."""
    arch = arch or jit.detect_arch()
    root = str(cache.root) if cache is not None else str(default_root())
    memo = (spec, arch, root)
    found = _loaded.get(memo)
    if found is not None and render is None:
        return found
    cache = cache or KernelCache(root)
    with _lock:
        found = _loaded.get(memo)
        if found is not None and render is None:
            return found
        start = time.perf_counter()
        jit.use_cache_for_dsl(cache)
        source = (render or jit.render_source)(spec)
        source_path = cache.store_source(source)
        module = jit.import_source(source_path)
        names = jit.kernel_names(source)
        stats = LoadStats()
        fns = {}
        for name in names:
            built = jit.build_kernel(cache, source_path, name, arch)
            fns[name] = jit.load_entry(built.entry)
            if built.built:
                stats.compiled += 1
                stats.compile_seconds += built.compile_seconds
            else:
                stats.loaded += 1
        stats.seconds = time.perf_counter() - start
        loaded = LoadedKernels(spec, arch, module, fns, source_path, stats)
        if render is None:
            _loaded[memo] = loaded
        return loaded


__all__ = ["LoadStats", "LoadedKernels", "kernels_for"]
