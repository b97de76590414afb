"""The package's one vocabulary: the words a recipe, a kernel spec and a backend share.

Rounding names, scale roundings, GPU architectures and operand directions are string enums, so a
member compares equal to its word (``Rounding.NEAREST == "nearest"``) and code that holds plain
strings keeps working. Kernel specs store the plain words (their ``repr`` is part of each cache
key); these enums are where the words are defined and checked. ``DTYPES`` is the one table of the
high-precision dtypes: short name -> torch dtype name, CuTe DSL type name and size in bytes.

The grammar's terminals and the parser's error messages are tested against these enums
(tests/test_layers.py). Imports nothing from fp4gen and no third-party package.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from enum import Enum
from typing import Any

if sys.version_info >= (3, 11):
    from enum import StrEnum
else:  # pragma: no cover - Python 3.10

    class StrEnum(str, Enum):
        """A str enum whose members print and format as their value (enum.StrEnum of 3.11)."""

        def __str__(self) -> str:
            return str(self.value)

        def __format__(self, spec: str) -> str:
            return str(self.value).__format__(spec)


class Rounding(StrEnum):
    """How an element is rounded to its format (``round ...`` of an operand)."""

    NEAREST = "nearest"  # round to nearest, ties to even
    STOCHASTIC = "stochastic"  # stochastic, a 32-bit Philox word per value
    STOCHASTIC16 = "stochastic16"  # stochastic, 16 random bits per value
    STOCHASTIC8 = "stochastic8"  # stochastic, 8 random bits per value
    ZERO = "zero"  # toward zero


class ScaleRounding(StrEnum):
    """How a block's scale is rounded to the scale format (``round ...`` of a scale)."""

    NEAREST = "nearest"
    UP = "up"
    DOWN = "down"
    OCP = "ocp"  # the OCP MX rule: floor(log2(amax)) - emax of the element
    STOCHASTIC = "stochastic"  # up with probability (d - lo) / (hi - lo): a 32-bit word a block


class Arch(StrEnum):
    """The GPU architectures kernels are generated for."""

    SM90A = "sm_90a"  # Hopper: wgmma, TMA
    SM100A = "sm_100a"  # Blackwell: tcgen05 block-scaled MMA


class DequantScaleMode(StrEnum):
    """How the values of a dequantize kernel's unit of work map to scale columns (the codegen
    derives it from the block width; the kernel class branches on it at compile time)."""

    UNIT = "unit"  # one block covers the unit
    SPLIT = "split"  # unit / block-width blocks per unit
    VALUE = "value"  # a scale column per value: blocks straddle units


class Direction(StrEnum):
    """Which way a quantized copy's blocks run."""

    ROWWISE = "rowwise"  # along the last dimension, codes [M, K]
    COLUMNWISE = "columnwise"  # along the first dimension, stored transposed, codes [K, M]


def words(enum: type[Enum]) -> tuple[str, ...]:
    """The enum's words as plain strings, in definition order."""
    return tuple(str(member.value) for member in enum)


@dataclass(frozen=True)
class DType:
    """A high-precision dtype under its three names."""

    name: str  # the recipe's and the specs' word: "bf16"
    torch_name: str  # the attribute of the torch module: "bfloat16"
    cute: str  # the CuTe DSL numeric type: "BFloat16"
    size: int  # bytes per value

    @property
    def torch(self) -> Any:
        """The torch dtype (imports torch)."""
        import torch

        return getattr(torch, self.torch_name)


DTYPES: dict[str, DType] = {
    d.name: d
    for d in (
        DType("bf16", "bfloat16", "BFloat16", 2),
        DType("fp16", "float16", "Float16", 2),
        DType("fp32", "float32", "Float32", 4),
    )
}


_BY_TORCH: dict[str, str] = {f"torch.{d.torch_name}": d.name for d in DTYPES.values()}


def dtype_name(dtype: Any) -> str | None:
    """The short name of a torch dtype (``torch.bfloat16`` -> "bf16"); None for any other."""
    return _BY_TORCH.get(str(dtype))


__all__ = [
    "DequantScaleMode",
    "DTYPES",
    "Arch",
    "DType",
    "Direction",
    "Rounding",
    "ScaleRounding",
    "StrEnum",
    "dtype_name",
    "words",
]
