"""One GEMM operand of a linear layer: quantize it as its OperandSpec says, and multiply two.

An operand is either a QuantizedTensor (block-scaled format) or a plain tensor already rounded to
its high-precision dtype. ``operand_matmul`` computes A @ B^T for any mix: two quantized operands
through ``fp4gen.gemm`` (the best path on the device), mixed ones with the reference semantics
(exact products, float64 sum, one rounding to fp32).
"""

from __future__ import annotations

import torch

from fp4gen.dsl.model import MoRRef, OperandSpec
from fp4gen.errors import FP4GenError
from fp4gen.formats import HighPrecision
from fp4gen.gemm_dispatch import gemm
from fp4gen.numerics import QuantizedTensor, quantize

HP_DTYPES: dict[str, torch.dtype] = {
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp32": torch.float32,
}

Operand = QuantizedTensor | torch.Tensor


def check_supported(spec: OperandSpec, where: str) -> None:
    """Reject specs the runtime cannot run yet, at conversion time rather than mid-training."""
    if isinstance(spec.format, MoRRef):
        raise FP4GenError(
            f"{where} uses the Mixture-of-Representations rule '{spec.format.name}'; "
            "the training runtime does not run MoR operands yet"
        )


def quantize_operand(
    t: torch.Tensor, spec: OperandSpec, *, seed: int, offset: int, backend: str = "auto"
) -> Operand:
    """Quantize a 2-D tensor along its last dimension per ``spec`` (or round it to its dtype)."""
    fmt = spec.format
    if isinstance(fmt, HighPrecision):
        return t.to(HP_DTYPES[fmt.name])
    check_supported(spec, "an operand")
    return quantize(
        t,
        fmt,
        rounding=spec.rounding,
        hadamard=spec.rht,
        seed=seed,
        offset=offset,
        backend=backend,
    )


def operand_matmul(a: Operand, b: Operand) -> torch.Tensor:
    """A @ B^T in fp32 for operands quantized (or kept) along the shared K dimension."""
    if isinstance(a, QuantizedTensor) and isinstance(b, QuantizedTensor):
        return gemm(a, b)
    # Mixed or high-precision: the same exact-products, float64-sum, one-rounding semantics.
    va = _values(a)
    vb = _values(b)
    return (va @ vb.t()).to(torch.float32)


def _values(t: Operand) -> torch.Tensor:
    if isinstance(t, QuantizedTensor):
        if t.rht is not None:
            # A lone rotated operand would not cancel; the recipe validator forbids it, so this
            # only guards direct API use.
            raise FP4GenError("an operand with an RHT must be multiplied by one with the same RHT")
        return t.dequantize().to(torch.float64).reshape(t.rows, t.cols)
    return t.to(torch.float64)
