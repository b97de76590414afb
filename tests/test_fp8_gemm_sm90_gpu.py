"""The generated block-scaled FP8 GEMM (``backend="cute"`` for FP8 pairs,
fp4gen.kernels.gemm_sm90_fp8) on a Hopper GPU against the float64 oracle
``gemm_block_scaled_reference`` (docs/numerics.md 6.1).

* Bit-exact where every intermediate is exact: integer codes |q| <= 4 and power-of-two block
  scales 2^0 .. 2^2 (fp32 or ue8m0 codes 127 .. 129), so every K-block's partial sum is an
  integer below 2^13 (exact in the tensor cores' adder, which keeps at least 13 fraction bits
  of the largest aligned term) and every scaled term and the whole sum are integers below 2^24
  (exact in fp32): the result is the oracle's, rounded once to the output dtype, for every
  pair, shape (tails of M, N and K; more tiles than SMs), output dtype, bias and accumulate.
* Otherwise within ``bound()``: numerics.md 6.1's fp32 bound plus the Hopper tensor-core term
  (per K-block of L values, L / 32 wgmma k=32 steps of 33 aligned terms each, at most
  L / 32 * 33 * 2^-13 sum_block |p|: a worst case; the measured ratio is printed), plus the
  output dtype's rounding.

The kernel's variants are tested alike: one or two partial accumulators, 2-CTA clusters, the
coalesced variant (MN-major scales, whole-sector stores; ``-k coalesced``) and 192-wide tiles
(``-k wide_tile``). Run on an sm_90 GPU: pytest -m gpu tests/test_fp8_gemm_sm90_gpu.py
"""

from __future__ import annotations

import math

import pytest
import torch
from sm90_fp8 import E4M3, MARKS

import fp4gen
from fp4gen.codegen.gemm_fp8 import tile_n_for
from fp4gen.formats import BUILTIN_FORMATS, UE8M0, BlockFormat, ScaleSpec
from fp4gen.numerics import (
    QuantizedTensor,
    block_scaled_error_bound,
    gemm_block_scaled_reference,
    quantize,
)
from fp4gen.runtime import fp8_gemm

pytestmark = MARKS

E5M2 = BUILTIN_FORMATS["mxfp8_e5m2"].element
UNIT = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}


def fp8(element, block: tuple[int, int], scale=None) -> BlockFormat:
    return BlockFormat("fp8_test", element, block, ScaleSpec(scale))


ROW = fp8(E4M3, (1, 128))
TILE = fp8(E4M3, (128, 128))
# (A, B): the fp8_blockwise pairs, e5m2 on either side, 1x64 / 1x256 blocks, MXFP8's 1x32 ue8m0
PAIRS = {
    "1x128 x 128x128": (ROW, TILE),
    "1x128 x 1x128": (ROW, ROW),
    "e5m2 x e4m3": (fp8(E5M2, (1, 128)), ROW),
    "e4m3 x e5m2 tiles": (ROW, fp8(E5M2, (128, 128))),
    "1x64 x 64x64": (fp8(E4M3, (1, 64)), fp8(E4M3, (64, 64))),
    "1x256 x 1x256": (fp8(E4M3, (1, 256)), fp8(E4M3, (1, 256))),
    "1x256 x 256x256": (fp8(E4M3, (1, 256)), fp8(E4M3, (256, 256))),
    "mxfp8 1x32 ue8m0": (BUILTIN_FORMATS["mxfp8_e4m3"], BUILTIN_FORMATS["mxfp8_e4m3"]),
}
# (M, N, K): one partial tile; tails of M, N and K (K padded to whole blocks; K = 160: MXFP8's
# 5 scale codes per row padded to a 4-byte word); more tiles than SMs (the persistent loop and
# the stage phases across tiles); a long K
SHAPES = [
    (1, 32, 128),
    (7, 144, 384),
    (33, 96, 160),
    (129, 200, 1000),
    (2048, 2048, 256),
    (512, 768, 4096),
]


def integer_operand(rows: int, k: int, fmt: BlockFormat, g: torch.Generator) -> QuantizedTensor:
    """Codes of the integers -4 .. 4 and block scales 2^0 .. 2^2 (ue8m0 codes 127 .. 129)."""
    values = torch.randint(-4, 5, (rows, k), generator=g).to(torch.float32)
    dtype = torch.float8_e4m3fn if fmt.element == E4M3 else torch.float8_e5m2
    codes = values.to(dtype).view(torch.uint8)
    br, bc = fmt.block
    shape = (math.ceil(rows / min(br, rows)), math.ceil(k / min(bc, k)))
    exponents = torch.randint(0, 3, shape, generator=g)
    scales = torch.exp2(exponents.to(torch.float32))
    scale_codes = None
    if fmt.scale.element == UE8M0:
        scale_codes = (exponents + 127).to(torch.uint8).cuda()
    return QuantizedTensor(
        codes=codes.cuda(),
        scales=scales.cuda(),
        scale_codes=scale_codes,
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
    va = a.dequantize_blockwise().double().abs()
    vb = b.dequantize_blockwise().double().abs()
    return (va @ vb.t()) * (1 + 2 * 2.0**-24) ** 2


def bound(a: QuantizedTensor, b: QuantizedTensor, ref: torch.Tensor, out_dtype) -> torch.Tensor:
    """|C_gpu - C_ref| bound (module docstring)."""
    block_k = a.format.block[1]
    tc_rel = block_k / 32 * 33 * 2.0**-13
    fp32_and_tc = block_scaled_error_bound(a, b) + tc_rel * sum_abs(a, b)
    return fp32_and_tc + (UNIT[out_dtype] + 2.0**-24) * (ref.double().abs() + fp32_and_tc)


def check_within(got, ref, limit, what: str) -> None:
    err = (got.double() - ref.double()).abs()
    worst = float((err / limit.clamp_min(1e-300)).max())
    rel = float(err.norm() / ref.double().norm().clamp_min(1e-300))
    print(f"{what}: max err / bound = {worst:.3g}, relative Frobenius error {rel:.3g}")
    assert (err <= limit).all(), f"{what}: error exceeds the bound by x{worst:.3g}"


def set_coalesced(monkeypatch, on: bool) -> None:
    """The coalesced variant on or off: MN-major scales, whole-sector stores
    (fp8_gemm.CUTE_MN_MAJOR_SCALES, CUTE_WIDE_STORES)."""
    monkeypatch.setattr(fp8_gemm, "CUTE_MN_MAJOR_SCALES", on)
    monkeypatch.setattr(fp8_gemm, "CUTE_WIDE_STORES", on)


@pytest.fixture(
    params=[(False, False), (True, False), (False, True)],
    ids=["one_partial", "overlap", "coalesced"],
)
def overlap(request, monkeypatch) -> bool:
    """Each kernel variant: one partial accumulator, or two (fp8_gemm.CUTE_OVERLAP); and
    the coalesced variant (one partial accumulator)."""
    on, coalesced = request.param
    monkeypatch.setattr(fp8_gemm, "CUTE_OVERLAP", on)
    set_coalesced(monkeypatch, coalesced)
    return on


@pytest.mark.parametrize("pair", list(PAIRS))
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_exact_on_integer_inputs(pair, shape, out_dtype, overlap) -> None:
    m, n, k = shape
    fa, fb = PAIRS[pair]
    g = torch.Generator().manual_seed(m * 7 + n * 13 + k)
    a, b = integer_operand(m, k, fa, g), integer_operand(n, k, fb, g)
    got = fp4gen.gemm(a, b, backend="cute", out_dtype=out_dtype)
    want = gemm_block_scaled_reference(a, b).to(out_dtype)
    assert got.dtype == out_dtype and got.shape == (m, n)
    assert torch.equal(got, want), f"{pair} {shape}: {(got.double() - want.double()).abs().max()}"


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32, torch.float16])
def test_bias_and_accumulate_exact(out_dtype, overlap) -> None:
    """y = C + bias + accumulate in fp32, one rounding: integer bias and accumulator keep it
    exact (the kernel adds both in fp32, as the reference's order)."""
    m, n, k = 130, 272, 640
    g = torch.Generator().manual_seed(5)
    a, b = integer_operand(m, k, ROW, g), integer_operand(n, k, TILE, g)
    bias = torch.randint(-64, 65, (n,), generator=g).to(torch.bfloat16).cuda()
    acc = torch.randint(-1000, 1001, (m, n), generator=g).to(torch.float32).cuda()
    keep = acc.clone()
    ref = gemm_block_scaled_reference(a, b)
    got = fp4gen.gemm(a, b, backend="cute", out_dtype=out_dtype, bias=bias)
    assert torch.equal(got, (ref + bias.float()).to(out_dtype))
    got = fp4gen.gemm(a, b, backend="cute", out_dtype=out_dtype, bias=bias, accumulate=acc)
    assert torch.equal(got, (ref + bias.float() + acc).to(out_dtype))
    assert torch.equal(acc, keep)  # the accumulator given is not modified


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32, torch.float16])
def test_out_gets_the_kernels_result(out_dtype) -> None:
    """``gemm(..., backend="cute", out=t)``: the kernel writes a bf16 or fp32 result straight
    into t (a layer graph's result tensor: no copy after it), fp16 is rounded from its fp32
    result into t; t is returned, exact, with a bias too."""
    m, n, k = 130, 272, 640
    g = torch.Generator().manual_seed(8)
    a, b = integer_operand(m, k, ROW, g), integer_operand(n, k, TILE, g)
    bias = torch.randint(-64, 65, (n,), generator=g).to(torch.bfloat16).cuda()
    ref = gemm_block_scaled_reference(a, b)
    for with_bias in (None, bias):
        out = torch.full((m, n), float("nan"), dtype=out_dtype, device="cuda")
        got = fp4gen.gemm(a, b, backend="cute", out_dtype=out_dtype, bias=with_bias, out=out)
        want = ref if with_bias is None else ref + bias.float()
        assert got is out and torch.equal(out, want.to(out_dtype))


def test_global_scales_are_applied() -> None:
    """S_dec(A) S_dec(B) as the kernel's alpha (powers of two: still exact), and a NaN S_dec
    (an input with a NaN) makes every output NaN."""
    g = torch.Generator().manual_seed(9)
    a, b = integer_operand(64, 256, ROW, g), integer_operand(96, 256, TILE, g)
    a.global_scale.fill_(2.0)
    b.global_scale.fill_(0.25)
    got = fp4gen.gemm(a, b, backend="cute")
    assert torch.equal(got, gemm_block_scaled_reference(a, b))
    b.global_scale.fill_(float("nan"))
    assert fp4gen.gemm(a, b, backend="cute").isnan().all()


@pytest.mark.parametrize("pair", list(PAIRS))
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_random_data_within_the_bound(pair, out_dtype, overlap) -> None:
    """Gaussian data quantized by the reference quantizer, outliers included: within the
    block-scaled bound of the oracle."""
    fa, fb = PAIRS[pair]
    m, n, k = 384, 320, 2048
    g = torch.Generator(device="cuda").manual_seed(3)
    x = torch.randn(m, k, device="cuda", generator=g)
    w = torch.randn(n, k, device="cuda", generator=g)
    x[5, 100] = 300.0
    w[7, 900] = -200.0
    a, b = quantize(x, fa), quantize(w, fb)
    got = fp4gen.gemm(a, b, backend="cute", out_dtype=out_dtype)
    ref = gemm_block_scaled_reference(a, b)
    check_within(got, ref, bound(a, b, ref, out_dtype), f"cute {pair} {out_dtype}")


def test_agrees_with_scaled_mm_on_fp8_blockwise() -> None:
    """The two block_scaled implementations of the fp8_blockwise fprop pair, each within the
    bound of the oracle at a training-like shape."""
    g = torch.Generator(device="cuda").manual_seed(4)
    x = torch.randn(1024, 4096, device="cuda", generator=g)
    w = torch.randn(2048, 4096, device="cuda", generator=g) * 0.02
    a, b = quantize(x, ROW), quantize(w, TILE)
    ref = gemm_block_scaled_reference(a, b)
    limit = bound(a, b, ref, torch.bfloat16)
    for backend in ("cute", "block_scaled"):
        got = fp4gen.gemm(a, b, backend=backend, out_dtype=torch.bfloat16)
        check_within(got, ref, limit, backend)


def test_coalesced_variant_is_bit_identical_to_the_row_major_one(monkeypatch) -> None:
    """Random data with outliers: the coalesced variant reads the same scales and sums in
    the same order, so its result is the other variant's bit for bit (fp8_blockwise's three
    pairs, bf16 and fp32 outputs, a bias)."""
    g = torch.Generator(device="cuda").manual_seed(6)
    x = torch.randn(1000, 2048, device="cuda", generator=g)
    w = torch.randn(776, 2048, device="cuda", generator=g) * 0.02
    x[3, 7] = 500.0
    bias = torch.randn(776, device="cuda", generator=g)
    for fa, fb in ((ROW, TILE), (ROW, ROW), (fp8(E5M2, (1, 128)), ROW)):
        a, b = quantize(x, fa), quantize(w, fb)
        for out_dtype in (torch.bfloat16, torch.float32):
            got = {}
            for coalesced in (False, True):
                set_coalesced(monkeypatch, coalesced)
                got[coalesced] = fp4gen.gemm(a, b, backend="cute", out_dtype=out_dtype, bias=bias)
            assert torch.equal(got[True], got[False]), (fa.block, fb.block, out_dtype)


# N past a multiple of 8 (bf16: element stores for the row's last columns) and odd (fp32:
# element stores too); M = 1 and M past a multiple of 16 (the MN-major scales' padded rows)
TAIL_SHAPES = [(65, 203, 256), (130, 36, 384), (1, 1, 128), (300, 8, 512)]


@pytest.mark.parametrize("pair", list(PAIRS))
@pytest.mark.parametrize("shape", TAIL_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_coalesced_variant_tails_exact(pair, shape, monkeypatch) -> None:
    """The coalesced variant where its wide stores give way to element stores (N not a
    multiple of 8, odd N) and its scale chunks reach past the rows: the oracle bit for bit on
    integer inputs, bf16 and fp32 outputs, with a bias and accumulate."""
    set_coalesced(monkeypatch, True)
    monkeypatch.setattr(fp8_gemm, "CUTE_OVERLAP", False)
    m, n, k = shape
    fa, fb = PAIRS[pair]
    g = torch.Generator().manual_seed(m * 3 + n * 5 + k)
    a, b = integer_operand(m, k, fa, g), integer_operand(n, k, fb, g)
    ref = gemm_block_scaled_reference(a, b)
    for out_dtype in (torch.bfloat16, torch.float32):
        got = fp4gen.gemm(a, b, backend="cute", out_dtype=out_dtype)
        assert torch.equal(got, ref.to(out_dtype)), f"{pair} {shape} {out_dtype}"
    bias = torch.randint(-64, 65, (n,), generator=g).float().cuda()
    acc = torch.randint(-1000, 1001, (m, n), generator=g).float().cuda()
    got = fp4gen.gemm(a, b, backend="cute", out_dtype=torch.bfloat16, bias=bias)
    assert torch.equal(got, (ref + bias).bfloat16())
    got = fp4gen.gemm(a, b, backend="cute", bias=bias, accumulate=acc)
    assert torch.equal(got, ref + bias + acc)


# B in tiles: the pairs the 192-wide tile takes (fp8_gemm.CUTE_TILE_N)
WIDE_TILE_PAIRS = ["1x128 x 128x128", "e4m3 x e5m2 tiles", "1x256 x 256x256"]
# N = 192 (one tile), 384 (two: the second's boundary at column 64), 200 and 203 (tails); more
# tiles than SMs; a long K
WIDE_TILE_SHAPES = [(7, 192, 384), (129, 384, 1000), (65, 203, 256), (2048, 2048, 256),
                    (300, 200, 4096), (130, 36, 384)]  # fmt: skip


@pytest.mark.parametrize(
    "coalesced, cluster_m",
    [(False, 1), (True, 1), (True, 2)],
    ids=["row_major", "coalesced", "coalesced_c2x1"],
)
@pytest.mark.parametrize("pair", WIDE_TILE_PAIRS)
@pytest.mark.parametrize("shape", WIDE_TILE_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_wide_tile_exact(pair, shape, cluster_m, coalesced, monkeypatch) -> None:
    """128 x 192 output tiles (each spanning one or two of B's scale tiles, split at a column
    that depends on the tile): the oracle bit for bit on integer inputs, bf16 and fp32
    outputs, a bias and accumulate; one CTA or 2-CTA clusters."""
    monkeypatch.setattr(fp8_gemm, "CUTE_TILE_N", 192)
    monkeypatch.setattr(fp8_gemm, "CUTE_TILE_BY_SHAPE", False)  # 192 at every shape
    monkeypatch.setattr(fp8_gemm, "CUTE_OVERLAP", False)
    monkeypatch.setattr(fp8_gemm, "CUTE_CLUSTER_M", cluster_m)
    set_coalesced(monkeypatch, coalesced)
    m, n, k = shape
    fa, fb = PAIRS[pair]
    assert fp8_gemm.cute_plan(fa, fb, torch.bfloat16, False, False).params.tile_n == 192
    g = torch.Generator().manual_seed(m * 11 + n * 3 + k)
    a, b = integer_operand(m, k, fa, g), integer_operand(n, k, fb, g)
    ref = gemm_block_scaled_reference(a, b)
    for out_dtype in (torch.bfloat16, torch.float32):
        got = fp4gen.gemm(a, b, backend="cute", out_dtype=out_dtype)
        assert torch.equal(got, ref.to(out_dtype)), f"{pair} {shape} {out_dtype}"
    bias = torch.randint(-64, 65, (n,), generator=g).float().cuda()
    acc = torch.randint(-1000, 1001, (m, n), generator=g).float().cuda()
    got = fp4gen.gemm(a, b, backend="cute", bias=bias, accumulate=acc)
    assert torch.equal(got, ref + bias + acc)


def test_wide_tile_is_bit_identical_on_random_data(monkeypatch) -> None:
    """Random data with outliers, the fp8_blockwise fprop pair: the 192-wide tile's result
    is the 128-wide one's bit for bit (the same products and sums per element)."""
    g = torch.Generator(device="cuda").manual_seed(8)
    x = torch.randn(1000, 2048, device="cuda", generator=g)
    w = torch.randn(1000, 2048, device="cuda", generator=g) * 0.02
    x[3, 7] = 500.0
    a, b = quantize(x, ROW), quantize(w, TILE)
    got = {}
    monkeypatch.setattr(fp8_gemm, "CUTE_TILE_BY_SHAPE", False)
    for tile_n in (128, 192):
        monkeypatch.setattr(fp8_gemm, "CUTE_TILE_N", tile_n)
        got[tile_n] = fp4gen.gemm(a, b, backend="cute", out_dtype=torch.float32)
    assert torch.equal(got[128], got[192])


@pytest.mark.parametrize("shape", [(4096, 4096, 512), (8192, 8192, 256), (16, 8192, 256)])
def test_the_tile_width_by_shape_gives_the_same_bits(shape, monkeypatch) -> None:
    """The width a call's shape picks (fp8_gemm.cute_tile_n: 128 where 192-wide tiles leave a
    partial last wave) is the one launched, and its result is the other width's bit for bit,
    for the fp8_blockwise fprop pair on random data, with a bias."""
    m, n, k = shape
    g = torch.Generator(device="cuda").manual_seed(m + n)
    x = torch.randn(m, k, device="cuda", generator=g)
    w = torch.randn(n, k, device="cuda", generator=g) * 0.02
    bias = torch.randn(n, device="cuda", generator=g)
    a, b = quantize(x, ROW), quantize(w, TILE)
    monkeypatch.setattr(fp8_gemm, "CUTE_TILE_N", 192)
    picked = fp8_gemm.cute_tile_n(ROW, TILE, m, n, a.device)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    assert picked == tile_n_for(m, n, sms, 192)
    fn, _, _ = fp8_gemm.cute_launch(a, b, out_dtype=torch.bfloat16, bias=bias)
    plan = fp8_gemm.cute_plan(ROW, TILE, torch.bfloat16, True, False, picked)
    assert fn is fp8_gemm.cute_kernel(plan.params) and plan.params.tile_n == picked
    got = fp4gen.gemm(a, b, backend="cute", out_dtype=torch.bfloat16, bias=bias)
    monkeypatch.setattr(fp8_gemm, "CUTE_TILE_BY_SHAPE", False)
    monkeypatch.setattr(fp8_gemm, "CUTE_TILE_N", 320 - picked)  # the other width
    assert torch.equal(got, fp4gen.gemm(a, b, backend="cute", out_dtype=torch.bfloat16, bias=bias))


CLUSTER_PAIRS = ["1x128 x 128x128", "1x128 x 1x128", "mxfp8 1x32 ue8m0", "1x256 x 256x256"]
# odd M-tile counts (the cluster's second CTA past M), one unit, more units than clusters
CLUSTER_SHAPES = [(1, 32, 128), (300, 256, 512), (129, 200, 1000), (2048, 2048, 256)]


@pytest.mark.parametrize(
    "overlap_too, coalesced",
    [(False, False), (True, False), (True, True)],
    ids=["one_partial", "overlap", "coalesced_overlap"],
)
@pytest.mark.parametrize("pair", CLUSTER_PAIRS)
@pytest.mark.parametrize("shape", CLUSTER_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_cluster_of_two_exact(pair, shape, overlap_too, coalesced, monkeypatch) -> None:
    """2-CTA clusters (B multicast, fp8_gemm.CUTE_CLUSTER_M = 2): the oracle bit for bit on
    integer inputs, as one CTA gives it; a bias and accumulate too."""
    monkeypatch.setattr(fp8_gemm, "CUTE_CLUSTER_M", 2)
    monkeypatch.setattr(fp8_gemm, "CUTE_OVERLAP", overlap_too)
    set_coalesced(monkeypatch, coalesced)
    m, n, k = shape
    fa, fb = PAIRS[pair]
    g = torch.Generator().manual_seed(m + n + k)
    a, b = integer_operand(m, k, fa, g), integer_operand(n, k, fb, g)
    ref = gemm_block_scaled_reference(a, b)
    assert torch.equal(fp4gen.gemm(a, b, backend="cute", out_dtype=torch.bfloat16), ref.bfloat16())
    bias = torch.randint(-64, 65, (n,), generator=g).float().cuda()
    acc = torch.randint(-1000, 1001, (m, n), generator=g).float().cuda()
    got = fp4gen.gemm(a, b, backend="cute", bias=bias, accumulate=acc)
    assert torch.equal(got, ref + bias + acc)
