"""The generated dequantize kernel and the dequantize + cuBLAS GEMM path on a GPU (sm_90a or
sm_100a; marker ``gpu``).

dequantize  bit-exact against ``QuantizedTensor.dequantize_blockwise().to(torch.bfloat16)`` (the
        reference's fp32 element x block scale, one rounding to bf16) for NVFP4 1D and 2D,
        MXFP4, MXFP6, MXFP8, the exotic recipe's e3m2 1x8, blocks of several units (1x24),
        blocks that straddle the kernel's 8-value units (1x12) and 32x32 tiles with ue5m0
        scales; one code per byte and packed 4-bit codes; ragged shapes (K not a multiple of 8
        or of the block, rows not a multiple of the 2D tile); operands from the quantizer and
        random codes with random scale codes (every finite code). The padding columns K..Kp
        must be +0.

GEMM    ``fp4gen.gemm(backend="dequant")`` and ``auto`` for M > FUSED_MAX_M against
        ``gemm_reference``, with the tolerance derived in tests/test_gemm_kernels_gpu.py (the
        same contract as the fused kernels: exact products, here bf16 x bf16 in cuBLAS with
        fp32 accumulation in its own order, 2 u K S; alpha and the epilogue 4 u (|ref| + B);
        bias and C 2 u (|ref| + |bias| + |C| + B); a bf16 output 2^-7 (|ref| + B)); exact
        operands (dyadic scales) bit-identical to the reference in any summation order; B's
        decoded values remembered per tensor and refreshed when its codes change; fp4gen.nn.Linear
        routing its three GEMMs through the path and caching the weight's values; the cuBLASLt
        call (alpha from device memory, bias and C in its epilogue) serving the common shapes
        and equal to the torch GEMM + epilogue pass on exact operands, a declined shape falling
        back with its reason logged.
"""

from __future__ import annotations

import itertools
import logging
import sys
import zlib
from dataclasses import replace
from pathlib import Path

import pytest
import torch

import fp4gen
from fp4gen.codegen.dequant import UNIT
from fp4gen.codegen.gemm_configs import FUSED_MAX_M
from fp4gen.compiler.jit import detect_arch
from fp4gen.formats import (
    BUILTIN_FORMATS,
    E2M1,
    E3M2,
    E4M3,
    BlockFormat,
    ElementFormat,
    ScaleSpec,
)
from fp4gen.gemm_dispatch import auto_backend
from fp4gen.numerics import QuantizedTensor, gemm_reference, quantize
from fp4gen.numerics.minifloat import decode
from fp4gen.runtime import quantize_dispatch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from log_records import fresh_log_records  # noqa: E402  (the process-wide log-once records)

sys.path.remove(str(Path(__file__).resolve().parent))

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] not in (9, 10),
        reason="needs an sm_90 or sm_100 GPU",
    ),
]

DEV = "cuda"
U = 2.0**-24
NVFP4 = BUILTIN_FORMATS["nvfp4"]
MXFP4 = BUILTIN_FORMATS["mxfp4"]
UE5M0 = ElementFormat(5, 0, signed=False)
FORMATS: dict[str, BlockFormat] = {
    "nvfp4": NVFP4,
    "nvfp4_2d": NVFP4.with_block((16, 16)),
    "mxfp4": MXFP4,
    "mxfp6_e2m3": BUILTIN_FORMATS["mxfp6_e2m3"],
    "mxfp6_e3m2": BUILTIN_FORMATS["mxfp6_e3m2"],
    "mxfp8_e4m3": BUILTIN_FORMATS["mxfp8_e4m3"],
    "mxfp8_e5m2": BUILTIN_FORMATS["mxfp8_e5m2"],
    "e3m2_b8": BlockFormat("e3m2_b8", E3M2, (1, 8), ScaleSpec(E4M3, "nearest"), True),
    "e3m2_b24": BlockFormat("e3m2_b24", E3M2, (1, 24), ScaleSpec(E4M3, "nearest"), True),
    "e3m2_b12": BlockFormat("e3m2_b12", E3M2, (1, 12), ScaleSpec(E4M3, "nearest"), True),
    "e2m1_32x32_ue5m0": BlockFormat("e2m1_32", E2M1, (32, 32), ScaleSpec(UE5M0, "up")),
}
SHAPES = [(1, 16), (37, 40), (130, 304), (64, 1000), (300, 4096), (17, 8)]


def finite_codes(fmt: ElementFormat) -> torch.Tensor:
    codes = torch.arange(1 << fmt.bits)
    values = torch.tensor([fmt.value(int(c)) for c in codes])
    return codes[torch.isfinite(values)].to(torch.uint8)


def raw_operand(
    rows: int, k: int, fmt: BlockFormat, seed: int, scale_codes: list[int] | None = None
) -> QuantizedTensor:
    """Random finite element codes and random non-negative finite scale codes (or codes drawn
    from ``scale_codes``), S_dec = 1."""
    g = torch.Generator().manual_seed(seed)
    elems = finite_codes(fmt.element)
    scales = finite_codes(fmt.scale.element)
    if fmt.scale.element.signed:
        scales = scales[scales < (1 << (fmt.scale.element.bits - 1))]
    if scale_codes is not None:
        scales = torch.tensor(scale_codes, dtype=torch.uint8)
    codes = elems[torch.randint(0, len(elems), (rows, k), generator=g)]
    br, bc = fmt.block
    sc = scales[torch.randint(0, len(scales), (-(-rows // br), -(-k // bc)), generator=g)]
    return QuantizedTensor(
        codes=codes.to(DEV),
        scales=decode(sc, fmt.scale.element).to(DEV),
        scale_codes=sc.to(DEV),
        global_scale=torch.ones((), device=DEV),
        format=fmt,
        rounding="nearest",
        rht=None,
        seed=0,
        offset=0,
        shape=torch.Size((rows, k)),
        dtype=torch.float32,
    )


def quantized(rows: int, k: int, fmt: BlockFormat, seed: int, wide: bool = False):
    g = torch.Generator(device=DEV).manual_seed(seed)
    x = torch.randn(rows, k, generator=g, device=DEV)
    if wide:  # per-row magnitudes 2^-12 .. 2^12 and an outlier: zero and subnormal scales
        x = x * torch.exp2(torch.randint(-12, 13, (rows, 1), generator=g, device=DEV).float())
        x[0, 0] = 1e4
    return quantize(x, fmt)


def check_exact(q: QuantizedTensor, got: torch.Tensor) -> None:
    kp = -(-q.cols // UNIT) * UNIT
    assert got.dtype == torch.bfloat16 and tuple(got.shape) == (q.rows, kp)
    want = q.dequantize_blockwise().to(torch.bfloat16)
    same = got[:, : q.cols].view(torch.int16) == want.view(torch.int16)
    assert bool(same.all()), f"{int((~same).sum())} of {same.numel()} values differ"
    assert bool((got[:, q.cols :].view(torch.int16) == 0).all()), "padding is not +0"


@pytest.mark.parametrize(("rows", "k"), SHAPES, ids=str)
@pytest.mark.parametrize("name", sorted(FORMATS))
def test_dequantize_is_bit_exact(name: str, rows: int, k: int) -> None:
    from fp4gen.runtime.dequant import dequantize_bf16

    fmt = FORMATS[name]
    seed = zlib.crc32(f"{name} {rows} {k}".encode())
    raw = raw_operand(rows, k, fmt, seed)
    check_exact(raw, dequantize_bf16(raw))
    q = quantized(rows, k, fmt, seed + 1, wide=rows % 2 == 1)
    check_exact(q, dequantize_bf16(q))


@pytest.mark.parametrize(("rows", "k"), SHAPES, ids=str)
@pytest.mark.parametrize("name", ["nvfp4", "nvfp4_2d", "mxfp4"])
def test_dequantize_packed_codes_is_bit_exact(name: str, rows: int, k: int) -> None:
    from fp4gen.codegen.dequant import spec_for
    from fp4gen.runtime import kernels_for
    from fp4gen.runtime.cute_gemm import packed_codes

    fmt = FORMATS[name]
    spec = spec_for(fmt, "packed")
    assert not isinstance(spec, str)
    kernels = kernels_for(spec, detect_arch())  # type: ignore[arg-type]
    q = raw_operand(rows, k, fmt, zlib.crc32(f"packed {name} {rows} {k}".encode()))
    got = kernels.module.run(kernels.fns, packed_codes(q), q.scale_codes, cols=k)
    check_exact(q, got)


def test_dequantize_writes_into_a_given_output_and_checks_it() -> None:
    from fp4gen.errors import TensorError
    from fp4gen.runtime.dequant import kernels

    q = raw_operand(20, 48, NVFP4, 5)
    k = kernels(NVFP4, detect_arch())
    out = torch.full((20, 48), 7.0, dtype=torch.bfloat16, device=DEV)
    assert k.module.run(k.fns, q.codes, q.scale_codes, cols=48, out=out) is out
    check_exact(q, out)
    with pytest.raises(TensorError, match="out must be"):
        k.module.run(k.fns, q.codes, q.scale_codes, cols=48, out=out[:, :32])
    with pytest.raises(TensorError, match="scale_codes must be"):
        k.module.run(k.fns, q.codes, q.scale_codes[:, :1], cols=48)


# ----------------------------------------------------------------------------------------------
# The GEMM through dequantize + cuBLAS
# ----------------------------------------------------------------------------------------------
def magnitude(a: QuantizedTensor, b: QuantizedTensor) -> torch.Tensor:
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


GEMM_PAIRS = {
    "nvfp4_b2d": (NVFP4, FORMATS["nvfp4_2d"]),
    "nvfp4_b1d": (NVFP4, NVFP4),
    "mxfp4": (MXFP4, MXFP4),
    "mxfp8_e4m3": (FORMATS["mxfp8_e4m3"], FORMATS["mxfp8_e4m3"]),
    "e3m2_b8": (FORMATS["e3m2_b8"], FORMATS["e3m2_b8"]),
}
VARIANTS = [
    dict(out=torch.bfloat16, bias=False, acc=False),
    dict(out=torch.float32, bias=True, acc=False),
    dict(out=torch.float32, bias=False, acc=True),
    dict(out=torch.bfloat16, bias=True, acc=True),
    dict(out=torch.bfloat16, bias=True, acc=False),
    dict(out=torch.float32, bias=False, acc=False),
]
GEMM_SHAPES = list(itertools.product((65, 300, 1024), (64, 1000), (64, 304, 4096)))


@pytest.mark.parametrize(("m", "n", "k"), GEMM_SHAPES, ids=str)
@pytest.mark.parametrize("pair", sorted(GEMM_PAIRS))
def test_gemm_tolerance(pair: str, m: int, n: int, k: int) -> None:
    i = GEMM_SHAPES.index((m, n, k)) + sorted(GEMM_PAIRS).index(pair)
    v = VARIANTS[i % len(VARIANTS)]
    fa, fb = GEMM_PAIRS[pair]
    a = quantized(m, k, fa, 3 * i, wide=i % 3 == 2)
    b = quantized(n, k, fb, 3 * i + 1)
    g = torch.Generator(device=DEV).manual_seed(3 * i + 2)
    bias = torch.randn(n, generator=g, device=DEV) if v["bias"] else None
    acc = torch.randn(m, n, generator=g, device=DEV) if v["acc"] else None
    acc_copy = None if acc is None else acc.clone()
    got = fp4gen.gemm(a, b, out_dtype=v["out"], bias=bias, accumulate=acc, backend="dequant")
    assert got.dtype == v["out"] and got.shape == (m, n)
    assert acc is None or torch.equal(acc, acc_copy), "accumulate was modified"
    ref64 = gemm_reference(a, b).double()
    extra = None
    if bias is not None:
        ref64 = ref64 + bias.double()
        extra = bias.double().abs().expand(m, n)
    if acc is not None:
        ref64 = ref64 + acc.double()
        extra = (0 if extra is None else extra) + acc.double().abs()
    err = (got.double() - ref64).abs()
    ratio = float((err / bound(ref64, magnitude(a, b), k, v["out"], extra)).max())
    assert ratio <= 1.0, f"max err / bound = {ratio:.3g} ({pair}, {v})"
    # auto takes this path above FUSED_MAX_M, and for pairs without a fused kernel
    fused_pair = pair in ("nvfp4_b2d", "nvfp4_b1d", "mxfp4") and detect_arch() == "sm_90a"
    if m > FUSED_MAX_M or not fused_pair:
        assert auto_backend(a, b).backend == "dequant"
        auto = fp4gen.gemm(a, b, out_dtype=v["out"], bias=bias, accumulate=acc)
        assert torch.equal(auto, got)  # deterministic, and the same path


DYADIC = {"e4m3": [0x00, 0x30, 0x38, 0x40], "ue8m0": [126, 127, 128]}


@pytest.mark.parametrize(("m", "n", "k"), [(65, 64, 64), (300, 520, 256), (1024, 200, 4096)])
@pytest.mark.parametrize("pair", ["nvfp4_b2d", "mxfp4"])
def test_gemm_exact(pair: str, m: int, n: int, k: int) -> None:
    """Dyadic scales: every sum is exact in fp32, so the result equals the reference bit for
    bit in any summation order (fp32 out) or rounded once (bf16 out)."""
    fa, fb = GEMM_PAIRS[pair]
    # e2m1 x {1/2 .. 2}: products are multiples of 2^-4 and |sum| <= 4096 * 144 < 2^20
    a = raw_operand(m, k, fa, 1, DYADIC[fa.scale.element.name])
    b = raw_operand(n, k, fb, 2, DYADIC[fb.scale.element.name])
    ref = gemm_reference(a, b)
    got = fp4gen.gemm(a, b, backend="dequant")
    assert torch.equal(got.view(torch.int32), ref.view(torch.int32))
    got16 = fp4gen.gemm(a, b, out_dtype=torch.bfloat16, backend="dequant")
    assert torch.equal(got16.view(torch.int16), ref.to(torch.bfloat16).view(torch.int16))
    fused = fp4gen.gemm(a, b, backend="cute") if detect_arch() == "sm_90a" else ref
    assert torch.equal(fused, got)


def test_b_values_are_remembered_until_the_codes_change() -> None:
    from fp4gen.runtime import dequant

    a = quantized(128, 256, NVFP4, 1)
    b = quantized(64, 256, NVFP4, 2)
    first = fp4gen.gemm(a, b, backend="dequant")
    assert dequant.is_cached(b) and not dequant.is_cached(a)
    values = dequant.cached_bf16(b)
    assert dequant.cached_bf16(b) is values
    b.codes[0].zero_()  # in place: the version changes, the values are decoded again
    assert not dequant.is_cached(b)
    second = fp4gen.gemm(a, b, backend="dequant")
    assert not torch.equal(first[:, 0], second[:, 0]) and torch.equal(first[:, 1:], second[:, 1:])
    assert dequant.cached_bf16(b) is not values
    zero = replace(b, global_scale=torch.zeros((), device=DEV))  # alpha from the device tensor
    assert bool((fp4gen.gemm(a, zero, backend="dequant") == 0).all())


def test_linear_routes_its_gemms_through_the_path(monkeypatch) -> None:
    from fp4gen.runtime import cublaslt, dequant

    if not cublaslt.available():  # the path under test is the cuBLASLt call
        pytest.skip(f"cuBLASLt unavailable: {cublaslt.unavailable()}")

    calls: list[tuple[int, int, int]] = []
    real = dequant.dequant_product  # what fp4gen.gemm's dequant path calls on CUDA

    def spy(a, b, **kw):
        calls.append((a.rows, b.rows, a.cols))
        return real(a, b, **kw)

    monkeypatch.setattr(dequant, "dequant_product", spy)
    recipe = fp4gen.load_recipe("nvfp4.fp4r")
    layer = fp4gen.nn.Linear(256, 192, device=DEV, dtype=torch.bfloat16, recipe=recipe)
    x = torch.randn(512, 256, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    y = layer(x)
    y.float().pow(2).sum().backward()
    # fprop [512, 192, K=256], dgrad [512, 256, K=192], wgrad [192, 256, K=512]
    assert calls == [(512, 192, 256), (512, 256, 192), (192, 256, 512)]
    # the forward equals gemm on the same operands (bias in the epilogue)
    table = recipe.operands
    w = layer.weight.detach()
    w_row = layer.quantize(w, fp4gen.Operand.FPROP_WEIGHT, table.fprop_weight, 0)
    xq = quantize_dispatch.quantize(x.detach(), table.fprop_activation.format, backend="auto")
    want = fp4gen.gemm(xq, w_row, bias=layer.bias, out_dtype=torch.bfloat16, backend="dequant")
    assert torch.equal(y.detach(), want)


def test_cublaslt_serves_the_path(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The GEMM, alpha, bias and accumulation run as one cuBLASLt call (no fallback) for the
    layer shapes, and equal the torch path (fp32 product + epilogue pass) bit for bit on exact
    operands; a shape cuBLASLt does not take falls back with the reason logged (by this test's
    call: the declines are logged once per process, so the records start empty here; under
    pytest-xdist another test in the worker may have logged the same reason before)."""
    from fp4gen.runtime import cublaslt, dequant

    if not cublaslt.available():
        pytest.skip(f"cuBLASLt unavailable: {cublaslt.unavailable()}")
    fresh_log_records(monkeypatch)
    caplog.set_level(logging.INFO, logger="fp4gen.runtime.cublaslt")

    def declined() -> list[str]:
        lines = [r.getMessage() for r in caplog.records]
        return [line for line in lines if "cuBLASLt GEMM not used" in line]

    a = raw_operand(256, 512, NVFP4, 1, DYADIC["e4m3"])
    b = raw_operand(128, 512, NVFP4, 2, DYADIC["e4m3"])
    va, vb = dequant.dequantize_bf16(a), dequant.dequantize_bf16(b)
    alpha = torch.tensor([0.75], device=DEV)
    bias16 = torch.arange(128, device=DEV, dtype=torch.bfloat16) / 8
    acc16 = ((torch.arange(256 * 128, device=DEV) % 64 - 32) / 4).reshape(256, 128)
    acc16 = acc16.to(torch.bfloat16)  # multiples of 1/4: every sum below stays exact in fp32
    cases = [
        dict(out_dtype=torch.bfloat16),
        dict(out_dtype=torch.float32),
        dict(out_dtype=torch.bfloat16, bias=bias16),
        dict(out_dtype=torch.float32, bias=bias16.float()),
        dict(out_dtype=torch.bfloat16, accumulate=acc16),
        dict(out_dtype=torch.bfloat16, bias=bias16, accumulate=acc16),
    ]
    for kw in cases:
        got = cublaslt.matmul(va, vb, alpha, **kw)
        assert got is not None, (cublaslt.unavailable(), kw)
        # every product, sum and the epilogue are exact here: any order gives these bits
        want = dequant.epilogue(
            dequant._mm_fp32(va, vb), alpha, kw.get("bias"), kw.get("accumulate"), kw["out_dtype"]
        )
        assert got.dtype == kw["out_dtype"] and torch.equal(got, want), kw
    # an fp32 bias with a bf16 output: served where cuBLASLt has an algorithm (the H100's
    # cuBLAS 13 has none), else declined with the reason logged; the path's result is the same
    kw = dict(out_dtype=torch.bfloat16, bias=bias16.float())
    got = cublaslt.matmul(va, vb, alpha, **kw)
    assert got is not None or any("no cuBLASLt algorithm" in m for m in declined())
    want = dequant.epilogue(dequant._mm_fp32(va, vb), alpha, kw["bias"], None, torch.bfloat16)
    assert got is None or torch.equal(got, want)
    # N = 100 bf16 outputs: rows of 200 bytes, not a multiple of 16: declined, logged
    caplog.clear()
    assert cublaslt.matmul(va, vb[:100].contiguous(), alpha, out_dtype=torch.bfloat16) is None
    assert len([m for m in declined() if "N = 100" in m]) == 1, declined()
    b100 = raw_operand(100, 512, NVFP4, 2, DYADIC["e4m3"])
    got = fp4gen.gemm(a, b100, out_dtype=torch.bfloat16, backend="dequant")
    assert torch.equal(got, gemm_reference(a, b100).to(torch.bfloat16))


def test_kernel_output_is_multiplied_without_unpacking() -> None:
    """A quantize kernel's QuantizedTensor keeps its packed codes: the dequantize kernel reads
    them as they are (no unpacking pass) and gives the same values as from the unpacked codes."""
    from fp4gen.runtime import dequant

    g = torch.Generator(device=DEV).manual_seed(5)
    x = torch.randn(300, 512, device=DEV, generator=g, dtype=torch.bfloat16)
    w = torch.randn(128, 512, device=DEV, generator=g, dtype=torch.bfloat16)
    a = quantize_dispatch.quantize(x, NVFP4, backend="cute")
    b = quantize_dispatch.quantize(w, NVFP4, backend="cute")
    assert a.packed_codes() is not None and b.packed_codes() is not None
    got = fp4gen.gemm(a, b, out_dtype=torch.bfloat16, backend="dequant")
    assert a.packed_codes() is not None and b.packed_codes() is not None  # still not unpacked
    va = dequant.dequantize_bf16(a)
    assert torch.equal(va, a.dequantize_blockwise().to(torch.bfloat16))  # unpacks a's codes
    assert a.packed_codes() is None and torch.equal(dequant.dequantize_bf16(a), va)
    again = fp4gen.gemm(a, b, out_dtype=torch.bfloat16, backend="dequant")
    assert torch.equal(got, again)
