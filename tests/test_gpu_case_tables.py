"""The GPU tests' quantize cases are formats fp4gen accepts, checked where CI runs (no GPU).

A GPU test builds its reference from ``BlockFormat(element, block, scale, global_scale)``; a case
that the format rules refuse (numerics.md 2.1: ue8m0 or fp32 block scales with a global amax
scale) would only fail on the GPU machine. Loading the case tables here catches it on the CPU.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest

from fp4gen.formats import BlockFormat

TESTS = Path(__file__).resolve().parent


def _load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"_cases_{name}", TESTS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _specs() -> list[tuple[str, object]]:
    """(case id, QuantKernelSpec) of every table-driven GPU quantize case."""
    out: list[tuple[str, object]] = []
    q = _load("test_quantize_kernels_gpu")
    out += [(f"rowwise/{c}", q.make_spec(c, "bf16")) for c in sorted(q.CASES)]
    out += [(f"tile/{c}", q.tile_spec(c, "bf16")) for c in sorted(q.TILE_CASES)]
    for name in ("test_nonfinite_kernels_gpu", "test_device_offset_gpu"):
        m = _load(name)
        for case, row in sorted(m.KINDS.items()):
            element, block, scale, global_scale = row[:4]
            out.append((f"{name}/{case}", (element, block, scale, global_scale)))
    return out


@pytest.mark.parametrize(("case", "spec"), _specs(), ids=lambda v: v if isinstance(v, str) else "")
def test_every_gpu_case_is_an_accepted_format(case: str, spec: object) -> None:
    if isinstance(spec, tuple):
        element, block, scale, global_scale = spec
    else:
        element, block, scale, global_scale = (
            spec.element,  # type: ignore[attr-defined]
            spec.block,  # type: ignore[attr-defined]
            spec.scale,  # type: ignore[attr-defined]
            spec.global_scale,  # type: ignore[attr-defined]
        )
    fmt = BlockFormat(case, element, block, scale, global_scale)
    assert fmt.global_scale == global_scale
