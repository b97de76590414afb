"""Signed zero (docs/numerics.md 1): a strictly negative value that rounds to zero encodes as
negative zero (sign bit set, magnitude 0: e2m1 -0.1 -> 0x8, decoding to -0.0), as Transformer
Engine's NVFP4 reference quantizer, torchao and torch's float8 casts do; -0.0 encodes as code 0
(as Transformer Engine's reference does), for every element format and rounding. In the
quantizers the sign is that of the input element x (after the RHT), also where x * e_b underflows
to -0.0. Only those codes changed: every other code and every scale is what it was before."""

from __future__ import annotations

import dataclasses
import importlib
import math
import re

import pytest
import torch

from fp4gen.dsl import load_recipe
from fp4gen.formats import E2M1, E2M3, E3M2, E4M3, E5M2, BlockFormat, ElementFormat, ScaleSpec
from fp4gen.numerics.gemm import gemm_reference
from fp4gen.numerics.hadamard import rht
from fp4gen.numerics.minifloat import _round_magnitude, decode, encode, nan_code
from fp4gen.numerics.mor import mor_quantize
from fp4gen.numerics.quantize import quantize, resolve_rht

# the modules (fp4gen.numerics re-exports a function named quantize)
quantize_module = importlib.import_module("fp4gen.numerics.quantize")
mor_module = importlib.import_module("fp4gen.numerics.mor")

E3M3 = ElementFormat(3, 3)
FORMATS = [E2M1, E2M3, E3M2, E4M3, E5M2, E3M3]
ROUNDINGS = ["nearest", "stochastic", "stochastic16", "stochastic8", "zero"]


def ids(fmt: ElementFormat) -> str:
    return fmt.name.replace(" ", "-")


def random_fields(shape: tuple[int, ...], rounding: str, seed: int = 0) -> torch.Tensor | None:
    if not rounding.startswith("stochastic"):
        return None
    bits = {"stochastic": 32, "stochastic16": 16, "stochastic8": 8}[rounding]
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 2**bits, shape, generator=g, dtype=torch.int64)


# ----------------------------------------------------------------------------------------------
# The element encode
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("rounding", ROUNDINGS)
@pytest.mark.parametrize("fmt", FORMATS, ids=ids)
def test_small_negative_keeps_its_sign_and_minus_zero_is_code_zero(
    fmt: ElementFormat, rounding: str
) -> None:
    sign = 1 << (fmt.bits - 1)
    tiny = fmt.min_positive
    # below the smallest step: zero under nearest and zero, and under stochastic rounding with
    # the random fields that round down (32 bits: up iff r < t; 8, 16 bits: iff t + r >= 2^b)
    small = [-tiny / 8, -tiny / 1000, -1e-30, -1e-40, -1e-45, -(2.0**-149)]
    y = torch.tensor(small + [-0.0, 0.0, tiny / 8, 1e-45], dtype=torch.float32)
    r = None
    if rounding.startswith("stochastic"):
        fill = 2**32 - 1 if rounding == "stochastic" else 0
        r = torch.full(y.shape, fill, dtype=torch.int64)
    codes = encode(y, fmt, rounding, r)  # type: ignore[arg-type]
    n = len(small)
    assert codes[:n].tolist() == [sign] * n, (fmt.name, rounding, codes.tolist())
    assert codes[n:].tolist() == [0, 0, 0, 0]
    values = decode(codes, fmt)
    assert torch.equal(values[:n], torch.zeros(n))  # zero ...
    assert all(math.copysign(1.0, v) == -1.0 for v in values[:n].tolist())  # ... negative
    assert math.copysign(1.0, values[n].item()) == 1.0  # -0.0 came back as +0.0
    if fmt == E2M1:  # the example: -0.1 is 0x8
        r1 = None if r is None else r[:1]
        assert encode(torch.tensor([-0.1]), E2M1, rounding, r1).tolist() == [0x8]  # type: ignore[arg-type]


@pytest.mark.parametrize("fmt", FORMATS, ids=ids)
def test_negative_override_is_the_quantizers_sign(fmt: ElementFormat) -> None:
    """``negative`` decides the sign bit (the quantizers pass x < 0): -0.0 marked negative is
    negative zero, a negative value not marked keeps its magnitude's code without the sign."""
    sign = 1 << (fmt.bits - 1)
    y = torch.tensor([-0.0, -0.0, -1e-30, 0.0])
    neg = torch.tensor([True, False, False, False])
    assert encode(y, fmt, negative=neg).tolist() == [sign, 0, 0, 0]
    with pytest.raises(ValueError, match="negative has shape"):
        encode(y, fmt, negative=neg[:2])


def te_style_e2m1(y: torch.Tensor) -> torch.Tensor:
    """An independent E2M1 quantizer, a table of thresholds as in Transformer Engine's reference
    cast (round to nearest, ties to the even code; |y| <= 6 expected): the sign bit for every
    y < 0, so -0.0 is code 0 and a negative y that rounds to zero is 0x8."""
    a = y.abs()
    code = torch.zeros_like(y, dtype=torch.uint8)
    bounds = [(0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False)]
    bounds += [(3.5, True), (5.0, False)]  # (midpoint, ties go up: the upper code is even)
    for mid, tie_up in bounds:
        code += ((a > mid) | ((a == mid) & tie_up)).to(torch.uint8)
    return code | ((y < 0).to(torch.uint8) << 3)


def independent_rne(y: torch.Tensor, fmt: ElementFormat) -> torch.Tensor:
    """Nearest value of the grid decoded from the format's definition (float64 distances, exact
    here), ties to the even code, saturating; the sign bit for every y < 0."""
    values = [fmt.value(c) for c in range(1 << (fmt.bits - 1))]
    grid = torch.tensor([v for v in values if math.isfinite(v)], dtype=torch.float64)
    a = y.double().abs().clamp(max=grid[-1].item())
    dist = (a[:, None] - grid[None, :]).abs()
    best = dist.min(dim=1, keepdim=True).values
    cands = dist == best
    idx = torch.arange(grid.numel())
    # among the (at most two) nearest, the even code
    even = cands & (idx % 2 == 0)[None, :]
    pick = torch.where(even.any(dim=1), even.int().argmax(dim=1), cands.int().argmax(dim=1))
    return (pick | ((y < 0).to(torch.int64) << (fmt.bits - 1))).to(torch.uint8)


def dense_values(fmt: ElementFormat, n: int = 40000, seed: int = 0) -> torch.Tensor:
    """Log-uniform magnitudes from 2^-149 to the format's max, both signs, the grid, its
    midpoints and their fp32 neighbours, and both zeros."""
    g = torch.Generator().manual_seed(seed)
    top = math.log2(fmt.max_finite)
    mags = torch.exp2(torch.rand(n, generator=g, dtype=torch.float64) * (top + 149) - 149)
    mags = mags.float().clamp(max=fmt.max_finite)
    values = [fmt.value(c) for c in range(1 << (fmt.bits - 1))]
    grid = torch.tensor([v for v in values if math.isfinite(v)], dtype=torch.float64)
    mids = ((grid[1:] + grid[:-1]) / 2).float()
    probes = torch.cat([grid.float(), mids])
    probes = torch.cat([probes, torch.nextafter(probes, torch.zeros_like(probes))])
    probes = torch.cat([probes, torch.nextafter(probes, torch.full_like(probes, math.inf))])
    mags = torch.cat([mags, probes.clamp(max=fmt.max_finite)])
    return torch.cat([mags, -mags, torch.tensor([0.0, -0.0])])


def test_e2m1_matches_an_independent_table_quantizer() -> None:
    y = dense_values(E2M1)
    assert torch.equal(encode(y, E2M1), te_style_e2m1(y))
    assert int((te_style_e2m1(y) == 0x8).sum()) > 1000  # many negative zeros compared


@pytest.mark.parametrize("fmt", [E2M3, E3M2, E3M3], ids=ids)
def test_other_formats_match_an_independent_nearest_quantizer(fmt: ElementFormat) -> None:
    y = dense_values(fmt, n=20000)
    assert torch.equal(encode(y, fmt), independent_rne(y, fmt))


@pytest.mark.parametrize(("fmt", "dtype"), [(E4M3, torch.float8_e4m3fn), (E5M2, torch.float8_e5m2)])
def test_float8_matches_torch_casts(fmt: ElementFormat, dtype: torch.dtype) -> None:
    """torch's casts round to nearest even and keep the sign of zero; inputs beyond the finite
    range are clipped first (fp4gen saturates, torch's e5m2 cast does not). The one difference:
    torch keeps -0.0 as 0x80, fp4gen encodes it as code 0."""
    y = dense_values(fmt, n=200000, seed=3)
    g = torch.Generator().manual_seed(4)
    y = torch.cat([y, torch.randn(100000, generator=g) * fmt.max_finite * 2])
    clipped = y.clamp(-fmt.max_finite, fmt.max_finite)
    theirs = clipped.to(dtype).view(torch.uint8)
    ours = encode(y, fmt)
    minus_zero = (y == 0) & (torch.signbit(y))
    assert torch.equal(theirs[minus_zero], torch.full_like(theirs[minus_zero], 0x80))
    assert torch.equal(ours[minus_zero], torch.zeros_like(ours[minus_zero]))
    assert torch.equal(ours[~minus_zero], theirs[~minus_zero])
    assert int((ours == 0x80).sum()) > 1000  # many negative zeros compared


# ----------------------------------------------------------------------------------------------
# The quantizers
# ----------------------------------------------------------------------------------------------
def quantizer_input(seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Rows over magnitudes 2^-40 .. 2^40 (many values round to zero in their blocks), -0.0,
    +0.0, fp32 subnormals and a block whose small values underflow x * e_b to -0.0."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(48, 128, generator=g)
    x = x * torch.exp2(torch.randint(-40, 41, (48, 1), generator=g).float())
    x = x * torch.exp2(torch.randint(-12, 1, (48, 128), generator=g).float())
    x[:, 1::9] = -0.0
    x[:, 2::11] = 0.0
    x[5, :] = -1e-40
    x[6, :32] = -1e-38
    x[6, 0] = 3e38  # e_b ~ 2^-126: -1e-38 * e_b underflows to -0.0
    return x.to(dtype)


def previous_encode(y, fmt, rounding="nearest", random_bits=None, negative=None):
    """The encode before negative zeros: the sign bit only on non-zero magnitudes."""
    y = y.to(torch.float32)
    nan = torch.isnan(y)
    a = torch.where(nan, torch.zeros_like(y), y.abs())
    mag = _round_magnitude(a, fmt, rounding, random_bits)
    if fmt.signed:
        mag = mag | (((y < 0) & (mag != 0)).to(torch.int64) << (fmt.bits - 1))
    nc = nan_code(fmt)
    if nc is not None:
        mag = torch.where(nan, torch.full_like(mag, nc), mag)
    return mag.to(torch.uint8)


FORMAT_CASES = [
    ("nvfp4", None, None),
    ("nvfp4", (16, 16), None),
    ("nvfp4", None, 16),
    ("mxfp4", None, 32),
    ("mxfp6_e2m3", None, None),
    ("mxfp6_e3m2", None, None),
    ("mxfp8_e4m3", None, None),
    ("mxfp8_e5m2", None, None),
    (BlockFormat("e3m3", E3M3, (1, 16), ScaleSpec(E4M3, "nearest"), True), None, None),
]


@pytest.mark.parametrize("rounding", ROUNDINGS)
@pytest.mark.parametrize(("fmt", "block", "hadamard"), FORMAT_CASES)
def test_only_negative_zeros_changed(fmt, block, hadamard, rounding: str, monkeypatch) -> None:
    """Against the previous rule on random tensors: the scales and global scale are identical,
    and codes differ exactly where the (transformed) input is negative and the previous code was
    0, which is now the negative zero."""
    for seed, dtype in [(0, torch.float32), (1, torch.bfloat16)]:
        x = quantizer_input(seed, dtype)
        kw = {"block": block} if block else {}
        new = quantize(x, fmt, rounding=rounding, hadamard=hadamard, seed=9, **kw)
        with monkeypatch.context() as m:
            m.setattr(quantize_module, "encode", previous_encode)
            old = quantize(x, fmt, rounding=rounding, hadamard=hadamard, seed=9, **kw)
        assert torch.equal(new.scales.view(torch.int32), old.scales.view(torch.int32))
        assert torch.equal(new.global_scale.view(torch.int32), old.global_scale.view(torch.int32))
        if new.scale_codes is not None:
            assert torch.equal(new.scale_codes, old.scale_codes)
        xt = x.float().reshape(new.codes.shape)
        if hadamard is not None:
            xt = rht(xt, resolve_rht(hadamard))
        sign = 1 << (new.element.bits - 1)
        changed = new.codes != old.codes
        negative_zero = (xt < 0) & (old.codes == 0)
        assert torch.equal(changed, negative_zero)
        assert bool((new.codes[changed] == sign).all())
        assert int(changed.sum()) > 0
        # -0.0 inputs stay code 0 (without an RHT, which mixes them with their neighbours)
        if hadamard is None:
            minus_zero = (xt == 0) & torch.signbit(xt)
            assert bool(minus_zero.any()) and bool((new.codes[minus_zero] == 0).all())
        # an underflowing product keeps the sign of x (row 6, without an RHT)
        if hadamard is None and block is None and new.element.bits == 4:
            assert bool((new.codes[6, 1:16] == sign).all())


MOR_RULES = ["mor_tensor", "mor_subtensor_2way", "mor_subtensor_3way"]


@pytest.mark.parametrize("rounding", ["nearest", "stochastic", "zero"])
@pytest.mark.parametrize("name", MOR_RULES)
def test_mor_only_negative_zeros_changed(name: str, rounding: str, monkeypatch) -> None:
    rule = load_recipe(name).mors[0]
    x = quantizer_input(2)
    x[:, 64:] *= 2.0**-20  # blocks that e4m3 flushes in part
    new = mor_quantize(x, rule, rounding=rounding, seed=4)
    with monkeypatch.context() as m:
        m.setattr(mor_module, "encode", previous_encode)
        old = mor_quantize(x, rule, rounding=rounding, seed=4)
    assert torch.equal(new.choice, old.choice)
    assert torch.equal(new.error_sum, old.error_sum)
    changed = new.codes != old.codes
    assert bool((old.codes[changed] == 0).all()) and bool((x[changed] < 0).all())
    assert bool((new.codes[changed] == 0x80).all())  # the shipped rules' elements are 8-bit
    assert bool(((x == 0) & torch.signbit(x) & (new.codes != 0)).sum() == 0)


def test_mor_negative_zero_in_a_quantized_unit() -> None:
    """A negative value that e4m3 rounds to zero in a unit that stays e4m3 is 0x80."""
    rule = load_recipe("mor_tensor").mors[0]
    x = torch.full((4, 16), 1.0)
    x[0, 0] = 448.0
    x[1, 1] = -1e-6  # far below e4m3's smallest subnormal at this scale: rounds to zero
    x[1, 2] = -0.0
    mt = mor_quantize(x, rule)
    assert mt.choice.tolist() == [[0]]  # e4m3
    assert int(mt.codes[1, 1]) == 0x80 and int(mt.codes[1, 2]) == 0


# ----------------------------------------------------------------------------------------------
# Dequantize and GEMM: a negative zero is zero
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["nvfp4", "mxfp4", "mxfp6_e3m2", "mxfp8_e4m3", "mxfp8_e5m2"])
def test_negative_zero_dequantizes_to_minus_zero_and_multiplies_as_zero(name: str) -> None:
    g = torch.Generator().manual_seed(5)
    a = torch.randn(32, 64, generator=g)
    a[:, ::4] = -1e-12  # rounds to zero next to values of order 1
    b = torch.randn(24, 64, generator=g)
    qa, qb = quantize(a, name), quantize(b, name)
    sign = 1 << (qa.element.bits - 1)
    nz = qa.codes == sign
    assert bool(nz[:, ::4].all())
    deq = qa.dequantize()
    assert bool((deq[nz] == 0).all()) and bool(torch.signbit(deq[nz]).all())
    # the GEMM equals the one with the negative zeros replaced by +0
    cleared = dataclasses.replace(qa, codes=torch.where(nz, torch.zeros_like(qa.codes), qa.codes))
    assert torch.equal(gemm_reference(qa, qb), gemm_reference(cleared, qb))


# ----------------------------------------------------------------------------------------------
# The generated kernels' encodes (CPU: the rendered sources)
# ----------------------------------------------------------------------------------------------
def test_kernel_encodes_take_the_sign_of_x() -> None:
    """Every quantize kernel scales with scale_value (one fma.rn with +0.0: the sign bit of the
    result is x < 0) and sets the sign bit of every code from it, a zero magnitude included: no
    sign clearing is left in the templates. The MoR kernels set it iff x < 0."""
    from pathlib import Path

    templates = Path(quantize_module.__file__).resolve().parent.parent / "templates"
    kernels = templates.parent / "kernels"
    encoder = (kernels / "encode.py").read_text()
    assert "clear_negative_zero" not in encoder and "LANE_MAGS" not in encoder
    assert '"fma.rn.f32 $0, $1, $2, 0f00000000;"' in (kernels / "quant_ptx.py").read_text()
    for path in (kernels / "tile.py", kernels / "quantize.py"):
        src = path.read_text()
        assert "scale_value(x, e" in src
        assert not re.search(r"\[x \* e(_b)? for", src), path.name  # no plain multiply left
    mor = (kernels / "mor.py").read_text()
    assert "cutlass.select_(x < Float32(0.0)" in mor
