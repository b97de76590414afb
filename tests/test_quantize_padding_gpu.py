"""On a CUDA GPU: an input whose K the quantize kernels do not take is zero-padded to the
kernel's K multiple and quantized by the kernels (backend "cute" takes it), bit for bit the
reference's codes, scales and global scale; a tile launch's input likewise to the tile
kernel's M and K multiples, every copy cut back (tests/test_quantize_padding.py checks the same
with the kernels stood in for on the CPU)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import fp4gen
from fp4gen.errors import TensorError
from fp4gen.formats import BUILTIN_FORMATS, E4M3, BlockFormat, ScaleSpec
from fp4gen.numerics.quantize import quantize as reference

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

FP8_1X128 = BlockFormat("fp8_block", E4M3, (1, 128), ScaleSpec(None, "nearest"), False)


@pytest.mark.parametrize(
    ("fmt", "cols"),
    [(FP8_1X128, 576), (FP8_1X128, 40), (BUILTIN_FORMATS["nvfp4"], 200)],
    ids=["fp8-576", "fp8-40", "nvfp4-200"],
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_refused_k_runs_on_the_kernels_with_the_reference_bits(fmt, cols, dtype) -> None:
    gen = torch.Generator(device="cuda").manual_seed(cols)
    x = (torch.randn(96, cols, device="cuda", generator=gen) * 5).to(dtype)
    got = fp4gen.quantize(x, fmt, backend="cute")
    want = reference(x, fmt)
    assert torch.equal(got.codes, want.codes)
    assert torch.equal(got.scales, want.scales)
    assert torch.equal(got.global_scale, want.global_scale)


def test_a_stochastic_copy_of_a_refused_k_is_not_padded() -> None:
    x = torch.randn(32, 200, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(TensorError, match="multiple of"):
        fp4gen.quantize(x, "nvfp4", rounding="stochastic", backend="cute")


NVFP4_2D = dataclasses.replace(BUILTIN_FORMATS["nvfp4"], name="nvfp4_16x16", block=(16, 16))
FP8_128X128 = BlockFormat("fp8_128x128", E4M3, (128, 128), ScaleSpec(None, "nearest"), False)


@pytest.mark.parametrize(
    ("fmt", "shape"),
    [(FP8_1X128, (203, 576)), (NVFP4_2D, (203, 72)), (FP8_128X128, (1003, 576))],
    ids=["fp8-1x128", "nvfp4-16x16", "fp8-128x128"],
)
def test_a_refused_tile_shape_runs_in_one_padded_launch_with_the_reference_bits(fmt, shape) -> None:
    """M 203 and K 576 or 72: neither the tile kernel's multiple; both copies from one padded
    launch, the columnwise one x.t()'s (1D) or the transpose of x's (2D tiles)."""
    from fp4gen.runtime import cute_backend

    gen = torch.Generator(device="cuda").manual_seed(shape[0])
    x = (torch.randn(shape, device="cuda", generator=gen) * 5).to(torch.bfloat16)
    outputs = (("rowwise", "nearest", None, 0), ("columnwise", "nearest", None, 0))
    got = cute_backend.quantize_tile_cute(x, fmt, outputs, seed=0)
    assert got is not None
    row = reference(x, fmt)
    col = row.transpose() if fmt.is_2d else reference(x.t().contiguous(), fmt)
    for q, want in zip(got, (row, col), strict=True):
        assert q.shape == want.shape
        assert torch.equal(q.codes, want.codes)
        assert torch.equal(q.scales, want.scales)
        assert torch.equal(q.global_scale, want.global_scale)
