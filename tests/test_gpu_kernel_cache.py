"""tests/gpu_kernel_cache.py, on the CPU: the GPU modules' up-front compile writes one cache
that a second asker (another xdist worker) finds complete, and the workers of a run share it."""

from __future__ import annotations

import gpu_kernel_cache
import pytest
import torch
from gpu_kernel_cache import compiled_cache, shared_root

from fp4gen.formats import BUILTIN_FORMATS


def test_workers_of_a_run_share_one_directory(tmp_path_factory, monkeypatch) -> None:
    monkeypatch.delenv("FP4GEN_GPU_TEST_CACHE", raising=False)
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw3")
    root = shared_root(tmp_path_factory, "some-cache")
    assert root.parent == tmp_path_factory.getbasetemp().parent and root.is_dir()
    monkeypatch.setenv("FP4GEN_GPU_TEST_CACHE", str(root / "given"))
    assert shared_root(tmp_path_factory, "some-cache") == root / "given"


def test_the_second_asker_compiles_nothing(tmp_path, monkeypatch) -> None:
    pytest.importorskip("cutlass")
    from fp4gen.codegen.quantize import render
    from fp4gen.runtime.cute_backend import spec_for

    monkeypatch.setenv("FP4GEN_GPU_TEST_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("CUTE_DSL_NO_CACHE", "1")
    asked: list[int] = []
    real = gpu_kernel_cache.compile_all

    def counted(tasks, **kw):
        asked.append(len(tasks))
        return real(tasks, **kw)

    monkeypatch.setattr(gpu_kernel_cache, "compile_all", counted)
    spec = spec_for(BUILTIN_FORMATS["nvfp4"], "nearest", None, torch.bfloat16)
    first = compiled_cache(None, "unused", [spec], render, "sm_90a")
    second = compiled_cache(None, "unused", [spec], render, "sm_90a")
    assert asked[0] >= 1 and asked[1] == 0  # the kernels (amax, quantize) once
    assert first.root == second.root
