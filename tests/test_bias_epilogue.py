"""The GEMM epilogue every backend shares (``fp4gen.runtime.epilogue``), and ``fp4gen.gemm``'s
argument checks.

CPU: stand-in backends that ignore the bias and accumulate still give the reference's bits (the
dispatcher applies what a product does not claim); the block_scaled backend's own code, with
``scaled_mm`` stood in for on the CPU, keeps the bias with an fp32 output (it was dropped); a
product that breaks the contract is an error; bad arguments are one-line ArgumentErrors.

GPU (marker ``gpu``): ``fp4gen.nn.Linear`` with a bias for every shipped recipe and every
backend that serves its fprop pair, fp32 / bf16 / fp16 outputs and bf16 autocast, against the
reference GEMM of the same operands (within the fp32 summation-order bound of numerics.md 6, or
6.1's for block-scaled accumulation) and against x @ W^T + b in fp32 (a dropped bias fails by
far); ``fp4gen.gemm`` with bias and accumulate on every such pair and backend.
"""

from __future__ import annotations

import hashlib
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import fp4gen
import fp4gen.gemm_dispatch as gd
from fp4gen.compiler.plan import ROW_SCALED_REASON
from fp4gen.errors import ArgumentError, FP4GenError
from fp4gen.formats import BUILTIN_FORMATS, BlockFormat, ScaleSpec
from fp4gen.numerics import (
    QuantizedTensor,
    block_scaled_error_bound,
    gemm_block_scaled_reference,
    gemm_reference,
    quantize,
)
from fp4gen.runtime import epilogue, fp8_gemm
from fp4gen.runtime.epilogue import GemmProduct

OUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
E4M3 = BUILTIN_FORMATS["mxfp8_e4m3"].element
FP8_ROW = BlockFormat("fp8_block", E4M3, (1, 128), ScaleSpec(None))
FP8_TILE = FP8_ROW.with_block((128, 128))
KERNEL_BACKENDS = ("cute", "blackwell", "block_scaled")
# the unit roundoff of each output dtype: a result rounded to it is within u |x| of x
UNIT = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}


def operands(fmt: str, m: int, n: int, k: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return quantize(torch.randn(m, k, generator=g), fmt), quantize(
        torch.randn(n, k, generator=g), fmt
    )


def extras(m: int, n: int, with_accumulate: bool, seed: int = 1):
    """A bias and (optionally) an accumulator about as large as the product."""
    g = torch.Generator().manual_seed(seed)
    bias = torch.randn(n, generator=g) * 4
    acc = torch.randn(m, n, generator=g) * 4 if with_accumulate else None
    return bias, acc


# ----------------------------------------------------------------------------------------------
# A backend that ignores the bias and accumulate: the dispatcher applies them
# ----------------------------------------------------------------------------------------------
def ignoring_backend(seen: list[str]):
    """A kernel backend's stand-in that computes S_a S_b (A @ B^T) and nothing else (no bias,
    no accumulate, fp32 whatever the output dtype), and says so."""

    def product(call) -> GemmProduct:
        seen.append("ran")
        return GemmProduct(gemm_reference(call.a, call.b), scaled=True)

    return product


# backend="block_scaled" on CPU tensors is the float64 oracle: its kernel path only via auto
@pytest.mark.parametrize(
    ("backend", "chosen_by_auto"),
    [("cute", False), ("cute", True), ("blackwell", False), ("blackwell", True),
     ("block_scaled", True)],
)  # fmt: skip
@pytest.mark.parametrize("out_dtype", OUT_DTYPES)
@pytest.mark.parametrize("with_accumulate", [False, True])
def test_a_backend_that_ignores_the_bias_still_gets_it_applied(
    monkeypatch, backend, out_dtype, with_accumulate, chosen_by_auto
) -> None:
    """Every kernel backend's product goes through the shared epilogue: one that ignores the
    bias and accumulate gives the reference path's bits, asked for by name or chosen by auto,
    with and without ``out``."""
    a, b = operands("nvfp4", 24, 40, 128)
    bias, acc = extras(24, 40, with_accumulate)
    seen: list[str] = []
    name = {"cute": "_fused", "blackwell": "_native", "block_scaled": "_block_scaled"}[backend]
    monkeypatch.setattr(gd, name, ignoring_backend(seen))
    if chosen_by_auto:
        monkeypatch.setattr(gd, "auto_backend", lambda a, b: gd.GemmChoice(backend, "stand-in"))
    asked = "auto" if chosen_by_auto else backend
    kw = dict(bias=bias, accumulate=acc, out_dtype=out_dtype)
    want = fp4gen.gemm(a, b, backend="reference", **kw)
    got = fp4gen.gemm(a, b, backend=asked, **kw)
    out = torch.full((24, 40), float("nan"), dtype=out_dtype)
    into = fp4gen.gemm(a, b, backend=asked, out=out, **kw)
    assert seen == ["ran", "ran"]
    assert got.dtype == out_dtype and got.is_contiguous()
    assert torch.equal(got, want) and into is out and torch.equal(out, want)
    # the bias is large: the product without it is far off
    without = fp4gen.gemm(a, b, backend="reference", accumulate=acc, out_dtype=out_dtype)
    assert float((got.float() - without.float()).abs().max()) > 1.0


def test_a_product_that_claims_the_bias_is_taken_as_it_is(monkeypatch) -> None:
    """A backend that fused the bias (cuBLASLt's epilogue, the fused kernel's) says so: the
    dispatcher adds nothing more."""
    a, b = operands("nvfp4", 8, 16, 64)
    bias, acc = extras(8, 16, True)
    done = gemm_reference(a, b, bias=bias) + acc
    claimed = GemmProduct(done.clone(), scaled=True, bias=True, accumulated=True)
    monkeypatch.setattr(gd, "_fused", lambda call: claimed)
    got = fp4gen.gemm(a, b, bias=bias, accumulate=acc, backend="cute")
    assert torch.equal(got, done)


def test_unscaled_products_get_the_global_scales(monkeypatch) -> None:
    """A product that does not claim the global scales is multiplied by S_a S_b (NVFP4: not 1),
    once, before the bias."""
    a, b = operands("nvfp4", 8, 16, 64)
    assert float(a.global_scale * b.global_scale) != 1.0
    bias, _ = extras(8, 16, False)
    raw = gemm_reference(a, b) / (a.global_scale * b.global_scale)  # exact: a power of two?
    monkeypatch.setattr(gd, "_native", lambda call: GemmProduct(raw.clone(), scaled=False))
    got = fp4gen.gemm(a, b, bias=bias, backend="blackwell")
    want = torch.addcmul(bias, raw, a.global_scale * b.global_scale)
    assert torch.equal(got, want)
    ref = gemm_reference(a, b, bias=bias)
    assert float((got - ref).abs().max()) <= 1e-5 * float(ref.abs().max())


@pytest.mark.parametrize(
    ("product", "rule"),
    [
        (lambda c: c, "must return a GemmProduct, got a torch.float32 tensor"),
        (lambda c: GemmProduct(c.bfloat16(), scaled=True), r"fp32 product \(bias still to"),
        (lambda c: GemmProduct(c[:, :3], scaled=True), r"an \[8, 16\] product"),
        (lambda c: GemmProduct(c.to(torch.int32), scaled=True, bias=True), "fp32 or"),
    ],
)
def test_a_product_that_breaks_the_contract_is_an_error(monkeypatch, product, rule) -> None:
    """A bare tensor (no word on the bias), a 16-bit product with the bias still to add (a
    second rounding), a wrong shape or dtype: an internal error naming the backend, raised by
    auto too (not taken for a kernel that cannot be loaded)."""
    a, b = operands("nvfp4", 8, 16, 64)
    bias, _ = extras(8, 16, False)
    c = gemm_reference(a, b)
    monkeypatch.setattr(gd, "_fused", lambda call: product(c.clone()))
    monkeypatch.setattr(gd, "auto_backend", lambda a, b: gd.GemmChoice("cute", "x"))
    for backend in ("cute", "auto"):
        with pytest.raises(FP4GenError, match=rule) as err:
            fp4gen.gemm(a, b, bias=bias, backend=backend, out_dtype=torch.bfloat16)
        assert str(err.value).startswith("internal error: the cute GEMM backend")


# ----------------------------------------------------------------------------------------------
# The dequant backend: cuBLASLt's epilogue, or the torch product finished by the shared one
# ----------------------------------------------------------------------------------------------
def _dequant_on_cpu(monkeypatch, matmul) -> None:
    """CUDA stood in for under dequant_product: the operands' "dequantized values" are their
    blockwise values in bf16; cuBLASLt is ``matmul``."""
    from fp4gen.runtime import cublaslt, dequant

    monkeypatch.setattr(
        dequant, "dequantize_bf16", lambda q, *, arch=None: q.dequantize_blockwise().bfloat16()
    )
    monkeypatch.setattr(dequant, "one_cuda_device", lambda a, b, what: torch.device("cpu"))
    monkeypatch.setattr(dequant, "_MM_DTYPE", [False])  # the CPU has no mm(out_dtype=)
    monkeypatch.setattr(cublaslt, "matmul", matmul)


@pytest.mark.parametrize("out_dtype", OUT_DTYPES)
@pytest.mark.parametrize("with_accumulate", [False, True])
def test_dequant_without_cublaslt_applies_scales_bias_and_accumulate(
    monkeypatch, out_dtype, with_accumulate
) -> None:
    """cuBLASLt declines (None): the fp32 product comes back with nothing applied, and the
    shared epilogue applies S_a S_b, the bias and accumulate, as the reference does (the
    products of bf16 values are exact; only the fp32 summation order differs)."""
    from fp4gen.runtime import dequant

    _dequant_on_cpu(monkeypatch, lambda *args, **kw: None)
    a, b = operands("nvfp4", 16, 24, 256)
    bias, acc = extras(16, 24, with_accumulate)
    kw = dict(out_dtype=out_dtype, bias=bias, accumulate=acc, arch="sm_90a")
    product = dequant.dequant_product(a, b, **kw)
    assert (product.scaled, product.bias, product.accumulated) == (False, False, False)
    got = dequant.dequant_gemm(a, b, **kw)
    ref = fp4gen.gemm(a, b, bias=bias, accumulate=acc, backend="reference")  # fp32
    va, vb = a.dequantize_blockwise().double(), b.dequantize_blockwise().double()
    mag = (va.abs() @ vb.abs().t()) * decode_scales(a, b).abs()
    delta = 260 * 2.0**-24 * mag + 4 * 2.0**-24 * ref.double().abs()
    limit = delta + UNIT[out_dtype] * (ref.double().abs() + delta)
    assert got.dtype == out_dtype
    assert ((got.double() - ref.double()).abs() <= limit).all()


def test_dequant_with_cublaslt_claims_every_step(monkeypatch) -> None:
    """cuBLASLt's epilogue applies alpha, the bias and accumulate: the product claims them and
    the shared epilogue returns cuBLASLt's tensor as it is."""
    from fp4gen.runtime import dequant

    marker = torch.full((16, 24), 3.0, dtype=torch.bfloat16)
    _dequant_on_cpu(monkeypatch, lambda *args, **kw: marker)
    a, b = operands("nvfp4", 16, 24, 256)
    bias, acc = extras(16, 24, True)
    kw = dict(out_dtype=torch.bfloat16, bias=bias, accumulate=acc, arch="sm_90a")
    assert dequant.dequant_product(a, b, **kw) == GemmProduct(marker, True, True, True)
    assert dequant.dequant_gemm(a, b, **kw) is marker


# ----------------------------------------------------------------------------------------------
# The block_scaled backend's own code on the CPU, scaled_mm stood in for
# ----------------------------------------------------------------------------------------------
def integer_operand(rows: int, k: int, fmt: BlockFormat, g: torch.Generator) -> QuantizedTensor:
    """Codes of the integers -4 .. 4, block scales 2^0 .. 2^2 (every sum exact): CPU."""
    values = torch.randint(-4, 5, (rows, k), generator=g).to(torch.float32)
    br, bc = fmt.block
    shape = (math.ceil(rows / min(br, rows)), math.ceil(k / min(bc, k)))
    return QuantizedTensor(
        codes=values.to(torch.float8_e4m3fn).view(torch.uint8),
        scales=torch.exp2(torch.randint(0, 3, shape, generator=g).to(torch.float32)),
        scale_codes=None,
        global_scale=torch.ones(()),
        format=fmt,
        rounding="nearest",
        rht=None,
        seed=0,
        offset=0,
        shape=torch.Size((rows, k)),
        dtype=torch.float32,
    )


def fake_scaled_mm(calls: list[dict]):
    """torch's block-wise scaled_mm on the CPU, with its contract: mat_a [M, K] row-major,
    mat_b [K, N], 1x128 scales [M, K/128] (and [N, K/128] for B) or 128x128 scales [L4, N/128];
    no bias with an fp32 output; the fp32 sum (+ bias) rounded once to output_dtype."""

    def scaled_mm(mat_a, mat_b, scale_a, recipe_a, scale_b, recipe_b, *, bias, output_dtype,
                  use_fast_accum):  # fmt: skip
        calls.append({"bias": bias, "output_dtype": output_dtype})
        assert not use_fast_accum
        if bias is not None and output_dtype == torch.float32:
            raise RuntimeError("Bias is not supported when out_dtype is set to Float32")
        k, n = mat_b.shape
        va = mat_a.double() * scale_a.double().repeat_interleave(128, dim=1)[:, :k]
        if recipe_b == F.ScalingType.BlockWise128x128:
            sb = scale_b.double().repeat_interleave(128, 0)[:k].repeat_interleave(128, 1)[:, :n]
        else:
            sb = scale_b.double().repeat_interleave(128, dim=1)[:, :k].t()
        c = (va @ (mat_b.double() * sb)).to(torch.float32)
        return (c if bias is None else c + bias.float()).to(output_dtype)

    return scaled_mm


def _block_scaled_on_cpu(monkeypatch) -> list[dict]:
    from fp4gen.compiler import jit

    calls: list[dict] = []
    monkeypatch.setattr(F, "scaled_mm", fake_scaled_mm(calls))
    monkeypatch.setattr(fp8_gemm, "one_cuda_device", lambda a, b, what: a.device)
    monkeypatch.setattr(fp8_gemm, "torch_reason", lambda: None)
    monkeypatch.setattr(jit, "detect_arch", lambda device=None: "sm_90a")
    return calls


@pytest.mark.parametrize("out_dtype", OUT_DTYPES)
@pytest.mark.parametrize("bias_dtype", ["fp32", "out"])
@pytest.mark.parametrize("with_accumulate", [False, True])
@pytest.mark.parametrize(("n", "b_fmt"), [(96, FP8_TILE), (88, FP8_TILE), (96, FP8_ROW)])
def test_block_scaled_keeps_the_bias_and_accumulate(
    monkeypatch, out_dtype, bias_dtype, with_accumulate, n, b_fmt
) -> None:
    """fp8_blockwise's GEMM with a bias: fp32, bf16 and fp16 outputs, a bias of fp32 or of the
    output's dtype, with and without accumulate, through ``fp4gen.gemm`` (auto on sm_90a) and
    ``block_scaled_gemm``: the exact product plus the bias (and accumulate), the reference's
    bits. The fp32 output used to drop the bias and accumulate."""
    calls = _block_scaled_on_cpu(monkeypatch)
    g = torch.Generator().manual_seed(n + int(with_accumulate))
    a = integer_operand(100, 256, FP8_ROW, g)
    b = integer_operand(n, 256, b_fmt, g)
    bias, acc = extras(100, n, with_accumulate)
    if bias_dtype == "out":
        bias = bias.to(out_dtype)
    kw = dict(bias=bias, accumulate=acc, out_dtype=out_dtype)
    want = fp4gen.gemm(a, b, backend="reference", **kw)
    # the exact product is integer-valued: the oracles agree bit for bit
    assert torch.equal(gemm_block_scaled_reference(a, b), gemm_reference(a, b))
    monkeypatch.setattr(gd, "auto_backend", lambda a, b: gd.GemmChoice("block_scaled", "x"))
    got = fp4gen.gemm(a, b, **kw)
    direct = fp8_gemm.block_scaled_gemm(a, b, **kw)
    assert len(calls) == 2 and got.dtype == out_dtype and got.shape == (100, n)
    assert torch.equal(got, want) and torch.equal(direct, want)
    # cuBLASLt's epilogue takes a bias of the 16-bit output dtype (no accumulate)
    fused = bias_dtype == "out" and out_dtype != torch.float32 and acc is None
    assert (calls[0]["bias"] is not None) == fused


# ----------------------------------------------------------------------------------------------
# fp4gen.nn.Linear on the CPU with a backend that ignores the bias
# ----------------------------------------------------------------------------------------------
def relative_errors(layer, x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
    """(|y - (x W^T + b)| / |x W^T + b|, the same for y without b) in fp32 (Frobenius)."""
    bias = layer.bias.detach().float()
    exact = x.float() @ layer.weight.detach().float().t() + bias
    y = y.detach().float()
    norm = float(exact.norm())
    return float((y - exact).norm()) / norm, float((y - bias - exact).norm()) / norm


@pytest.mark.parametrize("recipe", ["fp8_blockwise", "nvfp4"])
def test_linear_with_a_bias_on_a_backend_that_ignores_it(monkeypatch, recipe) -> None:
    """The reported case on the CPU: Linear(896, 128, bias=True) whose GEMM runs on a backend
    that does not add the bias (fp8_blockwise: the block_scaled backend's own code with
    scaled_mm stood in for; nvfp4: a fused-kernel stand-in). y is x W^T + b up to the
    quantization error; without the bias it would be about 0.7 away."""
    if recipe == "fp8_blockwise":
        _block_scaled_on_cpu(monkeypatch)
        backend = "block_scaled"
    else:
        monkeypatch.setattr(gd, "_fused", ignoring_backend([]))
        backend = "cute"
    monkeypatch.setattr(gd, "auto_backend", lambda a, b: gd.GemmChoice(backend, "x"))
    torch.manual_seed(0)
    layer = fp4gen.nn.Linear(896, 128, bias=True, recipe=recipe, seed=1)
    with torch.no_grad():
        layer.bias.copy_(torch.randn(128) * 0.5)  # about as large as x W^T
    x = torch.randn(256, 896)
    err, dropped = relative_errors(layer, x, layer(x))
    assert dropped > 0.5  # what a dropped bias would give: the bound below fails it by far
    assert err < (0.05 if recipe == "fp8_blockwise" else 0.2), err


# ----------------------------------------------------------------------------------------------
# fp4gen.gemm's arguments
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", gd.BACKENDS)
@pytest.mark.parametrize(
    ("kw", "rule"),
    [
        ({"out_dtype": torch.int32}, "out_dtype must be torch.float32, torch.bfloat16 or"),
        ({"out_dtype": torch.bool}, r"out_dtype .* got torch.bool"),
        ({"out_dtype": torch.float64}, r"out_dtype .* got torch.float64"),
        (
            {"accumulate": True},
            r"accumulate must be None or a floating-point tensor of shape "
            r"\[8, 12\], got bool True",
        ),  # fmt: skip
        ({"accumulate": torch.zeros(8, 12, dtype=torch.int32)}, "got a torch.int32 tensor"),
        ({"bias": True}, r"bias must be None or a floating-point tensor of shape \[12\]"),
        ({"out": True}, "out must be None or a tensor, got bool True"),
    ],
)
def test_bad_arguments_are_one_line_errors(backend, kw, rule) -> None:
    """An output dtype other than fp32 / bf16 / fp16 (an integer one truncated the result), a
    bool for accumulate or bias: an ArgumentError naming the argument and the rule, before any
    work, whatever the backend."""
    a, b = operands("nvfp4", 8, 12, 64)
    with pytest.raises(ArgumentError, match=rule) as err:
        fp4gen.gemm(a, b, backend=backend, **kw)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("backend", gd.BACKENDS)
def test_plain_tensors_are_refused(backend) -> None:
    """Plain torch tensors instead of QuantizedTensors: an ArgumentError saying to quantize
    them first (it was an AttributeError)."""
    a, b = operands("nvfp4", 8, 12, 64)
    for x, y, which in (
        (torch.randn(8, 64), torch.randn(12, 64), "a"),
        (a, torch.randn(12, 64), "b"),
    ):
        with pytest.raises(ArgumentError, match=rf"gemm: {which} must be a QuantizedTensor") as e:
            fp4gen.gemm(x, y, backend=backend)
        assert "torch.float32 tensor of shape" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(ArgumentError, match="got NoneType"):
        fp4gen.gemm(None, b, backend=backend)  # type: ignore[arg-type]


def test_a_prepared_call_does_not_let_a_bad_out_dtype_through(monkeypatch) -> None:
    """The per-call path of backend="auto" (a prepared call for B) steps aside for another
    output dtype, and the full path refuses it."""
    from fp4gen.runtime.checks import PreparedA

    a, b = operands("nvfp4", 8, 12, 64)
    prepared = PreparedA(a, torch.bfloat16)
    monkeypatch.setattr(
        gd,
        "_prepared",
        {b: lambda a_, b_, dt: torch.zeros(8, 12) if prepared.matches(a_, dt) else None},
    )
    with pytest.raises(ArgumentError, match="out_dtype"):
        fp4gen.gemm(a, b, out_dtype=torch.int32)


def test_epilogue_steps_in_the_contracts_order() -> None:
    """apply_steps: fp32(c * alpha) + bias + accumulate, rounded once (the reference's order)."""
    g = torch.Generator().manual_seed(3)
    c, bias, acc = (
        torch.randn(5, 7, generator=g),
        torch.randn(7, generator=g),
        torch.randn(5, 7, generator=g),
    )
    alpha = torch.tensor(0.3)
    for out_dtype in OUT_DTYPES:
        want = ((c * alpha + bias) + acc).to(out_dtype)
        assert torch.equal(epilogue.apply_steps(c.clone(), alpha, bias, acc, out_dtype), want)
        assert torch.equal(
            epilogue.apply_steps(c.clone(), None, bias, None, out_dtype), (c + bias).to(out_dtype)
        )


# ----------------------------------------------------------------------------------------------
# GPU: fp4gen.nn.Linear with a bias, every shipped recipe and every backend that serves it
# ----------------------------------------------------------------------------------------------
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
ROOT = Path(__file__).resolve().parent.parent
BACKENDS = ("auto", "reference", "dequant", "cute", "block_scaled", "blackwell")
MODES = ("fp32", "bf16", "fp16", "autocast_bf16")
TC_REL = 4 * 33 * 2.0**-13  # Hopper's FP8 adder per K-block (numerics.md 6.1, "Hopper")


def shipped_recipes() -> list[Path]:
    """recipes/*.fp4r and fp4gen/recipes/*.fp4r, a file whose bytes another already has once."""
    unique: dict[str, Path] = {}
    for path in sorted((ROOT / "recipes").glob("*.fp4r")) + sorted(
        (ROOT / "fp4gen" / "recipes").glob("*.fp4r")
    ):
        unique.setdefault(hashlib.sha256(path.read_bytes()).hexdigest(), path)
    return list(unique.values())


# the GPU tests' parameters, made only where they run (a CPU run skips one test each)
ON_GPU = torch.cuda.is_available()
RECIPES = shipped_recipes() if ON_GPU else []


def not_served(backend: str, fa: object, fb: object, arch: str) -> str | None:
    """Why ``backend`` cannot run the pair (fa, fb) on ``arch``, or None."""
    from fp4gen.codegen.gemm_configs import FUSED_ARCHS, NATIVE_ARCHS, mma_plan

    if backend == "auto":
        return None
    if not (isinstance(fa, BlockFormat) and isinstance(fb, BlockFormat)):
        return "not block formats (MoR or high precision: the layer multiplies them itself)"
    if backend in ("reference", "dequant"):
        return None
    if backend == "cute":
        if fa.global_rows or fb.global_rows:  # gemm(backend="cute") refuses them (numerics.md 11.4)
            return ROW_SCALED_REASON
        return gd.fused_support(fa, fb) or (None if arch in FUSED_ARCHS else f"not {FUSED_ARCHS}")
    if backend == "block_scaled":
        return fp8_gemm.support(fa, fb) or fp8_gemm.torch_reason() or fp8_gemm.arch_reason(arch)
    plan = mma_plan(fa, fb)
    return plan if isinstance(plan, str) else (None if arch in NATIVE_ARCHS else "not sm_100a")


def decode_scales(a, b) -> torch.Tensor:
    """S_dec of A times S_dec of B, float64, broadcast over [M, N]: a scalar, or with per-row
    global scales (numerics.md 11.4) A's per row times B's per column."""
    sa = a.global_scale.double().reshape(-1, 1)
    sb = b.global_scale.double().reshape(1, -1).to(sa.device)
    return sa * sb


def within_reference(got: torch.Tensor, a, b, bias, acc, out_dtype, ran: str) -> None:
    """``got`` against the float64 reference of the same operands (fp32, + bias, + acc): within
    the fp32 summation-order bound of numerics.md 6 (K + 4 roundings of each product's path),
    or 6.1's block-scaled bound plus the Hopper adder term, plus the output's rounding."""
    ref = gd.gemm(a, b, bias=bias, accumulate=acc, backend="reference").double()
    va, vb = a.dequantize_blockwise().double().abs(), b.dequantize_blockwise().double().abs()
    mag = (va @ vb.t()) * decode_scales(a, b).abs()
    if ran == "block_scaled":
        delta = block_scaled_error_bound(a, b) + TC_REL * mag * (1 + 2 * 2.0**-24) ** 2
    else:
        delta = (a.cols + 4) * 2.0**-24 * mag
    delta = delta.to(ref.device) + 4 * 2.0**-24 * ref.abs()
    limit = delta + UNIT[out_dtype] * (ref.abs() + delta)
    err = (got.double() - ref).abs()
    worst = float((err / limit.clamp_min(1e-300)).max())
    assert got.dtype == out_dtype and got.shape == ref.shape
    assert (err <= limit).all(), f"{ran}: error up to x{worst:.3g} the bound"
    if bias is not None:  # the same result without the bias would be far out of bounds
        dropped = (got.double() - bias.double() - ref).abs() > limit
        assert float(dropped.double().mean()) > 0.5


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("tokens", [48, 1024])
@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_linear_bias_on_every_backend(monkeypatch, recipe, tokens, backend, mode) -> None:
    """Linear(896, 128, bias=True): the forward GEMM on ``backend`` (the layer's call to
    fp4gen.gemm redirected to it) within the bound of the reference GEMM of the same operands,
    and y within the quantization error of x W^T + b in fp32, where a dropped bias is 0.9 off."""
    from fp4gen.compiler.jit import detect_arch
    from fp4gen.runtime import linear

    arch = detect_arch()
    table = fp4gen.load_recipe(recipe).operands
    fa = table[fp4gen.Operand.FPROP_ACTIVATION].format
    fb = table[fp4gen.Operand.FPROP_WEIGHT].format
    reason = not_served(backend, fa, fb, arch)
    if reason is not None:
        pytest.skip(f"{backend}: {reason}")
    torch.manual_seed(tokens)
    layer = fp4gen.nn.Linear(896, 128, bias=True, recipe=recipe, seed=1, device="cuda")
    fp4gen.set_step(layer, 0, total_steps=100)  # a schedule switching late: its first step
    x = torch.randn(tokens, 896, device="cuda")
    with torch.no_grad():
        rms = float((x @ layer.weight.t()).pow(2).mean().sqrt())
        layer.bias.copy_(torch.randn(128, device="cuda") * 2 * rms)
    calls: list[tuple] = []
    real = gd.gemm

    def on_backend(a, b, **kw):
        y = real(a, b, **kw) if backend == "auto" else real(a, b, backend=backend, **kw)
        calls.append((a, b, kw, y))
        return y

    monkeypatch.setattr(linear, "gemm", on_backend)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}.get(mode)
    if dtype is None:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = layer(x)
        out_dtype = torch.bfloat16
    else:
        y = layer(x.to(dtype))
        out_dtype = dtype
    assert y.dtype == out_dtype and y.shape == (tokens, 128)
    if isinstance(fa, BlockFormat) and isinstance(fb, BlockFormat):
        (a, b, kw, got), *_ = calls
        ran = gd.auto_backend(a, b).backend if backend == "auto" else backend
        assert kw["bias"] is not None and kw.get("accumulate") is None
        within_reference(got, a, b, kw["bias"], None, out_dtype, ran)
    err, dropped = relative_errors(layer, x.to(dtype or torch.float32), y)
    assert dropped > 0.8 and err < 0.3, (err, dropped)


def recipe_pairs() -> list[tuple[str, BlockFormat, BlockFormat]]:
    """The distinct (A, B) block-format pairs of the shipped recipes' fprop and wgrad GEMMs."""
    Op = fp4gen.Operand
    pairs: dict[tuple, tuple[str, BlockFormat, BlockFormat]] = {}
    for path in RECIPES:
        table = fp4gen.load_recipe(path).operands
        for gemm, a, b in (
            ("fprop", Op.FPROP_ACTIVATION, Op.FPROP_WEIGHT),
            ("wgrad", Op.WGRAD_GRADIENT, Op.WGRAD_ACTIVATION),
        ):
            fa, fb = table[a].format, table[b].format
            if isinstance(fa, BlockFormat) and isinstance(fb, BlockFormat):
                pairs.setdefault((fa, fb), (f"{path.stem}.{gemm}", fa, fb))
    return list(pairs.values())


PAIRS = recipe_pairs() if ON_GPU else []


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("autocast", [False, True])
@pytest.mark.parametrize("with_accumulate", [False, True])
@pytest.mark.parametrize("out_dtype", OUT_DTYPES)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("pair", PAIRS, ids=lambda p: p[0])
def test_gemm_bias_and_accumulate_on_every_backend(
    pair, backend, out_dtype, with_accumulate, autocast
) -> None:
    """fp4gen.gemm with a bias (and an fp32 accumulator) on every backend that serves the
    pair, fp32 / bf16 / fp16 out, with and without bf16 autocast: within the bound of the
    reference GEMM of the same operands."""
    from fp4gen.compiler.jit import detect_arch

    name, fa, fb = pair
    reason = not_served(backend, fa, fb, detect_arch())
    if reason is not None:
        pytest.skip(f"{backend}: {reason}")
    g = torch.Generator().manual_seed(len(name))
    m, n, k = 256, 384, 1024
    a = fp4gen.quantize(torch.randn(m, k, generator=g).cuda(), fa)
    b = fp4gen.quantize((torch.randn(n, k, generator=g) * 0.05).cuda(), fb)
    bias, acc = extras(m, n, with_accumulate)
    bias, acc = bias.cuda(), None if acc is None else acc.cuda()
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
        got = fp4gen.gemm(a, b, bias=bias, accumulate=acc, out_dtype=out_dtype, backend=backend)
    ran = gd.auto_backend(a, b).backend if backend == "auto" else backend
    within_reference(got, a, b, bias, acc, out_dtype, ran)
