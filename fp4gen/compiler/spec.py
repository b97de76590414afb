"""The kernel specs, under their former name: they live in ``fp4gen.spec`` (the core layer).

Kept for the modules that still import them from here (the runtime backends, tests,
benchmarks); new code imports ``fp4gen.spec``.
"""

from fp4gen.spec import (
    ROUNDING_TAGS,
    CodeLayout,
    DequantKernelSpec,
    Direction,
    GemmKernelSpec,
    GemmOutDType,
    GemmTile,
    InputDType,
    MoRKernelSpec,
    QuantKernelSpec,
    QuantOutput,
    ScaleLayout,
)

__all__ = [
    "ROUNDING_TAGS",
    "CodeLayout",
    "DequantKernelSpec",
    "Direction",
    "GemmKernelSpec",
    "GemmOutDType",
    "GemmTile",
    "InputDType",
    "MoRKernelSpec",
    "QuantKernelSpec",
    "QuantOutput",
    "ScaleLayout",
]
