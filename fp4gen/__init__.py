"""fp4gen: compile low-precision training recipes into GPU kernels.

The path of a recipe: text -> parse tree -> recipe model (``fp4gen.dsl``) -> numerics
(``fp4gen.numerics``, the bit-exact reference) -> kernels and runtime (later stages).

Heavy submodules (torch) load on first use, so ``fp4gen check`` and ``import fp4gen`` stay fast.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from fp4gen.errors import FP4GenError, RecipeError, TensorError

__version__ = "0.1.0"


def lazy_attribute(
    package: str, table: dict[str, str], namespace: dict[str, Any], name: str
) -> Any:
    """Public name ``name`` of ``package``, imported from the module ``table`` maps it to and kept
    in the package's ``namespace`` (its globals), so that the next lookup does not come here.
    The packages whose names load on first use (this one, ``fp4gen.dsl``, ``fp4gen.runtime``)
    call it from their module ``__getattr__``."""
    module = table.get(name)
    if module is None:
        raise AttributeError(f"module {package!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    namespace[name] = value
    return value


# public name -> module that defines it
_LAZY: dict[str, str] = {
    "load_recipe": "fp4gen.dsl",
    "parse_recipe": "fp4gen.dsl",
    "print_recipe": "fp4gen.dsl",
    "Recipe": "fp4gen.dsl.model",
    "Operand": "fp4gen.dsl.model",
    "OperandSpec": "fp4gen.dsl.model",
    "RHTSpec": "fp4gen.dsl.model",
    "BlockFormat": "fp4gen.formats",
    "ElementFormat": "fp4gen.formats",
    "ScaleSpec": "fp4gen.formats",
    "HighPrecision": "fp4gen.formats",
    "BUILTIN_FORMATS": "fp4gen.formats",
    "quantize": "fp4gen.runtime.quantize_dispatch",  # the oracle or the kernels (backend=)
    "QuantizedTensor": "fp4gen.numerics",
    "gemm_reference": "fp4gen.numerics",
    "error_stats": "fp4gen.numerics",
    "ErrorStats": "fp4gen.numerics",
    "gemm": "fp4gen.gemm_dispatch",
    "convert": "fp4gen.runtime.convert",
    "set_step": "fp4gen.runtime.convert",
    "show_plan": "fp4gen.table",
    "enable_telemetry": "fp4gen.runtime.convert",
    "telemetry": "fp4gen.runtime.convert",
    "export_quantized": "fp4gen.export",
    "import_quantized": "fp4gen.export",
    "load_quantized": "fp4gen.export",
}

__all__ = [
    "FP4GenError",
    "RecipeError",
    "TensorError",
    "__version__",
    "load_recipe",
    "parse_recipe",
    "print_recipe",
    "Recipe",
    "Operand",
    "OperandSpec",
    "RHTSpec",
    "BlockFormat",
    "ElementFormat",
    "ScaleSpec",
    "HighPrecision",
    "BUILTIN_FORMATS",
    "quantize",
    "QuantizedTensor",
    "gemm_reference",
    "error_stats",
    "ErrorStats",
    "gemm",
    "convert",
    "set_step",
    "show_plan",
    "enable_telemetry",
    "telemetry",
    "export_quantized",
    "import_quantized",
    "load_quantized",
]

if TYPE_CHECKING:
    from fp4gen.dsl import load_recipe, parse_recipe, print_recipe
    from fp4gen.dsl.model import Operand, OperandSpec, Recipe, RHTSpec
    from fp4gen.export import export_quantized, import_quantized, load_quantized
    from fp4gen.formats import BUILTIN_FORMATS, BlockFormat, ElementFormat, HighPrecision, ScaleSpec
    from fp4gen.gemm_dispatch import gemm
    from fp4gen.numerics import ErrorStats, QuantizedTensor, error_stats, gemm_reference
    from fp4gen.runtime.convert import convert, enable_telemetry, set_step, telemetry
    from fp4gen.runtime.quantize_dispatch import quantize
    from fp4gen.table import show_plan


def __getattr__(name: str) -> Any:
    if name == "nn":  # the submodule fp4gen.nn, loaded on first use like the names above
        return importlib.import_module("fp4gen.nn")
    return lazy_attribute(__name__, _LAZY, globals(), name)


def __dir__() -> list[str]:
    return sorted(__all__)
