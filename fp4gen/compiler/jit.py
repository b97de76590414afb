"""Generated kernel modules -> compiled, cached, loaded TVM-FFI functions.

A generated module (what ``fp4gen.codegen.quantize.render(spec)`` returns) defines ``KERNELS``
(kernel names in launch order), ``compile_kernel(name, arch, *, dump_dir=None)`` (a TVM-FFI
compiled callable) and ``run(fns, x, *, seed=0, offset=0)`` (allocates the outputs and launches).

Ahead-of-time path, one cache entry per (source, kernel, arch): compile with the DSL, export the
TVM-FFI function to an object file (``export_to_c``), link it into a shared library against the
TVM-FFI runtime libraries, and load it with ``cute.runtime.load_module(path, enable_tvm_ffi=True)``.
Compiling, exporting, linking and loading need no GPU (only calling does), so a CPU machine can
fill a cache for sm_90a and sm_100a that a GPU machine then loads without compiling. The object
file is kept too: where no C compiler is found to link, the entry has only ``kernel.o``, which
``load_module`` links in memory (JITLink) instead.
"""

from __future__ import annotations

import ast
import contextlib
import importlib.util
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from fp4gen.codegen.gemm_configs import GemmConfig, render_module
from fp4gen.compiler.cache import Entry, KernelCache, SourceVanished, sha256_text
from fp4gen.spec import (
    DequantKernelSpec,
    GemmKernelSpec,
    MoRKernelSpec,
    QuantKernelSpec,
)
from fp4gen.vocab import Arch, words

ARCHS: tuple[str, ...] = words(Arch)  # every arch the compiler targets
# Options that change the binary and are not part of the source (the source fixes the rest).
COMPILE_OPTIONS: dict[str, Any] = {"abi": "tvm-ffi", "export": "so"}

_compile_lock = threading.Lock()  # cute.compile is not thread-safe
_modules: dict[Path, ModuleType] = {}
_modules_lock = threading.Lock()
# Every ``cute.compile`` this process ran, as (generated module's file stem, kernel, arch), and
# every cache entry it loaded: after ``fp4gen compile`` a training process should only load
# (``compile_count() == 0``), which tests and users can check.
_compiled: list[tuple[str, str, str]] = []
_loads = [0]


# ----------------------------------------------------------------------------------------------
# Rendering and importing generated modules
# ----------------------------------------------------------------------------------------------


def render_source(
    spec: QuantKernelSpec | GemmKernelSpec | DequantKernelSpec | MoRKernelSpec | Any,
) -> str:
    """The generated module of ``spec``; NotImplementedError if the template cannot emit it.

    ``spec`` may also be an sm_100a ``fp4gen.codegen.gemm_configs.GemmConfig`` (see
    ``render_gemm_source``)."""
    if not isinstance(spec, QuantKernelSpec | MoRKernelSpec):
        return render_gemm_source(spec)
    if isinstance(spec, MoRKernelSpec):
        from fp4gen.codegen.mor import render as render_mor

        return render_mor(spec)
    from fp4gen.codegen.quantize import render

    return render(spec)


def render_gemm_source(spec: GemmKernelSpec | DequantKernelSpec | Any) -> str:
    """The generated module of a GEMM-side spec: a fused sm_90a GEMM (``GemmKernelSpec``), a
    dequantize kernel (``DequantKernelSpec``), an sm_100a block-scaled GEMM
    (``fp4gen.codegen.gemm_configs.GemmConfig``: the module the sm_100a backend's
    ``gemm_kernel`` renders, the same text, so the same cache key) or a block-scaled FP8 GEMM
    (``fp4gen.kernels.gemm_sm90_fp8.GemmSm90Fp8Params``, the text ``fp8_gemm.cute_kernel``
    renders). ``fp4gen compile`` renders these through here and the quantize and MoR specs
    through ``render_source``, so a test can stand in for either."""
    if isinstance(spec, GemmKernelSpec):
        from fp4gen.codegen.gemm import render_gemm

        return render_gemm(spec)
    if isinstance(spec, DequantKernelSpec):
        from fp4gen.codegen.dequant import render_dequant

        return render_dequant(spec)
    if isinstance(spec, GemmConfig):
        return render_module(spec)
    fp8 = sys.modules.get("fp4gen.kernels.gemm_sm90_fp8")  # loaded by whoever made the params
    if fp8 is not None and isinstance(spec, fp8.GemmSm90Fp8Params):
        from fp4gen.codegen.gemm_fp8 import module_source

        return module_source(spec)  # the text fp8_gemm.cute_kernel renders: one cache key
    raise TypeError(f"no template renders a {type(spec).__name__}")


def kernel_names(source: str) -> tuple[str, ...]:
    """``KERNELS`` of a generated source, read without importing it (no CuTe DSL import)."""
    tree = ast.parse(source)
    for node in tree.body:
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = list(node.targets)
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            targets = [node.target]
        if any(isinstance(t, ast.Name) and t.id == "KERNELS" for t in targets):
            value = ast.literal_eval(node.value)  # type: ignore[arg-type]
            if not isinstance(value, tuple | list) or not all(isinstance(v, str) for v in value):
                raise ValueError("KERNELS must be a tuple of kernel names")
            return tuple(value)
    raise ValueError("the generated module defines no KERNELS")


def import_source(path: Path) -> ModuleType:
    """Import a generated module from its file (once per process and path).

    Kernels must live in files (the DSL reads their source); the module is registered in
    sys.modules under a name derived from the file so that the DSL and pickling can find it."""
    path = Path(path).resolve()
    with _modules_lock:
        module = _modules.get(path)
        if module is not None:
            return module
        name = "fp4gen_generated_" + "".join(c if c.isalnum() else "_" for c in path.stem)[:48]
        spec = importlib.util.spec_from_file_location(name, path)
        if spec is None or spec.loader is None:
            raise ImportError(f"cannot import the generated module {path}")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        try:
            spec.loader.exec_module(module)
        except BaseException:
            sys.modules.pop(name, None)
            raise
        _modules[path] = module
        return module


def use_cache_for_dsl(cache: KernelCache) -> None:
    """Point the CuTe DSL's own file cache into ours (unless the user chose a place), before
    the DSL is imported (it reads its environment once, at import)."""
    if "CUTE_DSL_CACHE_DIR" not in os.environ and "cutlass" not in sys.modules:
        os.environ["CUTE_DSL_CACHE_DIR"] = str(cache.dsl_cache_dir)


# ----------------------------------------------------------------------------------------------
# Compile, export, link, load
# ----------------------------------------------------------------------------------------------


def find_linker() -> str | None:
    """A C compiler driver to link shared libraries with: $CC, cc, gcc or clang."""
    env = os.environ.get("CC")
    if env:
        return shutil.which(env.split()[0])
    for name in ("cc", "gcc", "clang"):
        found = shutil.which(name)
        if found:
            return found
    return None


def runtime_libraries() -> list[str]:
    import cutlass.cute as cute

    return list(cute.runtime.find_runtime_libraries(enable_tvm_ffi=True))


def symbol_for(key: str) -> str:
    """The exported function name of a cache entry: unique, so modules never collide."""
    return f"fp4gen_{key[:24]}"


def compile_kernel(
    module: ModuleType, name: str, arch: str, *, dump_dir: Path | None = None
) -> tuple[Any, float]:
    """(TVM-FFI compiled function, seconds) through the module's ``compile_kernel``."""
    if dump_dir is not None:
        Path(dump_dir).mkdir(parents=True, exist_ok=True)
    with _compile_lock:
        start = time.perf_counter()
        fn = module.compile_kernel(name, arch, dump_dir=None if dump_dir is None else str(dump_dir))
        _compiled.append((Path(getattr(module, "__file__", None) or "?").stem, name, arch))
        return fn, time.perf_counter() - start


def compile_count() -> int:
    """How many kernels this process compiled (``cute.compile`` calls, in ``compile_kernel``:
    the runtime's loaders, ``build_kernel`` and PTX dumps all go through it). A process that
    finds every kernel in the cache, e.g. after ``fp4gen compile``, keeps it at 0."""
    return len(_compiled)


def compiled_kernels() -> list[tuple[str, str, str]]:
    """What this process compiled, in order: (generated module's file stem, kernel, arch). The
    stem is the sha256 of the module's text for modules stored in the kernel cache."""
    return list(_compiled)


def load_count() -> int:
    """How many cache entries this process loaded (``load_entry`` calls)."""
    return _loads[0]


def export_entry(fn: Any, folder: Path, symbol: str) -> dict[str, Any]:
    """Write ``kernel.o`` (export_to_c) and ``kernel.so`` (linked) into ``folder``."""
    start = time.perf_counter()
    obj = folder / "kernel.o"
    fn.export_to_c(str(obj), function_name=symbol, export_only_tvm_ffi_symbols=True)
    linker = find_linker()
    artifact = "kernel.o"
    if linker is not None:
        so = folder / "kernel.so"
        proc = subprocess.run(
            [linker, "-shared", "-o", str(so), str(obj), *runtime_libraries()],
            capture_output=True,
            text=True,
            check=False,
        )
        if proc.returncode != 0:
            raise RuntimeError(f"linking {so} failed:\n{proc.stderr.strip()}")
        artifact = "kernel.so"
    return {"artifact": artifact, "export_seconds": time.perf_counter() - start}


def load_entry(entry: Entry) -> Callable[..., Any]:
    """The TVM-FFI function of a cache entry (the shared library, else the object file)."""
    import cutlass.cute as cute

    symbol = entry.meta["symbol"]
    candidates = [entry.meta.get("artifact", "kernel.so"), "kernel.so", "kernel.o"]
    errors = []
    for name in dict.fromkeys(candidates):
        if name not in entry.files:
            continue
        try:
            module = cute.runtime.load_module(str(entry.file(name)), enable_tvm_ffi=True)
            fn = getattr(module, symbol)
        except Exception as err:  # try the next artifact
            errors.append(f"{name}: {err}")
            continue
        with _modules_lock:  # += on a list item is not atomic across threads
            _loads[0] += 1
        return fn
    raise RuntimeError(f"cannot load cache entry {entry.path}: " + "; ".join(errors))


@dataclass(frozen=True)
class BuiltKernel:
    """One kernel of one generated module for one arch, in the cache."""

    name: str
    arch: str
    entry: Entry
    built: bool  # compiled by this call (False: loaded from the cache)

    @property
    def compile_seconds(self) -> float:
        return float(self.entry.meta.get("compile_seconds", 0.0))


def kernel_key(cache: KernelCache, source: str, name: str, arch: str) -> tuple[str, dict[str, Any]]:
    """(cache key, the parts it hashes) of kernel ``name`` of a generated source on ``arch``."""
    return cache.key(
        source_sha256=sha256_text(source), kernel=name, arch=arch, options=COMPILE_OPTIONS
    )


def build_kernel(
    cache: KernelCache,
    source_path: Path,
    name: str,
    arch: str,
    *,
    dump_dir: Path | None = None,
    key: tuple[str, Mapping[str, Any]] | None = None,
) -> BuiltKernel:
    """Make sure the cache holds ``name`` of the generated module at ``source_path`` for
    ``arch`` (compiling it if not), and return its entry. ``key`` is (key, parts) when the
    caller computed it already (a compile worker gets its parent's, so the two never differ).
    A source in the cache that is gone (the cache was cleared meanwhile) raises SourceVanished."""
    if key is None:
        with _source_lost(cache, source_path):
            key = kernel_key(cache, Path(source_path).read_text(), name, arch)
    key, parts = key

    def module() -> ModuleType:
        with _source_lost(cache, source_path):
            return import_source(source_path)

    compiled = None
    if dump_dir is not None:  # dumping PTX needs a real compile, even on a cache hit
        compiled = compile_kernel(module(), name, arch, dump_dir=dump_dir)

    def build(folder: Path) -> Mapping[str, Any]:
        fn, seconds = compiled or compile_kernel(module(), name, arch)
        meta = export_entry(fn, folder, symbol_for(key))
        return {"symbol": symbol_for(key), "compile_seconds": seconds, **meta}

    entry, built = cache.get_or_build(key, build, parts=parts)
    return BuiltKernel(name, arch, entry, built)


@contextlib.contextmanager
def _source_lost(cache: KernelCache, source_path: Path) -> Iterator[None]:
    """A generated source of the cache that is missing when it is read is SourceVanished (the
    compile's parent can store it again); a missing file elsewhere stays a FileNotFoundError."""
    try:
        yield
    except FileNotFoundError as err:
        path = Path(source_path)
        if path.exists() or not path.absolute().is_relative_to(cache.root.absolute()):
            raise
        raise SourceVanished(
            f"the generated source {path} vanished from the kernel cache before it was compiled",
            path,
        ) from err


_archs: dict[int, str] = {}


def detect_arch(device: Any = None) -> str:
    """The arch of a CUDA device (default: the current one): sm_90a (Hopper), sm_100a
    (Blackwell), ... A device given by a tensor's ``.device`` is a dictionary lookup after its
    first call (the GEMM dispatch asks on every call)."""
    index = getattr(device, "index", device)
    if index is not None:
        known = _archs.get(index)
        if known is not None:
            return known
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError("no CUDA device: pass the target arch explicitly (sm_90a, sm_100a)")
    if index is None:
        index = torch.cuda.current_device()
    arch = _archs.get(index)
    if arch is None:
        major, minor = torch.cuda.get_device_capability(index)
        arch = _archs[index] = f"sm_{major}{minor}a"
    return arch


__all__ = [
    "ARCHS",
    "COMPILE_OPTIONS",
    "BuiltKernel",
    "build_kernel",
    "compile_count",
    "compile_kernel",
    "compiled_kernels",
    "detect_arch",
    "export_entry",
    "find_linker",
    "import_source",
    "kernel_key",
    "kernel_names",
    "load_count",
    "load_entry",
    "render_gemm_source",
    "render_source",
    "symbol_for",
    "use_cache_for_dsl",
]
