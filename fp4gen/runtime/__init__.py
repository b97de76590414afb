"""The torch runtime: loaded kernels (``kernels_for``), the cute quantize backend, layers."""

from __future__ import annotations

from typing import Any

_LAZY = {"kernels_for": "fp4gen.runtime.kernels", "LoadedKernels": "fp4gen.runtime.kernels"}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'fp4gen.runtime' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
