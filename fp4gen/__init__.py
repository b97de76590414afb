"""fp4gen: compile low-precision training recipes into GPU kernels."""

from fp4gen.errors import FP4GenError, RecipeError, TensorError

__version__ = "0.1.0"

__all__ = ["FP4GenError", "RecipeError", "TensorError", "__version__"]
