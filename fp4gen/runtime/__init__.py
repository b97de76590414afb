"""The torch runtime: loaded kernels (``kernels_for``), the cute quantize backend, layers."""

from __future__ import annotations

from typing import Any

from fp4gen import lazy_attribute

_LAZY = {"kernels_for": "fp4gen.runtime.kernels", "LoadedKernels": "fp4gen.runtime.kernels"}


def __getattr__(name: str) -> Any:
    return lazy_attribute("fp4gen.runtime", _LAZY, globals(), name)
