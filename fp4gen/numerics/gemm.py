"""Reference block-scaled GEMM: C = A B^T for two operands quantized along K."""

from __future__ import annotations

import torch

from fp4gen.errors import TensorError
from fp4gen.numerics.quantize import QuantizedTensor


def gemm_reference(
    a: QuantizedTensor,
    b: QuantizedTensor,
    *,
    out_dtype: torch.dtype = torch.float32,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """C[m, n] = S_dec(a) * S_dec(b) * sum_k s_a * s_b * q_a * q_b for a: [M, K], b: [N, K]
    (S_dec(a)[m] and S_dec(b)[n] with per-row global scales, ``global_alpha``).

    Both operands are quantized along K (1D or 2D blocks, in any mix). The block-scaled
    products decode(q) * s_b are exact in float32 and float64; the sum over K runs in float64
    on the rotated-space values (both operands must carry the same RHT, or none, since
    H H^T = I only cancels when both sides use the same H). The float64 sum is multiplied by
    S_dec(a) * S_dec(b) (a product exact in float64) and rounded once to fp32; ``bias`` ([N],
    added in fp32) and the conversion to ``out_dtype`` follow, as a kernel epilogue does.
    The float64 sum is the oracle: an fp32-accumulating kernel differs from it only by its own
    summation error.
    """
    check_operands(a, b)
    va = a.dequantize_blockwise().to(torch.float64)
    vb = b.dequantize_blockwise().to(torch.float64)
    c = ((va @ vb.t()) * global_alpha(a, b, torch.float64)).to(torch.float32)
    if bias is not None:
        n = b.rows
        if bias.shape != (n,):
            raise TensorError(f"bias must have shape [{n}], got {tuple(bias.shape)}")
        c = c + bias.to(device=c.device, dtype=torch.float32)
    return c.to(out_dtype)


def global_alpha(a: QuantizedTensor, b: QuantizedTensor, dtype: torch.dtype) -> torch.Tensor:
    """S_dec(A) * S_dec(B) in ``dtype``: a 0-dim tensor, or with per-row global scales
    (numerics.md 11.4) the outer product [M, 1] x [1, N] (A's rows are C's rows, B's rows C's
    columns), which broadcasts over C [M, N]. One product per element: exact in float64."""
    ga = a.global_scale.to(dtype)
    gb = b.global_scale.to(dtype)
    if gb.dim() == 2:  # per row of B: per column of C
        gb = gb.reshape(1, -1)
    return ga * gb


def require_quantized(a: object, b: object) -> None:
    """TypeError unless both GEMM operands are QuantizedTensors."""
    for name, t in (("a", a), ("b", b)):
        if not isinstance(t, QuantizedTensor):
            raise TypeError(f"{name} must be a QuantizedTensor, got {type(t).__name__}")


def check_operands(a: QuantizedTensor, b: QuantizedTensor) -> None:
    """What every GEMM of two quantized operands A [M, K], B [N, K] needs: QuantizedTensors
    (TypeError), one K, one RHT (or none) and one device (TensorError)."""
    require_quantized(a, b)
    (m, k), (n, k_b) = (a.rows, a.cols), (b.rows, b.cols)
    if k != k_b:
        raise TensorError(
            f"K mismatch: a is [{m}, {k}] and b is [{n}, {k_b}] (both must be quantized along K)"
        )
    if a.rht != b.rht:
        raise TensorError(
            f"the operands carry different Hadamard transforms ({a.rht} vs {b.rht}); "
            "the GEMM is only invariant when both use the same one (or none)"
        )
    if a.device != b.device:
        raise TensorError(f"operands on different devices: {a.device} and {b.device}")
