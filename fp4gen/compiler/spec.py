"""What one generated quantize kernel computes: the unit of code generation and caching.

A QuantKernelSpec holds every parameter that changes the generated source, and nothing else, so
equal specs share one kernel (across operands, layers and recipes). Formats are baked into the
source as constants; shapes (M, K) stay dynamic.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Literal

from fp4gen.dsl.model import RHTSpec
from fp4gen.formats import ElementFormat, ElementRounding, ScaleSpec

InputDType = Literal["bf16", "fp16", "fp32"]
Direction = Literal["rowwise", "columnwise"]
ScaleLayout = Literal["compact", "swizzled"]


@dataclass(frozen=True)
class QuantOutput:
    """One quantized copy a kernel writes.

    rowwise: blocks along the input's last dimension, codes [M, K];
    columnwise: blocks along the first dimension, stored transposed, codes [K, M].
    Each copy has its own rounding and RHT (the paper's wgrad copies get RHT 16; gradients SR).
    """

    direction: Direction
    rounding: ElementRounding
    rht: RHTSpec | None
    scale_layout: ScaleLayout = "compact"


@dataclass(frozen=True)
class QuantKernelSpec:
    """A fused quantize kernel: one input tensor, one or two quantized copies of it."""

    element: ElementFormat
    block: tuple[int, int]  # (1, N) for 1D blocks, (N, N) for 2D tiles
    scale: ScaleSpec
    global_scale: bool
    input_dtype: InputDType
    outputs: tuple[QuantOutput, ...]

    def __post_init__(self) -> None:
        if not 1 <= len(self.outputs) <= 2:
            raise ValueError("a quantize kernel writes one or two copies")
        directions = [o.direction for o in self.outputs]
        if len(set(directions)) != len(directions):
            raise ValueError(f"duplicate output direction in {directions}")

    @property
    def name(self) -> str:
        """A readable, stable kernel name, e.g. ``quant_e2m1_1x16_e4m3rn_g_bf16_row_rne``."""
        scale = (
            self.scale.name.replace(" ", "")
            + {"nearest": "rn", "up": "ru", "down": "rd", "ocp": "ocp"}[self.scale.rounding]
        )
        if self.scale.element is None:
            scale = "fp32"
        parts = [
            "quant",
            self.element.name.replace(" ", ""),
            f"{self.block[0]}x{self.block[1]}",
            scale,
            "g" if self.global_scale else "nog",
            self.input_dtype,
        ]
        for out in self.outputs:
            tag = {"rowwise": "row", "columnwise": "col"}[out.direction]
            tag += "_" + {"nearest": "rne", "stochastic": "sr", "zero": "rz"}[out.rounding]
            if out.rht is not None:
                tag += f"_rht{out.rht.size}"
            if out.scale_layout == "swizzled":
                tag += "_swz"
            parts.append(tag)
        return "_".join(parts)

    @property
    def digest(self) -> str:
        """Content hash of the spec (part of the cache key)."""
        return hashlib.sha256(repr(self).encode()).hexdigest()[:16]
