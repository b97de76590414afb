"""Block-scaled accumulation: the GEMM semantics of FP8 tensor cores with block scales.

C[m, n] = S_dec(A) S_dec(B) sum_b s_a[m, b] s_b[n, b] P_b[m, n],
P_b[m, n] = sum_{i in K-block b} q_a[m, i] q_b[n, i]

The element products q_a q_b are exact, each K-block's partial sum P_b is taken on its own,
multiplied by the two block scales and accumulated (docs/numerics.md, section 6.1). This module
computes it in float64 and rounds once to fp32: the oracle of every block-scaled GEMM path, as
``gemm_reference`` is the oracle of the exact dequantized product.
"""

from __future__ import annotations

import torch

from fp4gen.errors import TensorError
from fp4gen.numerics.gemm import check_operands, global_alpha
from fp4gen.numerics.minifloat import decode
from fp4gen.numerics.quantize import QuantizedTensor

U32 = 2.0**-24  # unit roundoff of fp32 (round to nearest)


def k_segments(a_block_k: int, b_block_k: int, k: int) -> list[tuple[int, int]]:
    """The K-blocks of a GEMM: [k0, k1) between consecutive block boundaries of either operand
    (multiples of its block length along K), so that one scale of each operand covers each
    segment. For 1x128 / 128x128 operands these are the 128-wide blocks (the last one shorter
    when 128 does not divide K)."""
    cuts = set(range(0, k, max(1, a_block_k))) | set(range(0, k, max(1, b_block_k))) | {k}
    edges = sorted(cuts)
    return list(zip(edges[:-1], edges[1:], strict=True))


def gemm_block_scaled_reference(
    a: QuantizedTensor,
    b: QuantizedTensor,
    *,
    out_dtype: torch.dtype = torch.float32,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """C = A B^T with block-scaled accumulation, for a: [M, K] and b: [N, K] quantized along K.

    Per K-block (``k_segments``): P_b = the sum of the products of the decoded codes, in
    float64; then C = sum_b (s_a s_b) P_b in float64 (block scales broadcast over the rows of a
    2D block), times S_dec(a) S_dec(b), rounded once to fp32; ``bias`` ([N], fp32) and the
    conversion to ``out_dtype`` follow, as a kernel epilogue does.

    Exactness: for e4m3 (and narrower) elements each product has at most 8 significant bits and
    lies in [2^-18, 2^17.6], so a sum of up to 2^7 of them needs at most 43 bits: P_b is exact in
    float64 for blocks of up to 128 elements. The products s_a s_b P_b and their sum are exact
    when the scales are powers of two (and the sum spans at most 53 bits); otherwise each is one
    float64 rounding, a relative error of at most 2^-53 per operation, 2^29 times below fp32's
    unit roundoff. Both operands must carry the same RHT (or none), as for ``gemm_reference``.
    """
    check_operands(a, b)
    m, k, n = a.rows, a.cols, b.rows
    qa = decode(a.codes, a.element).to(torch.float64)
    qb = decode(b.codes, b.element).to(torch.float64)
    sa = _row_scales(a)  # [M, K-blocks of a], float64
    sb = _row_scales(b)  # [N, K-blocks of b]
    (_, bka), (_, bkb) = a.format.block, b.format.block
    bka, bkb = min(bka, k), min(bkb, k)  # a block longer than K is one block (quantize clips it)
    c = torch.zeros(m, n, dtype=torch.float64, device=qa.device)
    for k0, k1 in k_segments(bka, bkb, k):
        partial = qa[:, k0:k1] @ qb[:, k0:k1].t()
        scale = sa[:, k0 // bka, None] * sb[None, :, k0 // bkb]
        c += scale * partial
    c = (c * global_alpha(a, b, torch.float64)).to(torch.float32)
    if bias is not None:
        if bias.shape != (n,):
            raise TensorError(f"bias must have shape [{n}], got {tuple(bias.shape)}")
        c = c + bias.to(device=c.device, dtype=torch.float32)
    return c.to(out_dtype)


def block_scaled_error_bound(a: QuantizedTensor, b: QuantizedTensor) -> torch.Tensor:
    """The bound of docs/numerics.md 6.1 on |C - C_exact| for an fp32 block-scaled GEMM (fp32
    result, before any out_dtype conversion): gamma_r * sum_k |S s_a s_b q_a q_b| with
    r = (L - 1) + 2 + (nb - 1) + 2 roundings on the way of each product (L the longest K-block,
    nb the number of K-blocks, the last 2 for the global scales), gamma_r = r u / (1 - r u),
    u = 2^-24. float64 [M, N]."""
    (_, bka), (_, bkb) = a.format.block, b.format.block
    bka, bkb = min(bka, a.cols), min(bkb, a.cols)
    segments = k_segments(bka, bkb, a.cols)
    longest = max(k1 - k0 for k0, k1 in segments)
    r = (longest - 1) + 2 + (len(segments) - 1) + 2
    gamma = r * U32 / (1 - r * U32)
    va = a.dequantize_blockwise().to(torch.float64).abs()  # |q s| exactly: fp32 products of
    vb = b.dequantize_blockwise().to(torch.float64).abs()  # exact values, up to 2^-24 each
    alpha = global_alpha(a, b, torch.float64).abs()
    magnitude = (va @ vb.t()) * alpha * (1 + 2 * U32) ** 2  # covers the fp32 rounding of q s
    return gamma * magnitude


def _row_scales(q: QuantizedTensor) -> torch.Tensor:
    """The block scales as one row per tensor row: [R, K-blocks], float64 (2D tiles repeated)."""
    br = min(q.format.block[0], q.rows)
    return q.scales.to(torch.float64).repeat_interleave(br, 0)[: q.rows]


__all__ = ["block_scaled_error_bound", "gemm_block_scaled_reference", "k_segments"]
