"""The kernel cache of a GPU test module: every kernel of its specs compiled up front, once per
test run (xdist workers included), in worker processes.

Each xdist worker used to compile every kernel of the module into a cache of its own: 16
workers each starting 15 compile processes on 16 cores, so that a module's first test
waited minutes. The cache now lies in a directory shared by the workers of the run
(``$FP4GEN_GPU_TEST_CACHE`` where set, kept across runs); the first worker to get its file
lock compiles, the others then find every kernel there."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import pytest
from filelock import FileLock

from fp4gen.compiler import jit
from fp4gen.compiler.build import CompileTask, compile_all
from fp4gen.compiler.cache import KernelCache


def shared_root(tmp_path_factory: pytest.TempPathFactory | None, name: str) -> Path:
    """``$FP4GEN_GPU_TEST_CACHE``, else ``name`` in the run's temporary directory: the one
    above the worker's own under xdist, which every worker of the run shares."""
    given = os.environ.get("FP4GEN_GPU_TEST_CACHE")
    if given:
        root = Path(given)
    else:
        assert tmp_path_factory is not None, "no $FP4GEN_GPU_TEST_CACHE: the run's temp dir"
        base = tmp_path_factory.getbasetemp()
        root = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / name
    root.mkdir(parents=True, exist_ok=True)
    return root


def compiled_cache(
    tmp_path_factory: pytest.TempPathFactory | None,
    name: str,
    specs: Iterable[Any],
    render: Callable[[Any], str],
    arch: str,
    root: Path | None = None,
) -> KernelCache:
    """A KernelCache holding every kernel of ``specs`` (each rendered by ``render``) for
    ``arch``, compiled by the first worker that asks (module docstring); in ``root`` where
    given (e.g. the cache ``fp4gen.gemm`` loads from), else the run's shared ``name``."""
    if root is None:
        root = shared_root(tmp_path_factory, name)
    root.mkdir(parents=True, exist_ok=True)
    cache = KernelCache(root)
    with FileLock(str(root) + ".lock"):
        tasks: dict[tuple[str, str], CompileTask] = {}
        for spec in specs:
            source = render(spec)
            path = str(cache.store_source(source))
            for kernel in jit.kernel_names(source):
                key = jit.kernel_key(cache, source, kernel, arch)
                if cache.lookup(key[0]) is None:
                    tasks[(path, kernel)] = CompileTask(path, kernel, arch, None, spec.name, key)
        jobs = max(2, (os.cpu_count() or 2) - 1)
        results = compile_all(list(tasks.values()), cache=cache, jobs=jobs)
    failed = {k: r["status"] for k, r in results.items() if r.get("status") != "ok"}
    assert not failed, f"compile failures: {list(failed.items())[:3]}"
    return cache


__all__ = ["compiled_cache", "shared_root"]
