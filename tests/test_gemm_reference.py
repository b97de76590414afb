"""The reference GEMM against an explicit block-by-block float64 sum."""

from __future__ import annotations

from fractions import Fraction

import pytest
import torch

from fp4gen.dsl.model import RHTSpec
from fp4gen.errors import TensorError
from fp4gen.numerics.gemm import gemm_reference
from fp4gen.numerics.minifloat import decode
from fp4gen.numerics.quantize import QuantizedTensor, quantize


def data(rows: int, cols: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g)
    return x * torch.exp2(torch.randint(-4, 5, (rows, 1), generator=g).float())


def block_sum(a: QuantizedTensor, b: QuantizedTensor) -> torch.Tensor:
    """S_a S_b sum_k s_a[m,k] s_b[n,k] sum_{i in k} q_a q_b, block by block in float64."""
    qa = decode(a.codes, a.element).double()
    qb = decode(b.codes, b.element).double()
    bk = a.format.block[1]
    assert b.format.block[1] == bk
    m, k = qa.shape
    n = qb.shape[0]
    out = torch.zeros(m, n, dtype=torch.float64)
    for kb in range(-(-k // bk)):
        cols = slice(kb * bk, (kb + 1) * bk)
        sa = a.scales[torch.arange(m) // a.format.block[0], kb].double()
        sb = b.scales[torch.arange(n) // b.format.block[0], kb].double()
        out += sa[:, None] * sb[None, :] * (qa[:, cols] @ qb[:, cols].T)
    return out * a.global_scale.double() * b.global_scale.double()


@pytest.mark.parametrize(
    "fmt_a,fmt_b,block_b",
    [
        ("nvfp4", "nvfp4", None),
        ("nvfp4", "nvfp4", (16, 16)),  # 1D activations times 2D weights
        ("mxfp4", "mxfp4", None),
        ("mxfp8_e4m3", "mxfp8_e5m2", None),
    ],
)
def test_gemm_matches_block_sum(fmt_a: str, fmt_b: str, block_b) -> None:
    a = quantize(data(24, 96, 1), fmt_a)
    b = quantize(data(40, 96, 2), fmt_b, block=block_b)
    got = gemm_reference(a, b)
    assert got.dtype == torch.float32 and got.shape == (24, 40)
    # FP4 partial products have <= 6 significant bits and, within one output, span < 53 bits
    # of exponent, so both float64 sums are exact (any order) and agree bit for bit. FP8 terms
    # span more in principle; for this data exactness is checked below with rationals.
    assert torch.equal(got, block_sum(a, b).float())
    if fmt_a.startswith("mxfp8"):
        va, vb = a.dequantize_blockwise().double(), b.dequantize_blockwise().double()
        for i in range(0, 24, 6):
            for j in range(0, 40, 7):
                terms = zip(va[i].tolist(), vb[j].tolist(), strict=True)
                exact = sum(Fraction(p) * Fraction(q) for p, q in terms)
                assert float(exact) == float(va[i] @ vb[j])


def test_gemm_close_to_fp32_dequantized_matmul() -> None:
    a, b = quantize(data(16, 128, 3), "nvfp4"), quantize(data(8, 128, 4), "nvfp4")
    fp32 = a.dequantize() @ b.dequantize().T
    ref = gemm_reference(a, b)
    # fp32 accumulation over K = 128: relative to sum |a||b|, within a few hundred fp32 ulps.
    mag = a.dequantize().abs() @ b.dequantize().abs().T
    assert torch.all((fp32 - ref).abs() <= 128 * 2.0**-24 * mag + 1e-30)


def test_gemm_bias_and_out_dtype() -> None:
    a, b = quantize(data(4, 32, 5), "mxfp4"), quantize(data(6, 32, 6), "mxfp4")
    bias = torch.linspace(-1, 1, 6)
    c32 = gemm_reference(a, b)
    assert torch.equal(gemm_reference(a, b, bias=bias), c32 + bias)
    bf = gemm_reference(a, b, bias=bias, out_dtype=torch.bfloat16)
    assert bf.dtype == torch.bfloat16 and torch.equal(bf, (c32 + bias).to(torch.bfloat16))
    with pytest.raises(TensorError, match=r"bias must have shape \[6\]"):
        gemm_reference(a, b, bias=torch.zeros(4))


def test_gemm_with_rht_on_both_operands() -> None:
    x, w = data(8, 64, 7), data(12, 64, 8)
    a, b = quantize(x, "nvfp4", hadamard=16), quantize(w, "nvfp4", hadamard=16)
    got = gemm_reference(a, b)
    assert torch.equal(got, block_sum(a, b).float())
    # The rotation cancels: the rotated-space product equals the product of the values
    # brought back by the (fp32) inverse transform, up to fp32 rounding of that inverse.
    back = a.dequantize().double() @ b.dequantize().double().T
    mag = a.dequantize().double().abs() @ b.dequantize().double().abs().T
    assert torch.all((got.double() - back).abs() <= 1e-5 * mag)


def test_gemm_errors() -> None:
    a = quantize(data(4, 32, 9), "nvfp4")
    with pytest.raises(TensorError, match=r"K mismatch: a is \[4, 32\] and b is \[4, 48\]"):
        gemm_reference(a, quantize(data(4, 48, 10), "nvfp4"))
    with pytest.raises(TensorError, match="different Hadamard transforms"):
        gemm_reference(a, quantize(data(4, 32, 11), "nvfp4", hadamard=16))
    seeded = RHTSpec(16, "seeded", None, 3)
    with pytest.raises(TensorError, match="different Hadamard transforms"):
        gemm_reference(
            quantize(data(4, 32, 9), "nvfp4", hadamard=16),
            quantize(data(4, 32, 11), "nvfp4", hadamard=seeded),
        )
