"""Block-scaled accumulation (numerics.md 6.1) without a GPU: the float64 reference against the
exact dequantized product and the derived bound, the dispatch rule, the scaled_mm scale layouts
and what ``fp4gen show`` says."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

import fp4gen
import fp4gen.gemm_dispatch as gd
from fp4gen.errors import FP4GenError
from fp4gen.formats import BUILTIN_FORMATS, BlockFormat, ScaleSpec
from fp4gen.gemm_dispatch import GemmChoice, choose_backend, gemm_path
from fp4gen.numerics import (
    block_scaled_error_bound,
    gemm_block_scaled_reference,
    gemm_reference,
    k_segments,
    quantize,
)
from fp4gen.numerics.block_scaled import U32
from fp4gen.numerics.minifloat import decode
from fp4gen.runtime import fp8_gemm

E4M3 = BUILTIN_FORMATS["mxfp8_e4m3"].element
E5M2 = BUILTIN_FORMATS["mxfp8_e5m2"].element
ROW = BlockFormat("fp8_block", E4M3, (1, 128), ScaleSpec(None))
TILE = ROW.with_block((128, 128))
ROW_E5M2 = BlockFormat("fp8_e5m2_block", E5M2, (1, 128), ScaleSpec(None))


def dyadic(q, g: torch.Generator, lo: int = -3, hi: int = 3):
    """``q`` with its block scales replaced by random powers of two 2^lo .. 2^hi."""
    e = torch.randint(lo, hi + 1, q.scales.shape, generator=g).to(torch.float32)
    return replace(q, scales=torch.exp2(e))


def fp32_emulation(a, b) -> torch.Tensor:
    """Block-scaled accumulation carried out in fp32, one rounding per operation in the order
    of numerics.md 6.1 (the per-block sums left to right): what the bound is derived for."""
    qa = decode(a.codes, a.element).to(torch.float32)
    qb = decode(b.codes, b.element).to(torch.float32)
    sa = a.scales.repeat_interleave(min(a.format.block[0], a.rows), 0)[: a.rows]
    sb = b.scales.repeat_interleave(min(b.format.block[0], b.rows), 0)[: b.rows]
    bka, bkb = min(a.format.block[1], a.cols), min(b.format.block[1], b.cols)
    c = torch.zeros(a.rows, b.rows, dtype=torch.float32)
    for k0, k1 in k_segments(bka, bkb, a.cols):
        partial = torch.zeros(a.rows, b.rows, dtype=torch.float32)
        for i in range(k0, k1):  # exact products (fp32 holds 8 x 8 significant bits)
            partial = partial + qa[:, i, None] * qb[None, :, i]
        scale = sa[:, k0 // bka, None] * sb[None, :, k0 // bkb]  # one fp32 rounding
        c = c + scale * partial  # two more
    return c * (a.global_scale * b.global_scale)


# ----------------------------------------------------------------------------------------------
# The reference
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("b_fmt", [TILE, ROW, ROW_E5M2])
@pytest.mark.parametrize(("m", "n", "k"), [(1, 16, 128), (7, 130, 384), (33, 50, 300)])
def test_reference_equals_the_exact_product_with_dyadic_scales(b_fmt, m, n, k) -> None:
    # powers of two make x = code * s exact in fp32 and float64, and every partial sum and
    # scaled term exact in float64: both compute the exact sum, rounded once to fp32
    g = torch.Generator().manual_seed(m * n + k)
    a = dyadic(quantize(torch.randn(m, k, generator=g), ROW), g)
    b = dyadic(quantize(torch.randn(n, k, generator=g), b_fmt), g)
    got = gemm_block_scaled_reference(a, b)
    assert got.dtype == torch.float32 and got.shape == (m, n)
    assert torch.equal(got, gemm_reference(a, b))


@pytest.mark.parametrize(("m", "n", "k"), [(5, 20, 256), (16, 48, 1000)])
def test_reference_is_within_the_bound_otherwise(m, n, k) -> None:
    g = torch.Generator().manual_seed(k)
    a = quantize(torch.randn(m, k, generator=g) * 3, ROW)
    b = quantize(torch.randn(n, k, generator=g), TILE)
    ref = gemm_block_scaled_reference(a, b).double()
    exact = gemm_reference(a, b).double()
    # both round a float64 value once to fp32 (<= 2^-24 |C| each); the dequantized path's
    # values fp32(code * s) carry up to 2^-24 relative error each, 2 * 2^-24 per product
    va, vb = a.dequantize_blockwise().double().abs(), b.dequantize_blockwise().double().abs()
    bound = 2.1 * U32 * (va @ vb.t()) + 2 * U32 * exact.abs()
    assert ((ref - exact).abs() <= bound).all()
    assert not torch.equal(ref, exact)  # non-dyadic fp32 scales: the two do differ somewhere


@pytest.mark.parametrize(("b_fmt", "k"), [(TILE, 1024), (ROW, 384), (TILE, 200)])
def test_fp32_accumulation_is_within_the_derived_bound(b_fmt, k) -> None:
    g = torch.Generator().manual_seed(3)
    a = quantize(torch.randn(9, k, generator=g) * 100, ROW)
    b = quantize(torch.randn(24, k, generator=g), b_fmt)
    ref = gemm_block_scaled_reference(a, b).double()
    got = fp32_emulation(a, b).double()
    # the oracle itself is one fp32 rounding of the exact value: 2^-24 |C| on top of the bound
    bound = block_scaled_error_bound(a, b) + U32 * ref.abs()
    err = (got - ref).abs()
    assert (err <= bound).all()
    assert err.max() > 0  # the emulation does round (the bound is not checked vacuously)


def test_bound_counts_the_roundings() -> None:
    g = torch.Generator().manual_seed(0)
    a = quantize(torch.randn(2, 1024, generator=g), ROW)
    b = quantize(torch.randn(3, 1024, generator=g), TILE)
    r = (128 - 1) + 2 + (8 - 1) + 2  # in-block additions, 2 scale products, 7 block sums, alpha
    va, vb = a.dequantize_blockwise().double().abs(), b.dequantize_blockwise().double().abs()
    expected = r * U32 / (1 - r * U32) * (va @ vb.t()) * (1 + 2 * U32) ** 2
    assert torch.allclose(block_scaled_error_bound(a, b), expected, rtol=1e-12, atol=0)


def test_k_segments() -> None:
    assert k_segments(128, 128, 300) == [(0, 128), (128, 256), (256, 300)]
    assert k_segments(32, 128, 96) == [(0, 32), (32, 64), (64, 96)]
    assert k_segments(16, 24, 48) == [(0, 16), (16, 24), (24, 32), (32, 48)]


def test_reference_bias_global_scale_and_errors() -> None:
    g = torch.Generator().manual_seed(1)
    # fp32 block scales take no global scale (formats.global_scale_problem): e4m3 ones do
    fmt = replace(ROW, scale=ScaleSpec(E4M3), global_scale=True)
    a = quantize(torch.randn(4, 256, generator=g), fmt)
    b = quantize(torch.randn(8, 256, generator=g), fmt)
    assert float(a.global_scale) != 1.0
    bias = torch.randn(8, generator=g)
    got = gemm_block_scaled_reference(a, b, bias=bias, out_dtype=torch.bfloat16)
    want = (gemm_block_scaled_reference(a, b) + bias).bfloat16()
    assert torch.equal(got, want)
    with pytest.raises(fp4gen.TensorError, match="K mismatch"):
        gemm_block_scaled_reference(a, quantize(torch.randn(8, 128), fmt))
    with pytest.raises(TypeError):
        gemm_block_scaled_reference(a, torch.zeros(8, 256))


def test_block_scaled_backend_on_cpu_is_the_reference() -> None:
    g = torch.Generator().manual_seed(2)
    a = quantize(torch.randn(6, 256, generator=g), ROW)
    b = quantize(torch.randn(10, 256, generator=g), TILE)
    acc = torch.randn(6, 10, generator=g)
    got = fp4gen.gemm(a, b, backend="block_scaled", accumulate=acc)
    assert torch.equal(got, acc + gemm_block_scaled_reference(a, b))


# ----------------------------------------------------------------------------------------------
# Dispatch (pure logic)
# ----------------------------------------------------------------------------------------------
MXFP8 = BUILTIN_FORMATS["mxfp8_e4m3"]
ROW_64, ROW_256, TILE_256 = (
    ROW.with_block((1, 64)),
    ROW.with_block((1, 256)),
    ROW.with_block((256, 256)),
)


@pytest.mark.parametrize(
    ("a", "b", "arch", "backend", "fallback", "why"),
    [
        (ROW, TILE, "sm_90a", "block_scaled", False, "BlockWise1x128 x BlockWise128x128"),
        (ROW, ROW, "sm_90a", "block_scaled", False, "BlockWise1x128 x BlockWise1x128"),
        # the pairs scaled_mm refuses and the generated FP8 kernel takes: the same semantics
        (ROW_E5M2, TILE, "sm_90a", "cute", False, "e5m2 1x128 x e4m3 128x128 fp32 (scaled_mm"),
        (ROW_E5M2, ROW_E5M2, "sm_90a", "cute", False, "an operand has e5m2"),
        (ROW_64, ROW_64, "sm_90a", "cute", False, "e4m3 1x64 x e4m3 1x64 fp32"),
        (ROW_256, TILE_256, "sm_90a", "cute", False, "A has 1x256 blocks"),
        # and those neither serves
        (TILE, ROW, "sm_90a", "dequant", True, "A has 128x128 blocks"),
        (ROW_64, ROW, "sm_90a", "dequant", True, "A has 1x64 blocks"),
        (ROW_E5M2, TILE, "sm_100a", "dequant", True, "no native MMA on sm_100a"),
        (ROW, TILE, "sm_80", "dequant", True, "runs on sm_90a only"),
        (ROW, TILE, "sm_120a", "dequant", True, "runs on sm_90a only"),
        (ROW, TILE, "sm_100a", "dequant", True, "no native MMA on sm_100a"),
        (MXFP8, MXFP8, "sm_90a", "dequant", True, "no fused GEMM kernel: A has e4m3 elements"),
    ],
)
def test_auto_backend_for_fp8_pairs(a, b, arch, backend, fallback, why) -> None:
    choice = choose_backend(a, b, 7, 4096, 4096, device="cuda", arch=arch)
    assert (choice.backend, choice.fallback) == (backend, fallback), choice
    assert why in choice.why
    assert choose_backend(a, b, 7, 64, 64, device="cpu", arch=None).backend == "reference"


def test_exact_semantics_keeps_the_dequantized_product() -> None:
    for a, b in ((ROW, TILE), (ROW_E5M2, TILE), (ROW_64, ROW_64)):
        choice = choose_backend(a, b, 8192, 8192, 8192, device="cuda", arch="sm_90a",
                                semantics="exact")  # fmt: skip
        assert choice == GemmChoice("dequant", choice.why, fallback=False)
        assert "exact products requested" in choice.why
    assert gd.fp8_semantics_setting() == "block_scaled"
    with gd.fp8_semantics("exact"):
        assert gd.fp8_semantics_setting() == "exact"
    assert gd.fp8_semantics_setting() == "block_scaled"
    with pytest.raises(FP4GenError, match="unknown FP8 GEMM semantics 'tf32'"):
        gd.set_fp8_semantics("tf32")
    assert "block_scaled" in gd.BACKENDS


def test_a_product_past_32_bit_indices_keeps_the_exact_path() -> None:
    # the generated kernel indexes C with 32 bits: M * N >= 2^31 takes the dequantized product
    choice = choose_backend(ROW_E5M2, TILE, 2**16, 2**15, 256, device="cuda", arch="sm_90a")
    assert (choice.backend, choice.fallback) == ("dequant", True), choice
    choice = choose_backend(ROW_E5M2, TILE, 2**16, 2**15 - 1, 256, device="cuda", arch="sm_90a")
    assert choice.backend == "cute", choice


def test_auto_passes_the_semantics(monkeypatch) -> None:
    seen = []

    def spy(*args, **kwargs):
        seen.append(kwargs["semantics"])
        return GemmChoice("reference", "test")

    monkeypatch.setattr(gd, "choose_backend", spy)
    a = quantize(torch.randn(2, 128), ROW)
    gd.auto_backend(a, a)
    with gd.fp8_semantics("exact"):
        gd.auto_backend(a, a)
    assert seen == ["block_scaled", "exact"]


def test_unavailable_scaled_mm_falls_back_once(monkeypatch, caplog) -> None:
    g = torch.Generator().manual_seed(4)
    a = quantize(torch.randn(8, 256, generator=g), ROW)
    b = quantize(torch.randn(12, 256, generator=g), TILE)
    expected = fp4gen.gemm(a, b, backend="dequant")
    monkeypatch.setattr(gd, "_logged", set())
    monkeypatch.setattr(gd, "auto_backend", lambda a, b: GemmChoice("block_scaled", "test"))

    def unavailable(*args):
        raise FP4GenError("the block-scaled FP8 GEMM does not serve this pair: test")

    monkeypatch.setattr(gd, "_block_scaled", unavailable)
    with caplog.at_level("INFO", logger="fp4gen.gemm_dispatch"):
        for _ in range(3):
            assert torch.equal(fp4gen.gemm(a, b), expected)
    (record,) = caplog.records
    assert record.getMessage().endswith("does not serve this pair: test")


def test_format_support_reasons() -> None:
    assert fp8_gemm.support(ROW, TILE) is None
    assert fp8_gemm.support(ROW, ROW) is None
    assert "e4m3 only" in fp8_gemm.support(ROW, ROW_E5M2)
    assert "ue8m0 block scales" in fp8_gemm.support(MXFP8.with_block((1, 128)), TILE)
    assert "e2m1 elements" in fp8_gemm.support(BUILTIN_FORMATS["nvfp4"], TILE)
    finite = replace(ROW, element=replace(E4M3, special="finite"))
    assert "A has e4m3 finite elements" in fp8_gemm.support(finite, TILE)
    assert "high precision" in fp8_gemm.support(fp4gen.formats.HighPrecision("bf16"), TILE)
    assert fp8_gemm.arch_reason("sm_90a") is None
    assert "sm_90a only" in fp8_gemm.arch_reason("sm_100a")


# ----------------------------------------------------------------------------------------------
# scaled_mm layouts (pure tensor logic)
# ----------------------------------------------------------------------------------------------
def test_outer_major_scales() -> None:
    s = torch.arange(21, dtype=torch.float32).reshape(7, 3)  # [M = 7, K/128 = 3]
    out = fp8_gemm.outer_major_scales(s, 16)
    assert out.shape == (16, 3) and out.stride() == (1, 16)  # scale_a: strides (1, M)
    assert torch.equal(out[:7], s) and not out[7:].any()
    # the memory order: K-block-major columns of M scales each
    flat = out.t().contiguous().flatten()
    assert torch.equal(flat[:7], s[:, 0]) and torch.equal(flat[16:23], s[:, 1])


def test_tile_scales() -> None:
    s = torch.arange(15, dtype=torch.float32).reshape(3, 5)  # [N/128 = 3, K/128 = 5]
    out = fp8_gemm.tile_scales(s)
    assert out.shape == (8, 3) and out.stride() == (1, 8)  # [L4, N/128], strides (1, L4)
    for j in range(3):
        for kb in range(5):
            assert out[kb, j] == s[j, kb]  # element [K-block, n-block]
    assert not out[5:].any()
    square = fp8_gemm.tile_scales(torch.ones(64, 64))
    assert square.stride() == (1, 64)  # what scaled_mm's "strides (1, 64)" asked for


def test_unpadded_scale_layouts_are_fully_written() -> None:
    """Without padding the buffers are not zeroed first (a launch less per call): every element
    must come from the scales."""
    s = torch.arange(1, 33, dtype=torch.float32).reshape(16, 2)
    out = fp8_gemm.outer_major_scales(s, 16, torch.tensor(2.0))
    assert torch.equal(out, 2 * s) and out.stride() == (1, 16)
    t = torch.arange(1, 25, dtype=torch.float32).reshape(3, 8)  # K/128 = 8: a multiple of 4
    out = fp8_gemm.tile_scales(t)
    assert torch.equal(out, t.t()) and out.stride() == (1, 8)


@pytest.mark.parametrize(("m", "n", "k"), [(1, 16, 128), (7, 130, 300), (129, 256, 1024)])
def test_operands_pad_and_keep_values(m, n, k) -> None:
    g = torch.Generator().manual_seed(m + n + k)
    a = quantize(torch.randn(m, k, generator=g), ROW)
    b = quantize(torch.randn(n, k, generator=g), TILE)
    ops = fp8_gemm.Operands(a, b)
    assert (ops.mp, ops.np, ops.kp) == (
        math.ceil(m / 16) * 16,
        math.ceil(n / 16) * 16,
        math.ceil(k / 128) * 128,
    )
    assert ops.mat_a.dtype == torch.float8_e4m3fn and ops.mat_a.shape == (ops.mp, ops.kp)
    assert ops.mat_b.shape == (ops.kp, ops.np) and ops.mat_b.stride() == (1, ops.kp)
    # decoding the padded operands with the converted scales gives the dequantized values
    kb = math.ceil(k / 128)
    sa = ops.scale_a[:m].repeat_interleave(128, 1)[:, :k]
    assert torch.equal(ops.mat_a[:m, :k].float() * sa, a.dequantize_blockwise())
    sb = ops.scale_b[:kb].t().repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]
    assert torch.equal(ops.mat_b.t()[:n, :k].float() * sb, b.dequantize_blockwise())
    assert not ops.mat_a[m:].float().any() and not ops.mat_a[:, k:].float().any()
    # a C computed from the converted operands, block by block, is the reference
    c = torch.zeros(ops.mp, ops.np, dtype=torch.float64)
    for blk in range(kb):
        cols = slice(128 * blk, 128 * blk + 128)
        p = ops.mat_a[:, cols].double() @ ops.mat_b[cols, :].double()
        s_b = ops.scale_b[blk].double().repeat_interleave(128)[: ops.np]
        c += ops.scale_a[:, blk, None].double() * s_b[None, :] * p
    assert torch.equal(c[:m, :n].float(), gemm_block_scaled_reference(a, b))


def test_operands_of_a_1x128_pair() -> None:
    g = torch.Generator().manual_seed(9)
    a = quantize(torch.randn(40, 256, generator=g), ROW)
    b = quantize(torch.randn(24, 256, generator=g), ROW)
    ops = fp8_gemm.Operands(a, b)
    assert ops.scale_b.shape == (32, 2) and ops.scale_b.stride() == (1, 32)
    assert torch.equal(ops.scale_b[:24], b.scales)
    assert ops.recipe_b == torch.nn.functional.ScalingType.BlockWise1x128
    assert fp8_gemm.Operands(a, quantize(torch.randn(24, 256), TILE)).recipe_b == (
        torch.nn.functional.ScalingType.BlockWise128x128
    )


def test_block_scaled_gemm_needs_cuda() -> None:
    a = quantize(torch.randn(8, 128), ROW)
    with pytest.raises(fp4gen.TensorError, match="one CUDA device"):
        fp8_gemm.block_scaled_gemm(a, a)


# ----------------------------------------------------------------------------------------------
# fp4gen show
# ----------------------------------------------------------------------------------------------
def test_gemm_path_of_the_fp8_recipes() -> None:
    path, why = gemm_path(ROW, TILE)
    assert path.startswith("block-scaled FP8 GEMM on sm_90a: torch scaled_mm BlockWise1x128 x ")
    assert "dequantize to fp32 + fp32 GEMM (no TF32)" in path  # the exact path, still named
    assert "numerics.md 6.1" in why and "28 significant bits" in why
    path, why = gemm_path(MXFP8, MXFP8)
    assert path.startswith("dequantize to bf16 + cuBLAS")
    assert "no block-scaled FP8 GEMM on sm_90a" in why and "sm_100+ only" in why


def test_show_names_the_block_scaled_path(capsys) -> None:
    from pathlib import Path

    from fp4gen.cli import main

    recipes = Path(__file__).resolve().parent.parent / "recipes"
    assert main(["show", str(recipes / "fp8_blockwise.fp4r")]) == 0
    out = capsys.readouterr().out
    lines = {line.split()[0]: line for line in out.splitlines() if line.startswith("wgrad  ")}
    assert "scaled_mm BlockWise1x128 x BlockWise1x128" in lines["wgrad"]
    assert "scaled_mm BlockWise1x128 x BlockWise128x128" in out  # fprop and dgrad
    assert main(["show", str(recipes / "mxfp8.fp4r")]) == 0
    out = capsys.readouterr().out
    assert "runs 1x32 ue8m0 (MX) scaling on sm_100+ only" in out
