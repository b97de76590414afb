"""The block_scaled backend on a Hopper GPU (torch scaled_mm, cuBLASLt 1x128 / 128x128 block
scaling) against the float64 oracle ``gemm_block_scaled_reference`` (numerics.md 6.1).

* Bit-exact where the oracle is exactly representable: small integer codes (|q| <= 4, so every
  partial sum is an integer below 2^13 and exact in any accumulator with 13 fraction bits) and
  power-of-two scales 2^0 .. 2^2 (every scaled term and the whole sum are integers below 2^24):
  the exact C, rounded once to the output dtype, on every path.
* Otherwise within ``bound()``: the fp32 bound of numerics.md 6.1 plus the Hopper tensor-core
  term (section 6.1, "Hopper"): each 128-wide K-block is summed by 4 wgmma k=32 steps whose
  adder keeps at least 13 fraction bits of the largest of the 33 aligned terms, truncating, so
  it adds at most 4 * 33 * 2^-13 sum_block |p| per block (a worst case; the measured error is
  printed and is orders of magnitude below it), plus the output dtype's rounding.
* Layout probes that name the wrong orientation if the scale layout assumption breaks.

Run on an sm_90 GPU: pytest -m gpu tests/test_fp8_gemm_gpu.py
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from sm90_fp8 import E4M3, sm90_marks

import fp4gen
import fp4gen.gemm_dispatch as gd
from fp4gen.dsl import load_recipe
from fp4gen.formats import BUILTIN_FORMATS, BlockFormat, ScaleSpec
from fp4gen.numerics import (
    QuantizedTensor,
    block_scaled_error_bound,
    gemm_block_scaled_reference,
    quantize,
)
from fp4gen.runtime import fp8_gemm, quantize_dispatch

pytestmark = sm90_marks("cuBLAS 1x128 / 128x128 block scaling runs on sm_90 only")

E5M2 = BUILTIN_FORMATS["mxfp8_e5m2"].element
ROW = BlockFormat("fp8_block", E4M3, (1, 128), ScaleSpec(None))
TILE = ROW.with_block((128, 128))
ROW_E5M2 = BlockFormat("fp8_e5m2_block", E5M2, (1, 128), ScaleSpec(None))
TC_REL = 4 * 33 * 2.0**-13  # the tensor-core adder term per K-block (module docstring)
UNIT = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}
SHAPES = [(1, 16, 128), (7, 144, 384), (129, 256, 1024), (256, 128, 256), (512, 768, 8192)]


def integer_operand(rows: int, k: int, fmt: BlockFormat, g: torch.Generator) -> QuantizedTensor:
    """Codes of the integers -4 .. 4 and block scales 2^0 .. 2^2, on the GPU."""
    values = torch.randint(-4, 5, (rows, k), generator=g).to(torch.float32)
    dtype = torch.float8_e4m3fn if fmt.element == E4M3 else torch.float8_e5m2
    codes = values.to(dtype).view(torch.uint8)
    br, bc = fmt.block
    shape = (math.ceil(rows / min(br, rows)), math.ceil(k / min(bc, k)))
    scales = torch.exp2(torch.randint(0, 3, shape, generator=g).to(torch.float32))
    return QuantizedTensor(
        codes=codes.cuda(),
        scales=scales.cuda(),
        scale_codes=None,
        global_scale=torch.ones((), device="cuda"),
        format=fmt,
        rounding="nearest",
        rht=None,
        seed=0,
        offset=0,
        shape=torch.Size((rows, k)),
        dtype=torch.float32,
    )


def sum_abs(a: QuantizedTensor, b: QuantizedTensor) -> torch.Tensor:
    """sum_k |S s_a s_b q_a q_b| (upper bound: the fp32 block values carry 2^-24 each)."""
    va = a.dequantize_blockwise().double().abs()
    vb = b.dequantize_blockwise().double().abs()
    return (va @ vb.t()) * (1 + 2 * 2.0**-24) ** 2


def bound(a: QuantizedTensor, b: QuantizedTensor, ref: torch.Tensor, out_dtype) -> torch.Tensor:
    """|C_gpu - C_ref| bound (module docstring): the fp32 bound of numerics.md 6.1, the
    tensor-core term, the output's rounding and the oracle's own rounding to fp32 (of a value
    within the first two terms of ref)."""
    fp32_and_tc = block_scaled_error_bound(a, b) + TC_REL * sum_abs(a, b)
    return fp32_and_tc + (UNIT[out_dtype] + 2.0**-24) * (ref.double().abs() + fp32_and_tc)


def check_within(got, ref, limit, what: str) -> None:
    err = (got.double() - ref.double()).abs()
    worst = float((err / limit.clamp_min(1e-300)).max())
    rel = float(err.norm() / ref.double().norm().clamp_min(1e-300))
    print(f"{what}: max err / bound = {worst:.3g}, relative Frobenius error {rel:.3g}")
    assert (err <= limit).all(), f"{what}: error exceeds the bound by x{worst:.3g}"


# ----------------------------------------------------------------------------------------------
# Layout probes: which scale reaches which output
# ----------------------------------------------------------------------------------------------
def ones_operand(rows: int, k: int, fmt: BlockFormat) -> QuantizedTensor:
    g = torch.Generator().manual_seed(0)
    q = integer_operand(rows, k, fmt, g)
    one = torch.ones((), dtype=torch.float32).to(torch.float8_e4m3fn).view(torch.uint8)
    q.codes.fill_(int(one))
    q.scales.fill_(1.0)
    return q


def test_probe_b_tile_scale_orientation() -> None:
    a = ones_operand(128, 256, ROW)
    b = ones_operand(256, 256, TILE)
    b.scales[1, 0] = 2.0  # n-block 1 (outputs 128..255), K-block 0
    c = fp4gen.gemm(a, b, backend="block_scaled").cpu()
    expected = torch.full((128, 256), 256.0)
    expected[:, 128:] = 128 * 2.0 + 128
    if not torch.equal(c, expected):
        swapped = torch.full((128, 256), 256.0)
        swapped[:, :128] = 384.0
        hint = (
            "scale_b is read as [n-block, K-block] (transposed): the tile_scales layout is wrong"
            if torch.equal(c, swapped)
            else "scale_b is read in an unexpected order"
        )
        pytest.fail(f"{hint}; C[0, ::64] = {c[0, ::64].tolist()}")


@pytest.mark.parametrize("b_fmt", [ROW, TILE])
def test_probe_a_row_scale_orientation(b_fmt) -> None:
    a = ones_operand(64, 384, ROW)
    b = ones_operand(128, 384, b_fmt)
    a.scales[3, 2] = 4.0  # row 3, K-block 2
    c = fp4gen.gemm(a, b, backend="block_scaled").cpu()
    expected = torch.full((64, 128), 384.0)
    expected[3] = 256 + 4 * 128.0
    assert torch.equal(c, expected), (
        f"scale_a [M, K/128] (strides (1, M)) is not read as expected: rows changed "
        f"{sorted(set(torch.nonzero(c != 384.0)[:, 0].tolist()))}, C[3, 0] = {float(c[3, 0])}"
    )


def test_probe_b_row_scale_orientation() -> None:
    a = ones_operand(16, 256, ROW)
    b = ones_operand(48, 256, ROW)
    b.scales[5, 1] = 2.0  # output column 5, K-block 1
    c = fp4gen.gemm(a, b, backend="block_scaled").cpu()
    expected = torch.full((16, 48), 256.0)
    expected[:, 5] = 128 + 2 * 128.0
    assert torch.equal(c, expected), (
        f"1x128 scale_b [N, K/128] (strides (1, N)) is not read as expected: columns changed "
        f"{sorted(set(torch.nonzero(c != 256.0)[:, 1].tolist()))}"
    )


@pytest.mark.parametrize("m", [1, 7, 100])
def test_probe_unpadded_m(m: int) -> None:
    """Whether scaled_mm takes an M that is not a multiple of 16 as it is (fp4gen pads it to
    ROW_ALIGN either way): skipped with torch's message when refused, checked when taken."""
    g = torch.Generator().manual_seed(m)
    a = integer_operand(m, 256, ROW, g)
    b = integer_operand(128, 256, TILE, g)
    scale_a = fp8_gemm.outer_major_scales(a.scales, m)
    try:
        c = F.scaled_mm(
            a.codes.view(torch.float8_e4m3fn),
            b.codes.view(torch.float8_e4m3fn).t(),
            scale_a,
            F.ScalingType.BlockWise1x128,
            fp8_gemm.tile_scales(b.scales),
            F.ScalingType.BlockWise128x128,
            output_dtype=torch.float32,
        )
    except (RuntimeError, ValueError) as err:
        pytest.skip(f"scaled_mm refuses M = {m} unpadded: {err}")
    assert torch.equal(c, gemm_block_scaled_reference(a, b))


# ----------------------------------------------------------------------------------------------
# Bit-exact where the oracle is exact
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("b_fmt", [TILE, ROW])
@pytest.mark.parametrize(("m", "n", "k"), SHAPES)
def test_exact_integer_inputs(m, n, k, b_fmt, out_dtype) -> None:
    g = torch.Generator().manual_seed(m * 7 + n + k)
    a = integer_operand(m, k, ROW, g)
    b = integer_operand(n, k, b_fmt, g)
    assert gd.auto_backend(a, b).backend == "block_scaled"
    got = fp4gen.gemm(a, b, out_dtype=out_dtype)
    ref = gemm_block_scaled_reference(a, b, out_dtype=out_dtype)
    assert got.dtype == out_dtype and got.shape == (m, n) and got.is_contiguous()
    diff = (got.double() - ref.double()).abs()
    assert torch.equal(got, ref), (
        f"max |diff| {float(diff.max())} at {divmod(int(diff.argmax()), n)}"
    )


@pytest.mark.parametrize("bias_dtype", [None, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("m", "n", "k"), [(256, 128, 256), (129, 256, 1024), (7, 144, 384)])
def test_out_gets_the_product_written_there(m, n, k, out_dtype, bias_dtype) -> None:
    """``gemm(..., out=t)`` (a layer graph's result tensors): where nothing is left after the
    product (no fp32 step, M and N unpadded) cuBLASLt writes it into t (one fewer pass over C),
    else it is copied there; either way t holds the bits of the call without ``out`` (random
    values: the same op with the same arguments) and is returned."""
    if bias_dtype == torch.float32 and out_dtype == torch.bfloat16:
        pytest.skip("an fp32 bias with a bf16 output: the shared epilogue's, covered below")
    g = torch.Generator().manual_seed(m + n + k)
    a = quantize_dispatch.quantize(torch.randn(m, k, generator=g).cuda(), ROW)
    b = quantize_dispatch.quantize((torch.randn(n, k, generator=g) * 0.02).cuda(), TILE)
    bias = None if bias_dtype is None else torch.randn(n, generator=g).to(bias_dtype).cuda()
    want = fp4gen.gemm(a, b, bias=bias, out_dtype=out_dtype)
    out = torch.full((m, n), float("nan"), dtype=out_dtype, device="cuda")
    got = fp4gen.gemm(a, b, bias=bias, out_dtype=out_dtype, out=out)
    assert got is out and torch.equal(out, want)
    direct = fp8_gemm.scaled_mm_out_op() is not None and m % 16 == 0 and n % 16 == 0
    direct = direct and (bias is None or bias.dtype == out_dtype != torch.float32)
    seen: list[torch.Tensor] = []
    real = fp8_gemm.scaled_mm_into

    def spy(ops, epilogue_bias, target):
        seen.append(target)
        return real(ops, epilogue_bias, target)

    fp8_gemm.scaled_mm_into = spy
    try:
        out.fill_(float("nan"))
        fp4gen.gemm(a, b, bias=bias, out_dtype=out_dtype, out=out)
    finally:
        fp8_gemm.scaled_mm_into = real
    assert torch.equal(out, want)
    assert [t is out for t in seen] == ([True] if direct else []), (direct, len(seen))


def test_e5m2_takes_the_exact_path() -> None:
    """torch's block-wise scaled_mm refuses e5m2: the pair falls back to the exact dequantized
    GEMM, which equals the block-scaled reference here (integer codes, dyadic scales: both
    exact)."""
    g = torch.Generator().manual_seed(11)
    a = integer_operand(40, 512, ROW_E5M2, g)
    b = integer_operand(64, 512, TILE, g)
    assert torch.equal(fp4gen.gemm(a, b), gemm_block_scaled_reference(a, b))


def test_exact_k_not_a_multiple_of_128() -> None:
    g = torch.Generator().manual_seed(12)
    a = integer_operand(32, 200, ROW, g)  # the last K-block holds 72 elements
    b = integer_operand(48, 200, TILE, g)
    assert torch.equal(fp4gen.gemm(a, b, backend="block_scaled"), gemm_block_scaled_reference(a, b))


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("with_accumulate", [False, True])
def test_bias_and_accumulate_follow_the_reference(out_dtype, with_accumulate) -> None:
    """An fp32 bias (and accumulate) with every output dtype: C exact, then the same fp32
    epilogue as the reference (an fp32 output once came back without the bias)."""
    g = torch.Generator().manual_seed(13)
    a = integer_operand(100, 256, ROW, g)
    b = integer_operand(96, 256, TILE, g)
    bias = torch.randn(96, generator=g).cuda() * 8
    acc = torch.randn(100, 96, generator=g).cuda() if with_accumulate else None
    for backend in ("auto", "block_scaled"):
        got = fp4gen.gemm(a, b, bias=bias, accumulate=acc, out_dtype=out_dtype, backend=backend)
        ref = gemm_block_scaled_reference(a, b, bias=bias)
        want = (ref if acc is None else acc + ref).to(out_dtype)
        assert torch.equal(got, want), backend


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n", [96, 88])  # 88: N padded to 96 for scaled_mm, the bias with it
def test_a_bias_of_the_output_dtype_goes_into_the_epilogue(out_dtype, n) -> None:
    """A 16-bit bias of the output's dtype is added by cuBLASLt's epilogue: to the fp32 sum,
    rounded once, the reference's order (C is exact here, so the bits must be equal)."""
    g = torch.Generator().manual_seed(14 + n)
    a = integer_operand(100, 256, ROW, g)
    b = integer_operand(n, 256, TILE, g)
    bias = (torch.randn(n, generator=g) * 8).to(out_dtype).cuda()
    got = fp4gen.gemm(a, b, bias=bias, out_dtype=out_dtype, backend="block_scaled")
    assert got.dtype == out_dtype and got.shape == (100, n)
    assert torch.equal(got, gemm_block_scaled_reference(a, b, bias=bias, out_dtype=out_dtype))


# ----------------------------------------------------------------------------------------------
# Within the bound otherwise
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("b_fmt", [TILE, ROW])
@pytest.mark.parametrize(("m", "n", "k"), SHAPES)
def test_random_inputs_within_the_bound(m, n, k, b_fmt, out_dtype) -> None:
    g = torch.Generator().manual_seed(m + n * 3 + k)
    # rows of very different magnitudes, so the block scales differ by many binades
    x = torch.randn(m, k, generator=g) * torch.exp2(torch.randint(-20, 20, (m, 1), generator=g))
    w = torch.randn(n, k, generator=g) * 0.02
    a = quantize_dispatch.quantize(x.cuda(), ROW)  # the kernels where they serve it
    b = quantize_dispatch.quantize(w.cuda(), b_fmt)
    got = fp4gen.gemm(a, b, out_dtype=out_dtype)
    ref = gemm_block_scaled_reference(a, b)
    check_within(got, ref, bound(a, b, ref, out_dtype), f"{m}x{n}x{k} {b_fmt.block}")


# ----------------------------------------------------------------------------------------------
# fp4gen.nn.Linear with the fp8_blockwise recipe
# ----------------------------------------------------------------------------------------------
def magnitudes(x, w, dy):
    """sum |p| of the three GEMMs from the codes the layer quantizes (the reference quantizer
    gives the kernels' codes bit for bit)."""

    def deq(t, fmt):
        return quantize(t, fmt).dequantize_blockwise().double().abs()

    xq, wq, dyq = deq(x, ROW), deq(w, TILE), deq(dy, ROW)
    return (xq @ wq.t(), dyq @ wq, deq(dy.t().contiguous(), ROW) @ deq(x.t().contiguous(), ROW).t())


@pytest.mark.parametrize("tokens", [1, 7, 200, 1024])
def test_linear_forward_backward_against_exact(tokens: int) -> None:
    recipe = load_recipe("fp8_blockwise.fp4r")
    torch.manual_seed(tokens)
    layer = fp4gen.nn.Linear(384, 256, recipe=recipe, seed=1, device="cuda")
    with torch.no_grad():  # a bias far above the tolerance below: a dropped one fails
        layer.bias.normal_(0.0, 4.0)
    x = torch.randn(tokens, 384, device="cuda")
    dy = torch.randn(tokens, 256, device="cuda")

    def step():
        layer.weight.grad = None
        xi = x.clone().requires_grad_(True)
        y = layer(xi)
        y.backward(dy)
        return y.detach(), xi.grad.detach(), layer.weight.grad.detach()

    seen = []
    real = gd.auto_backend

    def spy(a, b):
        choice = real(a, b)
        seen.append(choice.backend)
        return choice

    gd.auto_backend = spy
    try:
        fast = step()
        with gd.fp8_semantics("exact"):
            exact = step()
    finally:
        gd.auto_backend = real
    assert seen == ["block_scaled"] * 3 + ["dequant"] * 3
    padded = math.ceil(tokens / 128) * 128  # wgrad's K after the layer's zero tokens
    for got, want, mag, k, what in zip(
        fast, exact, magnitudes(x, layer.weight.detach(), dy), (384, 256, padded),
        ("fprop", "dgrad", "wgrad"), strict=True,
    ):  # fmt: skip
        # both approximate the exact product: block-scaled within gamma_r + TC_REL, the exact
        # path within gamma_(K+4) (fp32 block values, their fp32 products, K - 1 additions),
        # each rounded to the fp32 output
        nb = math.ceil(k / 128)
        r = (128 - 1) + 2 + (nb - 1) + 2
        tol = ((r + k + 4) * 2.0**-24 * 1.01 + TC_REL) * mag + 2 * 2.0**-24 * want.double().abs()
        check_within(got, want, tol, f"Linear {what}, {tokens} tokens")
