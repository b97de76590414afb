"""Prepared FP8 GEMM calls on a Hopper GPU: ``fp4gen.gemm(a, b)`` (``backend="auto"``) served by a
prepared call (``gemm_dispatch._prepared_fp8``) gives the full path's result bit for bit, on
scaled_mm and on the generated FP8 kernel (``auto`` sent there by filling its measured table),
with one weight and with a new weight per call, aligned and padded shapes, bf16 and fp32 out.

Run on an sm_90 GPU: pytest -m gpu tests/test_fp8_gemm_prepared_gpu.py
"""

from __future__ import annotations

from unittest import mock

import pytest
import torch
from sm90_fp8 import sm90_marks

import fp4gen
from fp4gen import gemm_dispatch
from fp4gen.codegen.gemm_fp8 import pair_name
from fp4gen.dsl.model import Operand
from fp4gen.numerics import quantize
from fp4gen.runtime import fp8_gemm

pytestmark = [
    *sm90_marks("the block-scaled FP8 GEMMs run on sm_90 only"),
    # prepared FP8 calls are off by default until this test passes: on for each test here
    pytest.mark.usefixtures("fp8_prepared_on"),
]

_RECIPE = fp4gen.load_recipe("fp8_blockwise")
FA = _RECIPE.operands[Operand.FPROP_ACTIVATION].format  # e4m3 1x128, fp32 scales
FB = _RECIPE.operands[Operand.FPROP_WEIGHT].format  # e4m3 128x128


def operand(rows: int, k: int, fmt, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return quantize(torch.randn(rows, k, device="cuda", generator=g), fmt)


@pytest.mark.parametrize("route", ["scaled_mm", "generated"])
@pytest.mark.parametrize("shape", [(256, 512, 1024), (200, 136, 300)])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("fb", [FB, FA], ids=["128x128 B", "1x128 B"])  # fprop / dgrad, wgrad
def test_prepared_fp8_calls_give_the_full_path_bits(route, shape, out_dtype, fb) -> None:
    m, n, k = shape
    table = {pair_name(FA, fb): 1} if route == "generated" else {}
    kind = fp8_gemm.PreparedCuteFp8 if route == "generated" else fp8_gemm.PreparedBlockScaled
    weights = [operand(n, k, fb, 100 + i) for i in range(2)]
    acts = [operand(m, k, FA, i) for i in range(3)]
    with (
        mock.patch.dict(fp8_gemm.CUTE_AUTO_MIN_M, table, clear=True),
        mock.patch.dict(gemm_dispatch._choices, clear=True),
    ):
        gemm_dispatch._prepared_fp8.clear()
        try:
            assert gemm_dispatch.auto_backend(acts[0], weights[0]).backend == (
                "cute" if route == "generated" else "block_scaled"
            )
            fp4gen.gemm(acts[0], weights[0], out_dtype=out_dtype)  # full path: prepares
            key = gemm_dispatch._fp8_key(acts[0], weights[0], out_dtype)
            assert isinstance(gemm_dispatch._prepared_fp8.get(key), kind)
            for b in (weights[0], weights[1]):  # the same weight, then a new one
                for a in acts[1:]:
                    served = gemm_dispatch._prepared_fp8[key](a, b, out_dtype)
                    assert served is not None
                    got = fp4gen.gemm(a, b, out_dtype=out_dtype)  # prepared
                    gemm_dispatch._prepared_fp8.clear()
                    full = fp4gen.gemm(a, b, out_dtype=out_dtype)  # the full path
                    bits = torch.int16 if full.element_size() == 2 else torch.int32
                    for c in (served, got):
                        assert c.dtype == out_dtype and c.is_contiguous()
                        assert c.shape == (m, n)
                        assert torch.equal(c.view(bits), full.view(bits))  # bit for bit
            torch.cuda.synchronize()
        finally:
            gemm_dispatch._prepared_fp8.clear()


@pytest.mark.parametrize("route", ["scaled_mm", "generated"])
@pytest.mark.parametrize("bias_dtype", [torch.bfloat16, torch.float32])
def test_prepared_fp8_calls_with_a_bias_give_the_full_path_bits(route, bias_dtype) -> None:
    """A layer's fprop with a bias (bf16 out): a bf16 bias in scaled_mm's epilogue, an fp32 one
    in the shared epilogue; the generated kernel adds either in fp32."""
    m, n, k = 256, 200, 1024
    table = {pair_name(FA, FB): 1} if route == "generated" else {}
    weights = [operand(n, k, FB, 200 + i) for i in range(2)]
    acts = [operand(m, k, FA, 10 + i) for i in range(2)]
    g = torch.Generator(device="cuda").manual_seed(3)
    biases = [torch.randn(n, device="cuda", generator=g).to(bias_dtype) for _ in range(2)]
    with (
        mock.patch.dict(fp8_gemm.CUTE_AUTO_MIN_M, table, clear=True),
        mock.patch.dict(gemm_dispatch._choices, clear=True),
    ):
        gemm_dispatch._prepared_fp8.clear()
        try:
            fp4gen.gemm(acts[0], weights[0], out_dtype=torch.bfloat16, bias=biases[0])
            key = gemm_dispatch._fp8_key(acts[0], weights[0], torch.bfloat16, bias_dtype)
            entry = gemm_dispatch._prepared_fp8[key]
            served = entry(acts[1], weights[1], torch.bfloat16, biases[1])
            assert served is not None
            gemm_dispatch._prepared_fp8.clear()
            full = fp4gen.gemm(acts[1], weights[1], out_dtype=torch.bfloat16, bias=biases[1])
            assert torch.equal(served.view(torch.int16), full.view(torch.int16))  # bit for bit
        finally:
            gemm_dispatch._prepared_fp8.clear()
