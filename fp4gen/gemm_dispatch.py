"""``fp4gen.gemm``: C = A @ B^T for two quantized operands, on the best path the machine has.

Paths (``backend=``):
  reference  exact products summed in float64, one rounding to fp32 (fp4gen.numerics).
  dequant    block values decoded to bf16 when element x scale is exact in bf16 (fp32 otherwise),
             a cuBLAS/CPU GEMM with fp32 accumulation, the two global scales as the epilogue
             alpha. Matches the reference up to fp32 summation order.
  auto       the generated fused kernel when one exists for the pair (later versions), else
             dequant on CUDA and reference on the CPU.
Every path takes the same arguments and computes the same mathematical result (numerics.md 6).
"""

from __future__ import annotations

import logging

import torch

from fp4gen.errors import FP4GenError, TensorError
from fp4gen.formats import BlockFormat
from fp4gen.numerics import QuantizedTensor, gemm_reference

BACKENDS = ("auto", "reference", "dequant")
log = logging.getLogger(__name__)


def gemm(
    a: QuantizedTensor,
    b: QuantizedTensor,
    *,
    out_dtype: torch.dtype = torch.float32,
    bias: torch.Tensor | None = None,
    accumulate: torch.Tensor | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """C = S_a S_b (A_q @ B_q^T) (+ bias) for a: [M, K] and b: [N, K], both quantized along K.

    ``accumulate`` (fp32 [M, N]) is added to the result, as a wgrad GEMM accumulates across
    micro-batches; the sum is returned (the tensor given is not modified).
    """
    if backend not in BACKENDS:
        raise FP4GenError(f"unknown GEMM backend {backend!r}; choose one of {BACKENDS}")
    if backend == "auto":
        backend = "dequant" if a.device.type == "cuda" else "reference"
    c = gemm_reference(a, b, bias=bias) if backend == "reference" else _dequant_gemm(a, b, bias)
    if accumulate is not None:
        if accumulate.shape != c.shape:
            raise TensorError(
                f"accumulate has shape {tuple(accumulate.shape)}, the product {tuple(c.shape)}"
            )
        c = accumulate.to(torch.float32) + c
    return c.to(out_dtype)


def significand_bits(fmt: BlockFormat) -> int:
    """Bits of precision of one block value decode(q) * s_b (numerics.md section 6)."""
    scale = fmt.scale.element
    scale_bits = 24 if scale is None else 1 if scale.exponent_only else scale.significand_bits
    return fmt.element.significand_bits + scale_bits


def gemm_path(a: BlockFormat | object, b: BlockFormat | object) -> tuple[str, str]:
    """(path, why) that ``gemm(..., backend="auto")`` takes on a GPU for these operand formats."""
    if not (isinstance(a, BlockFormat) and isinstance(b, BlockFormat)):
        return "high-precision GEMM", "an operand is kept in high precision (upcast, fp32 sum)"
    bits = max(significand_bits(a), significand_bits(b))
    if a.gemm_exact_in_bf16() and b.gemm_exact_in_bf16():
        return (
            "dequantize to bf16 + cuBLAS (fp32 accumulation)",
            f"element x block scale needs {bits} significant bits, exact in bf16 (8)",
        )
    return (
        "dequantize to fp32 + fp32 GEMM (no TF32)",
        f"element x block scale needs {bits} significant bits, more than bf16's 8",
    )


def _dequant_gemm(
    a: QuantizedTensor, b: QuantizedTensor, bias: torch.Tensor | None
) -> torch.Tensor:
    if a.cols != b.cols:
        raise TensorError(f"K mismatch: a is [{a.rows}, {a.cols}] and b is [{b.rows}, {b.cols}]")
    if a.rht != b.rht:
        raise TensorError("the operands carry different Hadamard transforms")
    exact_bf16 = a.format.gemm_exact_in_bf16() and b.format.gemm_exact_in_bf16()
    va, vb = a.dequantize_blockwise(), b.dequantize_blockwise()
    if exact_bf16 and a.device.type == "cuda":
        # bf16 inputs hold the block values exactly; cuBLAS accumulates in fp32.
        c = torch.mm(va.to(torch.bfloat16), vb.to(torch.bfloat16).t(), out_dtype=torch.float32)
    else:
        with _no_tf32():
            c = va @ vb.t()
    c = c * (a.global_scale * b.global_scale)
    if bias is not None:
        c = c + bias.to(torch.float32)
    return c


class _no_tf32:
    """fp32 GEMMs with full fp32 products (TF32 would round the inputs to 10 mantissa bits)."""

    def __enter__(self) -> None:
        self.saved = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = False

    def __exit__(self, *exc: object) -> None:
        torch.backends.cuda.matmul.allow_tf32 = self.saved
