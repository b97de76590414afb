"""Property tests (hypothesis) of the reference numerics, and the error metrics."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fp4gen.dsl.model import RHTSpec
from fp4gen.formats import BUILTIN_FORMATS, UE8M0, BlockFormat, ElementFormat, ScaleSpec
from fp4gen.numerics.hadamard import inverse_rht, rht
from fp4gen.numerics.metrics import error_stats
from fp4gen.numerics.minifloat import decode
from fp4gen.numerics.quantize import QuantizedTensor, quantize

FAST = settings(max_examples=40, deadline=None)

# Custom formats exercise the generic paths: a 7-bit element with a 5-bit exponent-only scale
# and a global scale (scale rounding "nearest" on a power-of-two grid), and OCP MX scales.
CUSTOM = {
    "e3m3_ue5m0_global": BlockFormat(
        "e3m3_ue5m0_global",
        ElementFormat(3, 3),
        (1, 8),
        ScaleSpec(ElementFormat(5, 0, signed=False), "nearest"),
        True,
    ),
    "mxfp4_ocp": BlockFormat("mxfp4_ocp", ElementFormat(2, 1), (1, 32), ScaleSpec(UE8M0, "ocp")),
    "e4m3_e4m3_down": BlockFormat(
        "e4m3_e4m3_down",
        ElementFormat(4, 3, special="fn"),
        (1, 16),
        ScaleSpec(ElementFormat(4, 3, special="fn"), "down"),
        True,
    ),
}
BUILTIN = ["nvfp4", "mxfp4", "mxfp6_e2m3", "mxfp6_e3m2", "mxfp8_e4m3", "mxfp8_e5m2"]


def resolve(name: str) -> BlockFormat:
    fmt = CUSTOM.get(name) or BUILTIN_FORMATS[name]
    assert isinstance(fmt, BlockFormat)
    return fmt


# Inputs: magnitudes in [2^-60, 2^60] or exactly zero. Inside that range no fp32 intermediate
# (S_dec, s_b * S_dec, x * e_b, the dequantized products) is subnormal or overflows, so the only
# roundings are the ones the bounds below account for. Tiny/huge inputs are covered by the
# bit-exact tests in test_quantize.py instead.
@st.composite
def tensors(draw, max_rows: int = 24, max_cols: int = 80, cols_multiple: int = 1) -> torch.Tensor:
    rows = draw(st.integers(1, max_rows))
    cols = cols_multiple * draw(st.integers(1, max_cols // cols_multiple))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    kind = draw(st.sampled_from(["gaussian", "heavy", "sparse", "outliers", "constant"]))
    x = torch.randn(rows, cols, generator=g)
    if kind == "heavy":
        x = x / torch.rand(rows, cols, generator=g).clamp_min(1e-4)
    elif kind == "sparse":
        x = x * (torch.rand(rows, cols, generator=g) < 0.2)
    elif kind == "outliers":
        big = torch.rand(rows, cols, generator=g) < 0.02
        x = torch.where(big, x * 2.0 ** draw(st.integers(4, 24)), x)
    elif kind == "constant":
        x = torch.full((rows, cols), draw(st.sampled_from([0.0, 1.0, -3.0, 448.0, 1e-3])))
    x = x * 2.0 ** draw(st.integers(-30, 30))
    # A few explicitly drawn values (these shrink well when something fails).
    explicit = draw(
        st.lists(
            st.floats(-1e6, 1e6, width=32, allow_subnormal=False), max_size=min(8, rows * cols)
        )
    )
    flat = x.reshape(-1)
    if explicit:
        flat[: len(explicit)] = torch.tensor(explicit, dtype=torch.float32)
    flat = torch.where(flat.abs() < 2.0**-60, torch.zeros_like(flat), flat)
    return flat.clamp(-(2.0**60), 2.0**60).reshape(rows, cols)


def grid_gap(v: torch.Tensor, fmt: ElementFormat) -> torch.Tensor:
    """Spacing of the element grid in the interval containing v >= 0 (the upper one at a
    boundary), from the format parameters: the subnormal step below the smallest normal,
    2^(floor(log2 v) - man_bits) above it."""
    min_normal = 2.0 ** (1 - fmt.bias)
    sub_step = 2.0 ** (1 - fmt.bias - fmt.man_bits)
    e = torch.floor(torch.log2(v.clamp(min=min_normal)))
    return torch.where(v < min_normal, torch.full_like(v, sub_step), 2.0 ** (e - fmt.man_bits))


def element_error_bound(x: torch.Tensor, qt: QuantizedTensor, ulps: float) -> torch.Tensor:
    """Per-element bound on |x - x_hat| (x in the quantizer's space, float64).

    With s = s_b * S_dec and y = x / s: ``ulps`` grid gaps at |y| (1/2 for RNE, 1 for
    stochastic and toward-zero rounding) times s, plus the saturation loss |x| - elem_max * s
    where |y| > elem_max (scale rounding to nearest/down/ocp can put the block max above
    elem_max; a zero scale loses the whole value), plus fp32 slack: y, e_b and the
    dequantization are each rounded to fp32 (a few 2^-24 relative), bounded by 2^-20 |x|.
    """
    elem = qt.element
    elem_max = elem.max_finite
    s = qt.block_values(qt.scales).double() * qt.global_scale.double()
    ax = x.double().abs()
    y = torch.where(s > 0, ax / s, torch.full_like(ax, elem_max))
    v = (y * (1 + 2.0**-20)).clamp(max=elem_max)
    quant = ulps * grid_gap(v, elem) * s * (1 + 2.0**-20)
    saturation = (ax - elem_max * s).clamp(min=0)
    return quant + saturation + 2.0**-20 * ax


@FAST
@given(
    x=tensors(),
    name=st.sampled_from(BUILTIN + list(CUSTOM) + ["nvfp4_2d"]),
    rounding=st.sampled_from(["nearest", "stochastic", "zero"]),
    seed=st.integers(0, 2**64 - 1),
)
def test_error_within_bound(x: torch.Tensor, name: str, rounding: str, seed: int) -> None:
    block = (16, 16) if name == "nvfp4_2d" else None
    fmt = resolve("nvfp4" if name == "nvfp4_2d" else name)
    qt = quantize(x, fmt, block=block, rounding=rounding, seed=seed)
    err = (x.double() - qt.dequantize().double()).abs()
    ulps = 0.5 if rounding == "nearest" else 1.0
    bound = element_error_bound(x, qt, ulps)
    worst = int(torch.argmax(err - bound))
    assert torch.all(err <= bound), (worst, x.reshape(-1)[worst].item(), qt.format.name)


@FAST
@given(x=tensors(cols_multiple=16), d=st.sampled_from([2, 4, 16]))
def test_error_within_bound_in_rotated_space(x: torch.Tensor, d: int) -> None:
    spec = RHTSpec(16) if d == 16 else RHTSpec(d, "seeded", None, 11)
    qt = quantize(x, "nvfp4", hadamard=spec)
    rotated = rht(x, spec)
    err = (rotated.double() - qt.dequantize(rotated=True).double()).abs()
    assert torch.all(err <= element_error_bound(rotated, qt, 0.5))


def block_max_code_value(qt: QuantizedTensor) -> torch.Tensor:
    """max |decode(code)| per block."""
    br, bc = qt.format.block
    q = decode(qt.codes, qt.element).abs()
    rows, cols = q.shape
    nbr, nbc = qt.scales.shape
    q = torch.nn.functional.pad(q, (0, nbc * bc - cols, 0, nbr * br - rows))
    return q.reshape(nbr, br, nbc, bc).amax(dim=(1, 3))


# Re-quantizing a dequantized tensor. Exactly what holds (RNE elements):
# * A block keeps its scale, and therefore its codes, when its scale is non-zero and its largest
#   code has magnitude elem_max (for round-up scales: > elem_max / 2). Its ideal scale is then
#   recomputed as max|q| * s_b / elem_max (times fp32 noise of a few ulps from the recomputed
#   global scale), which rounds back onto s_b; each element maps back to q * (1 +- few ulps),
#   which RNE returns to q.
# * Other blocks may change codes, because their ideal scale moves: e.g. MXFP4 with the block max
#   at y in (3, 3.5) rounds to 3, and 3 * s_b / 6 rounds up to s_b / 2 (the codes double, the
#   values stay); in NVFP4 a block whose e4m3 scale is subnormal (< 2^-6) may have max |q| < 6
#   (the scale's relative rounding error exceeds 1/16), and a zero scale saturates the codes of a
#   block whose values are all 0. For NVFP4 every block with a normal scale has max |q| = 6, so
#   only subnormal/zero-scale blocks can change; this is asserted too.
# * With round-up power-of-two scales and no global scale (the MX formats), the values are
#   idempotent exactly: every value q * s_b is representable under the recomputed scale.
@FAST
@given(x=tensors(), name=st.sampled_from(BUILTIN + ["nvfp4_2d"]))
def test_requantize_is_stable(x: torch.Tensor, name: str) -> None:
    block = (16, 16) if name == "nvfp4_2d" else None
    fmt = resolve("nvfp4" if name == "nvfp4_2d" else name)
    qt = quantize(x, fmt, block=block)
    xh = qt.dequantize()
    qt2 = quantize(xh, fmt, block=block)
    elem_max = qt.element.max_finite
    peak = block_max_code_value(qt)
    if fmt.scale.rounding == "up":
        stable = (qt.scales > 0) & (peak > elem_max / 2)
    else:
        stable = (qt.scales > 0) & (peak == elem_max)
    assert torch.equal(qt2.scales[stable], qt.scales[stable])
    # a negative zero (a negative x that rounded to zero) dequantizes to -0.0, which encodes as
    # code 0 (docs/numerics.md 1); every other code comes back as it was
    neg_zero = 1 << (qt.element.bits - 1)
    same_codes = (qt2.codes == qt.codes) | ((qt.codes == neg_zero) & (qt2.codes == 0))
    assert torch.all(same_codes[qt.block_values(stable)])
    if fmt.name == "nvfp4":
        assert torch.all(qt.scales[peak < elem_max] < 2.0**-6)
        assert stable.any() or not x.any()  # the amax block (scale 448) is always stable
    if not fmt.global_scale:
        assert torch.equal(qt2.dequantize(), xh)


@settings(max_examples=12, deadline=None, derandomize=True)
@given(
    row=st.lists(st.floats(-100, 100, width=32, allow_subnormal=False), min_size=32, max_size=32),
    name=st.sampled_from(["nvfp4", "mxfp4", "mxfp8_e4m3"]),
)
def test_stochastic_rounding_is_unbiased(row: list[float], name: str) -> None:
    # N = 4 seeds x 2048 identical rows = 8192 draws per element. Every row has the same scales,
    # so each element's draws are i.i.d. with mean lo + gap * t / 2^32 (t = floor(p * 2^32)),
    # i.e. y up to gap * 2^-32. The sample mean must lie within 5 standard errors
    # (sd = gap * s * sqrt(p (1 - p)), p the position of y between its grid neighbours) plus
    # fp32 slack; saturated elements (|y| > elem_max, clamped, hence biased) are excluded.
    x = torch.tensor(row, dtype=torch.float32)
    tile = x.expand(2048, 32).contiguous()
    total = torch.zeros(32, dtype=torch.float64)
    for seed in range(4):
        qt = quantize(tile, name, rounding="stochastic", seed=seed, offset=seed * 7)
        total += qt.dequantize().double().sum(0)
    mean = total / 8192
    s = qt.block_values(qt.scales)[0].double() * qt.global_scale.double()
    elem_max = qt.element.max_finite
    ax = x.double().abs()
    # A zero scale (a block far below the tensor's amax) saturates every non-zero element.
    y = torch.where(s > 0, ax / s, torch.where(ax > 0, math.inf, 0.0))
    ok = y <= elem_max
    y = torch.where(ok, y, torch.zeros_like(y))
    gap = grid_gap(y, qt.element)
    p = (y - torch.floor(y / gap) * gap) / gap
    se = gap * s * torch.sqrt(p * (1 - p) / 8192)
    tol = 5 * se + 2.0**-20 * x.double().abs() + gap * s * 2.0**-31
    assert torch.all(((mean - x.double()).abs() <= tol)[ok])


@FAST
@given(x=tensors(), seed=st.integers(0, 2**64 - 1), offset=st.integers(0, 2**64 - 1))
def test_stochastic_rounding_is_reproducible(x: torch.Tensor, seed: int, offset: int) -> None:
    a = quantize(x, "nvfp4", rounding="stochastic", seed=seed, offset=offset)
    b = quantize(x, "nvfp4", rounding="stochastic", seed=seed, offset=offset)
    assert torch.equal(a.codes, b.codes) and torch.equal(a.scales, b.scales)
    assert (a.seed, a.offset) == (seed, offset)


def test_stochastic_rounding_depends_on_seed_and_offset() -> None:
    x = torch.randn(64, 64, generator=torch.Generator().manual_seed(0))
    base = quantize(x, "nvfp4", rounding="stochastic", seed=1).codes
    assert not torch.equal(base, quantize(x, "nvfp4", rounding="stochastic", seed=2).codes)
    other = quantize(x, "nvfp4", rounding="stochastic", seed=1, offset=1).codes
    assert not torch.equal(base, other)
    # RNE ignores the seed.
    assert torch.equal(quantize(x, "nvfp4", seed=1).codes, quantize(x, "nvfp4", seed=2).codes)


SIGNS = st.sampled_from(["fixed", "seeded", "none"])


def make_spec(d: int, source: str) -> RHTSpec:
    if source == "fixed":
        signs = tuple(1 if (i * 7 + 3) % 5 < 3 else -1 for i in range(d))
        return RHTSpec(d, "fixed", signs)
    if source == "seeded":
        return RHTSpec(d, "seeded", None, d * 31 + 1)
    return RHTSpec(d, "none", None, None)


@FAST
@given(
    x=tensors(cols_multiple=256, max_cols=512), d=st.sampled_from([2, 8, 16, 64, 256]), source=SIGNS
)
def test_rht_orthogonality(x: torch.Tensor, d: int, source: str) -> None:
    # rht then inverse = identity up to the bf16 rounding of rht's output: per d-chunk,
    # ||x - inverse(rht(x))|| <= 2^-8 ||x|| (u = 2^-8 for bf16; H orthogonal preserves norms),
    # with 1e-4 relative slack for the fp32 butterflies.
    spec = make_spec(d, source)
    back = inverse_rht(rht(x, spec), spec).double()
    rows = x.shape[0]
    err = (back - x.double()).reshape(rows, -1, d).norm(dim=-1)
    norm = x.double().reshape(rows, -1, d).norm(dim=-1)
    assert torch.all(err <= 2.0**-8 * (1 + 1e-4) * norm)


@FAST
@given(
    a=tensors(max_rows=12, cols_multiple=64, max_cols=128),
    n=st.integers(1, 12),
    d=st.sampled_from([4, 16, 64]),
    source=SIGNS,
)
def test_rht_on_both_operands_leaves_gemm_unchanged(
    a: torch.Tensor, n: int, d: int, source: str
) -> None:
    # (aH)(bH)^T = a b^T exactly for orthogonal H. With rht's bf16 output (relative error
    # u = 2^-8 per element) each product term is off by at most (2u + u^2) |(aH)_i (bH)_i|,
    # so |rht(a) rht(b)^T - a b^T| <= (2u + u^2) ||a_m|| ||b_n|| (Cauchy-Schwarz; 1e-3
    # relative slack for the fp32 butterflies).
    spec = make_spec(d, source)
    b = torch.randn(n, a.shape[1], generator=torch.Generator().manual_seed(n)) * 3
    exact = a.double() @ b.double().T
    rotated = rht(a, spec).double() @ rht(b, spec).double().T
    u = 2.0**-8
    tol = (2 * u + u * u) * (1 + 1e-3) * a.double().norm(dim=1)[:, None] * b.double().norm(dim=1)
    assert torch.all((rotated - exact).abs() <= tol)


# ----------------------------------------------------------------------------------------------
# Metrics
# ----------------------------------------------------------------------------------------------


def test_error_stats_values() -> None:
    # MXFP4, one block: amax 6 -> scale 1; 0.1 -> 0 (flushed), 2.5 -> 2 (tie to even).
    x = torch.zeros(1, 32)
    x[0, :4] = torch.tensor([0.1, 1.0, 2.5, 6.0])
    stats = error_stats(x, quantize(x, "mxfp4"))
    sig, noise = 0.1**2 + 1 + 2.5**2 + 36, 0.1**2 + 0.5**2
    assert stats.rel_error == pytest.approx(math.sqrt(noise / sig), rel=1e-6)
    assert stats.mean_rel_error == pytest.approx((1 + 0 + 0.2 + 0) / 4, rel=1e-6)
    assert stats.snr_db == pytest.approx(10 * math.log10(sig / noise), rel=1e-6)
    assert stats.flushed == 0.25
    assert stats.saturated == 0.0


def test_error_stats_saturation_and_exact() -> None:
    # NVFP4: A = 7 -> S_enc = 384; block 1 has amax 6.6 -> d = 422.4 -> e4m3 416 (rounded down),
    # so 6.6 * e_b = 6.09 > 6 saturates: one element of 32.
    x = torch.zeros(1, 32)
    x[0, 0], x[0, 16] = 7.0, 6.6
    stats = error_stats(x, quantize(x, "nvfp4"))
    assert stats.saturated == 1 / 32
    exact = torch.tensor([[1.0, -2.0, 0.5, 0.0] * 8])
    s = error_stats(exact, quantize(exact, "mxfp4"))
    assert (s.rel_error, s.mean_rel_error, s.flushed, s.saturated) == (0.0, 0.0, 0.0, 0.0)
    assert s.snr_db == math.inf
    z = error_stats(torch.zeros(2, 32), quantize(torch.zeros(2, 32), "nvfp4"))
    assert (z.rel_error, z.mean_rel_error, z.snr_db) == (0.0, 0.0, math.inf)


def test_error_stats_with_rht_and_shape_check() -> None:
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(3))
    qt = quantize(x, "nvfp4", hadamard=16)
    stats = error_stats(x, qt)
    assert 0 < stats.rel_error < 0.2 and stats.snr_db > 10
    with pytest.raises(ValueError, match="shape"):
        error_stats(x[:4], qt)
