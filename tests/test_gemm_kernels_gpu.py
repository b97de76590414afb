"""The generated fused GEMM (``fp4gen.gemm(backend="cute")``, Hopper sm_90a) against
``fp4gen.numerics.gemm_reference``.

Skipped without an sm_90 GPU (marker ``gpu``). Two kinds of checks:

exact   random codes (all 16 nibbles, -0 included) with block scales from small dyadic sets and
        global scales 1: every product and every partial sum is a multiple of a power of two
        that fp32 holds exactly (dyadic e4m3 {0, 1/2, 1, 2}: products are multiples of 2^-4
        and |sum| <= K * 144 < 2^20 for K <= 4096; subnormal e4m3 {0, 2^-9 .. 15 * 2^-9} with
        K <= 320: multiples of 2^-20, |sum| <= 320 * (6 * 15 * 2^-9)^2 < 2^4), so any summation
        order gives the float64 value and the fp32 output must be bit-identical (bf16 output:
        the float64 value rounded once). Catches any layout, permutation, scale-assignment or
        tail bug, however small.

tolerance  operands from the reference quantizer (randn, and a "wide" pattern: per-row
        magnitudes 2^-12 .. 2^12, 3% all-zero blocks, an outlier, which gives zero and
        subnormal e4m3 block scales), any global scales, bias, accumulate, bf16 and fp32 output.
        Derivation of the per-element bound, with u = 2^-24 and, per output element,
        ref = the exact result in float64 (gemm_reference rounded once, plus bias and C in
        float64) and S = S_a S_b sum_k |a_k b_k| (float64):
          * the products are exact: each decoded value v * s has at most 2 + 4 = 6 significant
            bits (e2m1 x e4m3; ue8m0 adds none) and is exact in bf16, a bf16 x bf16 product
            has at most 12 bits and is exact in fp32 (the arith decode's extra 2^-7 per
            operand and the epilogue's 2^14 are exact powers of two);
          * the fp32 accumulation of K products in any order (wgmma's tree, the k-tile
            chain, 1 to 4 accumulator sets) errs by at most (K - 1) u' S, with u' = 2u instead
            of u in case the tensor core truncates rather than rounds: 2 u K S;
          * the epilogue rounds alpha = S_a * S_b and acc * alpha: 4 u (|ref| + B), B the bound
            so far (gemm_reference's own fp32 rounding is inside this term);
          * bias and C add one fp32 rounding each: 2 u (|ref| + |bias| + |C| + B);
          * a bf16 output rounds once more: 2^-7 (|ref| + B) (one bf16 ulp, generous by 2).
        The prototype measured err/bound <= 0.5 (bf16, the output rounding itself) and <= 0.12
        (fp32) on H100: the accumulation error stays far below the K u' S worst case.
        The small-M kernels (M <= 64) sum in yet another order: mma.sync k16 chains per warp,
        the warps splitting K added in shared memory, the split-K partial tiles added in split
        order. Still K products summed in fp32 in some order, so the same 2 u K S holds.

The small-M kernels are checked at every tile (r16, r32, r64 and the benchmark's candidates:
ragged M and N tails, K from one block up), with split-K forced to 1 to 10 ways on exact
operands (bit-identical to the reference and so to each other), against the wgmma kernel on
the same operands, and for run-to-run determinism (the split-K counters reset themselves
between calls). Every kernel the file uses is compiled up front by worker processes into the
kernel cache.
"""

from __future__ import annotations

import itertools
import zlib

import pytest
import torch
from gpu_kernel_cache import compiled_cache

import fp4gen
from fp4gen.codegen.gemm import CANDIDATES, TILES, SmallMTile, gemm_spec, pick_tile
from fp4gen.codegen.gemm_configs import FUSED_MAX_M
from fp4gen.compiler import jit
from fp4gen.compiler.cache import default_root
from fp4gen.formats import BUILTIN_FORMATS
from fp4gen.gemm_dispatch import auto_backend
from fp4gen.numerics import QuantizedTensor, gemm_reference, quantize
from fp4gen.numerics.minifloat import decode
from fp4gen.runtime import kernels_for
from fp4gen.runtime.cute_gemm import fused_gemm, packed_codes

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
        reason="needs an sm_90 (Hopper) GPU",
    ),
]

U = 2.0**-24
NVFP4 = BUILTIN_FORMATS["nvfp4"]
MXFP4 = BUILTIN_FORMATS["mxfp4"]
DEV = "cuda"
ARCH = "sm_90a"


# ----------------------------------------------------------------------------------------------
# Operands
# ----------------------------------------------------------------------------------------------
def raw_operand(rows: int, k: int, fmt, scale_codes: list[int], seed: int) -> QuantizedTensor:
    """Random codes with scale codes drawn from ``scale_codes`` and S_dec = 1."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    codes = torch.randint(0, 16, (rows, k), generator=g, device=DEV, dtype=torch.uint8)
    br, bc = fmt.block
    pick = torch.randint(
        0, len(scale_codes), (-(-rows // br), -(-k // bc)), generator=g, device=DEV
    )
    sc = torch.tensor(scale_codes, dtype=torch.uint8, device=DEV)[pick]
    return QuantizedTensor(
        codes=codes,
        scales=decode(sc, fmt.scale.element),
        scale_codes=sc,
        global_scale=torch.ones((), device=DEV),
        format=fmt,
        rounding="nearest",
        rht=None,
        seed=0,
        offset=0,
        shape=torch.Size((rows, k)),
        dtype=torch.float32,
    )


_QUANTIZED: dict[tuple, QuantizedTensor] = {}


def quantized(rows: int, k: int, fmt, block, pattern: str, seed: int) -> QuantizedTensor:
    """The reference quantizer's operand (cached per operand)."""
    key = (rows, k, fmt.name, block, pattern, seed)
    if key not in _QUANTIZED:
        g = torch.Generator(device=DEV).manual_seed(seed)
        x = torch.randn(rows, k, generator=g, device=DEV)
        if pattern == "wide":
            e = torch.randint(-12, 13, (rows, 1), generator=g, device=DEV).float()
            x = x * torch.exp2(e)
            nb = -(-k // 16)
            zero = torch.rand(rows, nb, generator=g, device=DEV) < 0.03
            mask = zero.repeat_interleave(16, 1)[:, :k]
            x = x.masked_fill(mask, 0.0)
            x[0, 0] = 1e4
        _QUANTIZED[key] = quantize(x, fmt, block=block)
        if len(_QUANTIZED) > 16:
            _QUANTIZED.pop(next(iter(_QUANTIZED)))
    return _QUANTIZED[key]


def magnitude(a: QuantizedTensor, b: QuantizedTensor) -> torch.Tensor:
    """S = S_a S_b sum_k |a_k b_k| in float64."""
    va = a.dequantize_blockwise().double().abs()
    vb = b.dequantize_blockwise().double().abs()
    return (va @ vb.t()) * (float(a.global_scale) * float(b.global_scale))


def bound(ref64, S, k, out_dtype, extra=None) -> torch.Tensor:
    """The per-element tolerance of the module docstring."""
    b = 2 * U * k * S
    b = b + 4 * U * (ref64.abs() + b)
    if extra is not None:
        b = b + 2 * U * (ref64.abs() + extra + b)
    if out_dtype == torch.bfloat16:
        b = b + 2.0**-7 * (ref64.abs() + b)
    return b + 1e-30


# ----------------------------------------------------------------------------------------------
# Exact (bit-identical) cases
# ----------------------------------------------------------------------------------------------
DYADIC_E4M3 = [0x00, 0x30, 0x38, 0x40]  # 0, 1/2, 1, 2
SUBNORMAL_E4M3 = [0x00, 0x01, 0x02, 0x05, 0x07, 0x08, 0x0F]  # 0, 2^-9, ..., 15 * 2^-9
DYADIC_UE8M0 = [126, 127, 128]  # 1/2, 1, 2

EXACT_SHAPES = [
    (1, 64, 64),
    (16, 200, 128),
    (5, 70, 16),  # K = one NVFP4 block (half an MXFP4 block), padded to one k-tile
    (20, 130, 1000),  # small-M r32; K % 64 != 0
    (48, 8192, 320),  # small-M r64, K padded to 384 inside
    (100, 64, 4096),
    (128, 8192, 128),
    (16, 8192, 320),
    (100, 200, 192),
    (61, 37, 60),  # small-M r64, ragged M and N tails; K % 16 != 0: ragged last block, padded
]


EXACT_CASES = ["nvfp4_b2d", "nvfp4_b1d", "nvfp4_subnormal", "mxfp4"]


def exact_case(case: str):
    """(A format, B format, scale codes) of an exact case."""
    if case == "mxfp4":
        return MXFP4, MXFP4, DYADIC_UE8M0
    if case == "nvfp4_b2d":
        return NVFP4, NVFP4.with_block((16, 16)), DYADIC_E4M3
    return NVFP4, NVFP4, SUBNORMAL_E4M3 if case == "nvfp4_subnormal" else DYADIC_E4M3


@pytest.mark.parametrize(("m", "n", "k"), EXACT_SHAPES, ids=lambda v: str(v))
@pytest.mark.parametrize("case", EXACT_CASES)
def test_exact(case: str, m: int, n: int, k: int) -> None:
    seed = zlib.crc32(f"{case} {m} {n} {k}".encode())
    fa, fb, sset = exact_case(case)
    if case == "nvfp4_subnormal" and k > 320:
        pytest.skip("subnormal scales stay exact in fp32 for K <= 320 only")
    a = raw_operand(m, k, fa, sset, seed)
    b = raw_operand(n, k, fb, sset, seed + 1)
    ref = gemm_reference(a, b)
    assert auto_backend(a, b).backend == ("cute" if m <= FUSED_MAX_M else "dequant")
    if fb.is_2d:  # through the accumulate path (C = 0 adds nothing)
        got = fp4gen.gemm(a, b, accumulate=torch.zeros(m, n, device=DEV), backend="cute")
    else:  # through the bias path (bias 0 adds nothing)
        got = fp4gen.gemm(a, b, bias=torch.zeros(n, device=DEV), backend="cute")
    assert got.dtype == torch.float32 and got.shape == (m, n)
    assert torch.equal(got.view(torch.int32), ref.view(torch.int32)), (
        f"{int((got != ref).sum())} of {m * n} differ, max |err| {float((got - ref).abs().max())}"
    )


def test_exact_large_tile_bf16() -> None:
    """Above M = 256 the fused kernel takes the 128x256 tile; auto takes it too."""
    fb = NVFP4.with_block((16, 16))
    a = raw_operand(300, 256, NVFP4, DYADIC_E4M3, 7)
    b = raw_operand(520, 256, fb, DYADIC_E4M3, 8)
    got = fp4gen.gemm(a, b, out_dtype=torch.bfloat16, backend="cute")
    want = gemm_reference(a, b).to(torch.bfloat16)  # exact in fp32, rounded once
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    assert auto_backend(a, b).backend == "dequant"  # M > FUSED_MAX_M
    assert torch.equal(
        fp4gen.gemm(a, b, out_dtype=torch.bfloat16).view(torch.int16), got.view(torch.int16)
    )


# ----------------------------------------------------------------------------------------------
# Tolerance sweep against gemm_reference
# ----------------------------------------------------------------------------------------------
MS, NS, KS = (1, 16, 32, 48, 100, 128), (64, 200, 8192), (64, 128, 4096)
SHAPES = list(itertools.product(MS, NS, KS))
# rotated per shape: output dtype, bias, accumulate, B's block shape (NVFP4)
VARIANTS = [
    dict(out=torch.bfloat16, bias=False, acc=False, b2d=True),
    dict(out=torch.float32, bias=True, acc=False, b2d=False),
    dict(out=torch.float32, bias=False, acc=True, b2d=True),
    dict(out=torch.bfloat16, bias=True, acc=True, b2d=False),
]
MX_VARIANTS = [
    dict(out=torch.bfloat16, bias=False, acc=False, b2d=False),
    dict(out=torch.float32, bias=True, acc=False, b2d=False),
]


def check_tolerance(fa, fb, m, n, k, v, pattern, seed) -> None:
    a = quantized(m, k, fa, None, pattern, seed)
    b = quantized(n, k, fb, fb.block, pattern, seed + 1)
    g = torch.Generator(device=DEV).manual_seed(seed + 2)
    bias = torch.randn(n, generator=g, device=DEV) if v["bias"] else None
    acc = torch.randn(m, n, generator=g, device=DEV) if v["acc"] else None
    acc_copy = None if acc is None else acc.clone()
    got = fp4gen.gemm(a, b, out_dtype=v["out"], bias=bias, accumulate=acc, backend="cute")
    assert got.dtype == v["out"] and got.shape == (m, n)
    assert acc is None or torch.equal(acc, acc_copy), "accumulate was modified"
    assert bool(torch.isfinite(got).all())
    ref64 = gemm_reference(a, b).double()
    extra = None
    if bias is not None:
        ref64 = ref64 + bias.double()
        extra = bias.double().abs().expand(m, n)
    if acc is not None:
        ref64 = ref64 + acc.double()
        extra = (0 if extra is None else extra) + acc.double().abs()
    err = (got.double() - ref64).abs()
    tol = bound(ref64, magnitude(a, b), k, v["out"], extra)
    ratio = float((err / tol).max())
    assert ratio <= 1.0, f"max err / bound = {ratio:.3g} ({fa.name}, {v}, {pattern})"


@pytest.mark.parametrize(("m", "n", "k"), SHAPES, ids=lambda v: str(v))
def test_tolerance_nvfp4(m: int, n: int, k: int) -> None:
    i = SHAPES.index((m, n, k))
    v = VARIANTS[i % len(VARIANTS)]
    fb = NVFP4.with_block((16, 16)) if v["b2d"] else NVFP4
    check_tolerance(NVFP4, fb, m, n, k, v, "wide" if i % 3 == 2 else "randn", 11 * i)


def test_split_k_with_accumulate_is_the_same_bits_every_call() -> None:
    """The small-M kernel's split-K sums its partial tiles in split order, so every call gives
    the same bits. Repeated on the shape and variant of test_tolerance_nvfp4[32-8192-4096]
    (fp32 out, accumulate, 16x16 B, "wide" values), which failed once in a whole-suite run and
    passed in the next. This test then failed in a whole-suite run (-n 16): the r32 tile's 10
    stages let a stage change readers (docs/gemm-sm90.md, "Every stage has fixed readers"); the
    tile has 12 now. benchmarks/gemm_stress.py repeats it under load, as found."""
    m, n, k = 32, 8192, 4096
    i = SHAPES.index((m, n, k))
    v = VARIANTS[i % len(VARIANTS)]
    fb = NVFP4.with_block((16, 16)) if v["b2d"] else NVFP4
    a = quantized(m, k, NVFP4, None, "wide", 11 * i)
    b = quantized(n, k, fb, fb.block, "wide", 11 * i + 1)
    acc = torch.randn(m, n, generator=torch.Generator(device=DEV).manual_seed(7), device=DEV)
    first = fp4gen.gemm(a, b, out_dtype=torch.float32, accumulate=acc, backend="cute")
    for _ in range(30):
        again = fp4gen.gemm(a, b, out_dtype=torch.float32, accumulate=acc, backend="cute")
        assert torch.equal(again, first)
    ref64 = gemm_reference(a, b).double() + acc.double()
    tol = bound(ref64, magnitude(a, b), k, torch.float32, acc.double().abs())
    assert float(((first.double() - ref64).abs() / tol).max()) <= 1.0


@pytest.mark.parametrize(("m", "n", "k"), SHAPES, ids=lambda v: str(v))
def test_tolerance_mxfp4(m: int, n: int, k: int) -> None:
    i = SHAPES.index((m, n, k))
    v = MX_VARIANTS[i % len(MX_VARIANTS)]
    check_tolerance(MXFP4, MXFP4, m, n, k, v, "wide" if i % 3 == 1 else "randn", 13 * i)


def test_auto_takes_the_fused_kernel_up_to_fused_max_m() -> None:
    fb = NVFP4.with_block((16, 16))
    a = quantized(16, 4096, NVFP4, None, "randn", 1)
    b = quantized(200, 4096, fb, fb.block, "randn", 2)
    assert auto_backend(a, b).backend == "cute"
    bf16 = torch.bfloat16
    fused = fp4gen.gemm(a, b, out_dtype=bf16, backend="cute")
    assert torch.equal(fp4gen.gemm(a, b, out_dtype=bf16), fused)  # auto, and deterministic
    big = quantized(300, 4096, NVFP4, None, "randn", 3)
    assert auto_backend(big, b).backend == "dequant"
    assert torch.equal(fp4gen.gemm(big, b), fp4gen.gemm(big, b, backend="dequant"))


# ----------------------------------------------------------------------------------------------
# Small-M kernels: split-K, agreement with the wgmma kernel, the workspace between calls
# ----------------------------------------------------------------------------------------------
SPLIT_K = 2560  # 40 k-tiles: 10 stages of 4, 20 of 2, 40 of 1
# (tile, M, N) of the split-K cases: every small-M tile of TILES and CANDIDATES, NVFP4 and
# MXFP4 (whose A scale codes the kernels read one per 32 values)
SPLIT_CASES = [
    *[
        (name, TILES[name].tile_m - 3, 200, pair)
        for name in ("r16", "r32", "r64")
        for pair in ("nvfp4_b2d", "mxfp4")
    ],
    *[(name, 13, 130, pair) for name in CANDIDATES for pair in ("nvfp4_b2d", "mxfp4")],
]


def small_tile(name: str):
    return TILES[name] if name in TILES else CANDIDATES[name]


@pytest.mark.parametrize(("tile", "m", "n", "pair"), SPLIT_CASES, ids=str)
def test_split_k_is_exact(tile: str, m: int, n: int, pair: str) -> None:
    """Forced split counts (1, 2, 3, 4, 7 ways and one stage per split; 7 ways of 10 stages
    leave the last split empty) on exact operands: every count gives the reference bit for
    bit. Ragged M and N tails."""
    fa, fb, sset = exact_case(pair)
    a = raw_operand(m, SPLIT_K, fa, sset, 31)
    b = raw_operand(n, SPLIT_K, fb, sset, 32)
    spec = gemm_spec(fa, fb, m, out_dtype="fp32", tile=small_tile(tile))
    loaded = kernels_for(spec, ARCH)
    stages = SPLIT_K // loaded.module.STAGE_K
    ref = gemm_reference(a, b)
    for splits in sorted({1, 2, 3, 4, 7, stages}):
        out = torch.full((m, n), float("nan"), device=DEV)
        loaded.module.run(
            loaded.fns,
            a.codes,
            a.scale_codes,
            a.global_scale,
            packed_codes(b),
            b.scale_codes,
            b.global_scale,
            k=SPLIT_K,
            out=out,
            splits=splits,
        )
        assert torch.equal(out.view(torch.int32), ref.view(torch.int32)), (
            f"{splits} ways: {int((out != ref).sum())} of {m * n} differ"
        )


@pytest.mark.parametrize("m", [1, 16, 32, 48, 64])
def test_small_m_tiles_agree_with_the_wgmma_kernel(m: int) -> None:
    """The same exact operands through the small-M tile of M and the wgmma 64x64 tile."""
    fa, fb, sset = exact_case("nvfp4_b2d")
    a = raw_operand(m, 2048, fa, sset, 40 + m)
    b = raw_operand(300, 2048, fb, sset, 41)
    ref = gemm_reference(a, b)
    kw = dict(out_dtype=torch.float32, bias=None, accumulate=None, arch=ARCH)
    small = fused_gemm(a, b, **kw)
    wgmma = fused_gemm(a, b, **kw, tile=TILES["small"])
    assert isinstance(pick_tile(m), SmallMTile)
    assert torch.equal(small, ref) and torch.equal(wgmma, ref)


def test_split_k_workspace_is_reused_across_calls() -> None:
    """Calls on one stream share a workspace; the last CTA of each tile resets its counter, so
    repeated calls (and a call of another shape in between) stay exact."""
    fa, fb, sset = exact_case("nvfp4_b1d")
    a = raw_operand(16, 4096, fa, sset, 50)
    b = raw_operand(8192, 4096, fb, sset, 51)
    c = raw_operand(16, 4096, fa, sset, 52)
    ref_ab, ref_cb = gemm_reference(a, b), gemm_reference(c, b)
    for _ in range(3):
        assert torch.equal(fp4gen.gemm(a, b, backend="cute"), ref_ab)
        assert torch.equal(fp4gen.gemm(c, b, backend="cute"), ref_cb)


# ----------------------------------------------------------------------------------------------
# Every kernel of this file, compiled up front
# ----------------------------------------------------------------------------------------------
def kernel_spec(fa, fb, m: int, out: torch.dtype, bias: bool, acc: bool, tile=None):
    """The spec fp4gen.gemm(backend="cute") picks for these operands and flags."""
    bf16 = out == torch.bfloat16 and not acc
    return gemm_spec(
        fa, fb, m, out_dtype="bf16" if bf16 else "fp32", bias=bias, accumulate=acc, tile=tile
    )


def used_specs() -> list:
    specs = []
    for case, (m, _, _) in itertools.product(EXACT_CASES, EXACT_SHAPES):
        fa, fb, _ = exact_case(case)
        specs.append(kernel_spec(fa, fb, m, torch.float32, not fb.is_2d, fb.is_2d))
    b2d = NVFP4.with_block((16, 16))
    specs.append(kernel_spec(NVFP4, b2d, 300, torch.bfloat16, False, False))
    specs.append(kernel_spec(NVFP4, b2d, 16, torch.bfloat16, False, False))
    specs.append(kernel_spec(NVFP4, b2d, 300, torch.float32, False, False))
    for i, (m, _, _) in enumerate(SHAPES):
        v = VARIANTS[i % len(VARIANTS)]
        fb = b2d if v["b2d"] else NVFP4
        specs.append(kernel_spec(NVFP4, fb, m, v["out"], v["bias"], v["acc"]))
        v = MX_VARIANTS[i % len(MX_VARIANTS)]
        specs.append(kernel_spec(MXFP4, MXFP4, m, v["out"], v["bias"], v["acc"]))
    for tile, _, _, pair in SPLIT_CASES:
        fa, fb, _ = exact_case(pair)
        specs.append(kernel_spec(fa, fb, 1, torch.float32, False, False, small_tile(tile)))
    for m in (1, 16, 32, 48, 64):
        specs.append(kernel_spec(NVFP4, b2d, m, torch.float32, False, False))
    specs.append(kernel_spec(NVFP4, b2d, 1, torch.float32, False, False, TILES["small"]))
    specs.append(kernel_spec(NVFP4, NVFP4, 16, torch.float32, False, False))
    return list(dict.fromkeys(specs))


@pytest.fixture(scope="session", autouse=True)
def compiled_kernels() -> None:
    """Compile every kernel of this file in worker processes into the kernel cache that
    fp4gen.gemm loads from (a few seconds instead of a minute of compiles one by one)."""
    compiled_cache(None, "", used_specs(), jit.render_source, ARCH, root=default_root())
