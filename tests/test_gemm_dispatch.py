"""fp4gen.gemm: every path computes the reference GEMM up to fp32 summation order."""

from __future__ import annotations

import pytest
import torch

import fp4gen
from fp4gen.errors import FP4GenError, TensorError
from fp4gen.numerics import gemm_reference, quantize


def operands(fmt: str, m: int, n: int, k: int, seed: int = 0, block_b=None):
    g = torch.Generator().manual_seed(seed)
    a = quantize(torch.randn(m, k, generator=g), fmt)
    b = quantize(torch.randn(n, k, generator=g), fmt, block=block_b)
    return a, b


def summation_bound(a, b) -> torch.Tensor:
    """|fp32 sum - exact| <= K * 2^-24 * sum_k |a_k b_k| * alpha, plus 2 ulps for the alpha
    product and the final rounding: the products are exact, only the K additions round."""
    va, vb = a.dequantize_blockwise().double(), b.dequantize_blockwise().double()
    alpha = float(a.global_scale) * float(b.global_scale)
    magnitude = (va.abs() @ vb.abs().t()) * alpha
    exact = (va @ vb.t()) * alpha
    return a.cols * 2.0**-24 * magnitude + 2 * 2.0**-23 * exact.abs()


@pytest.mark.parametrize(
    ("fmt", "block_b"),
    [("nvfp4", None), ("nvfp4", (16, 16)), ("mxfp4", None), ("mxfp8_e4m3", None)],
)
@pytest.mark.parametrize(("m", "n", "k"), [(1, 8, 16), (37, 50, 304), (128, 64, 1024)])
def test_dequant_path_matches_reference(fmt, block_b, m, n, k) -> None:
    a, b = operands(fmt, m, n, k, block_b=block_b)
    ref = fp4gen.gemm(a, b, backend="reference")
    assert torch.equal(ref, gemm_reference(a, b))
    got = fp4gen.gemm(a, b, backend="dequant")
    assert ((got.double() - ref.double()).abs() <= summation_bound(a, b)).all()


def test_auto_on_cpu_is_the_reference() -> None:
    a, b = operands("nvfp4", 16, 16, 64)
    assert torch.equal(fp4gen.gemm(a, b), gemm_reference(a, b))


def test_bias_accumulate_and_dtype() -> None:
    a, b = operands("nvfp4", 8, 12, 64)
    bias = torch.randn(12)
    acc = torch.randn(8, 12)
    c = fp4gen.gemm(a, b, bias=bias, accumulate=acc, out_dtype=torch.bfloat16)
    assert c.dtype == torch.bfloat16
    expected = (acc + gemm_reference(a, b, bias=bias)).bfloat16()
    assert torch.equal(c, expected)


def test_errors() -> None:
    a, b = operands("nvfp4", 8, 12, 64)
    with pytest.raises(FP4GenError, match="unknown GEMM backend 'cute'"):
        fp4gen.gemm(a, b, backend="cute")
    with pytest.raises(TensorError, match="accumulate has shape"):
        fp4gen.gemm(a, b, accumulate=torch.zeros(3, 3))
    c, _ = operands("nvfp4", 8, 12, 32)
    with pytest.raises(TensorError, match="K mismatch"):
        fp4gen.gemm(c, b, backend="dequant")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4", "mxfp8_e4m3", "mxfp6_e3m2"])
def test_cuda_dequant_matches_reference(fmt: str) -> None:
    a, b = operands(fmt, 300, 200, 4096)
    a, b = (quantize(t.dequantize().cuda(), fmt) for t in (a, b))
    got = fp4gen.gemm(a, b)  # auto on CUDA: bf16 cuBLAS with fp32 accumulation
    ref = gemm_reference(a, b)
    assert ((got.double() - ref.double()).abs() <= summation_bound(a, b)).all()
