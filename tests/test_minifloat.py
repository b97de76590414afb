"""Minifloat encode/decode against an independent scalar float64 implementation and torch."""

from __future__ import annotations

import bisect
import math
from fractions import Fraction

import numpy as np
import pytest
import torch

from fp4gen.formats import E2M1, E2M3, E3M2, E4M3, E5M2, UE8M0, ElementFormat
from fp4gen.numerics.minifloat import (
    decode,
    encode,
    encode_scale,
    grid_values,
    max_exponent,
    max_finite,
    nan_code,
)

# ----------------------------------------------------------------------------------------------
# Independent reference: scalar Python, straight from the format definitions.
# ----------------------------------------------------------------------------------------------


def ref_decode(code: int, e: int, m: int, signed: bool, special: str) -> float:
    bias = 2 ** (e - 1) - 1
    if not signed:  # UExM0: 2^(code - bias), all ones NaN
        return math.nan if code == 2**e - 1 else 2.0 ** (code - bias)
    nbits = 1 + e + m
    sign = -1.0 if code >> (nbits - 1) else 1.0
    exp_field = (code >> m) & (2**e - 1)
    mant = code % 2**m
    if special == "ieee" and exp_field == 2**e - 1:
        return sign * math.inf if mant == 0 else math.nan
    if special == "fn" and exp_field == 2**e - 1 and mant == 2**m - 1:
        return math.nan
    if exp_field == 0:
        return sign * (mant / 2**m) * 2.0 ** (1 - bias)
    return sign * (1 + mant / 2**m) * 2.0 ** (exp_field - bias)


class Ref:
    """Scalar reference rounding for one format."""

    def __init__(self, fmt: ElementFormat) -> None:
        self.fmt = fmt
        e, m, signed, sp = fmt.exp_bits, fmt.man_bits, fmt.signed, fmt.special
        self.nbits = (1 + e + m) if signed else e
        self.values = [ref_decode(c, e, m, signed, sp) for c in range(2**self.nbits)]
        n_pos = 2**self.nbits if not signed else 2 ** (self.nbits - 1)
        pos = [(v, c) for c, v in enumerate(self.values[:n_pos]) if math.isfinite(v)]
        pos.sort()
        self.grid = [v for v, _ in pos]
        self.codes = [c for _, c in pos]
        self.max = self.grid[-1]

    def neighbours(self, a: float) -> tuple[int, int]:
        """Indices lo <= hi into the grid with grid[lo] <= a <= grid[hi] (a clamped first)."""
        a = min(max(a, self.grid[0]), self.max)
        hi = bisect.bisect_left(self.grid, a)
        lo = hi if self.grid[hi] == a else hi - 1
        return lo, hi

    def _signed(self, y: float, idx: int) -> int:
        """The sign bit for every y < 0, a zero magnitude included (-0.0 is not < 0)."""
        code = self.codes[idx]
        if self.fmt.signed and y < 0:
            code |= 1 << (self.nbits - 1)
        return code

    def rne(self, y: float) -> int:
        lo, hi = self.neighbours(abs(y))
        a = min(max(abs(y), self.grid[0]), self.max)
        # Differences of an fp32 value and grid values are exact in float64 here.
        dlo, dhi = a - self.grid[lo], self.grid[hi] - a
        if dlo < dhi:
            idx = lo
        elif dhi < dlo:
            idx = hi
        else:
            idx = lo if self.codes[lo] % 2 == 0 else hi
        return self._signed(y, idx)

    def toward_zero(self, y: float) -> int:
        return self._signed(y, self.neighbours(abs(y))[0])

    def up(self, y: float) -> int:
        return self._signed(y, self.neighbours(abs(y))[1])

    def stochastic(self, y: float, r: int, bits: int = 32) -> int:
        lo, hi = self.neighbours(abs(y))
        if lo == hi:
            return self._signed(y, lo)
        a = min(Fraction(abs(y)), Fraction(self.max))
        frac = (a - Fraction(self.grid[lo])) / (Fraction(self.grid[hi]) - Fraction(self.grid[lo]))
        t = math.floor(frac * 2**bits)
        up = r < t if bits == 32 else t + r >= 2**bits  # 8/16 bits: the carry out of t + r
        return self._signed(y, hi if up else lo)


def f32(values) -> np.ndarray:
    return np.asarray(values, dtype=np.float64).astype(np.float32)


def probe_values(ref: Ref) -> np.ndarray:
    """Grid values, midpoints, the fp32 neighbours of midpoints, values beyond max, both signs."""
    g = np.array(ref.grid, dtype=np.float64)
    mids = f32((g[:-1] + g[1:]) / 2)  # exact: one more bit than the format has
    assert np.all(mids.astype(np.float64) == (g[:-1] + g[1:]) / 2)
    above = np.nextafter(mids, np.float32(np.inf))
    below = np.nextafter(mids, np.float32(0))
    beyond = f32([min(ref.max * 1.25, 3.0e38), min(ref.max * 4, 3.0e38), 3.0e38, np.inf])
    tiny = f32([1e-45, 1e-30, g[1] / 4 if len(g) > 1 else 0.0])
    pos = np.concatenate([f32(g), mids, above, below, beyond, tiny])
    return np.concatenate([pos, -pos, f32([0.0, -0.0])])


# Every signed ExMy of 3..8 bits with the "finite" convention, plus fn/ieee variants, plus
# every UExM0: the reference is generic, so it is tested on every format a recipe can name.
SIGNED = [(e, m) for e in range(1, 8) for m in range(0, 8) if 3 <= 1 + e + m <= 8]
FORMATS = (
    [ElementFormat(e, m) for e, m in SIGNED]
    + [ElementFormat(e, m, special="fn") for e, m in SIGNED if m >= 1]
    + [ElementFormat(e, m, special="ieee") for e, m in SIGNED if m >= 1]
    + [ElementFormat(e, 0, signed=False) for e in range(2, 9)]
)
NAMED = [E2M1, E2M3, E3M2, E4M3, E5M2, UE8M0]


def ids(fmt: ElementFormat) -> str:
    return fmt.name.replace(" ", "-")


@pytest.mark.parametrize("fmt", FORMATS, ids=ids)
def test_decode_every_code(fmt: ElementFormat) -> None:
    ref = Ref(fmt)
    codes = torch.arange(2**ref.nbits, dtype=torch.uint8)
    got = decode(codes, fmt).double().tolist()
    for c, (g, r) in enumerate(zip(got, ref.values, strict=True)):
        assert (math.isnan(g) and math.isnan(r)) or g == r, (fmt.name, c, g, r)


@pytest.mark.parametrize("fmt", FORMATS, ids=ids)
def test_encode_nearest_every_grid_point_and_midpoint(fmt: ElementFormat) -> None:
    ref = Ref(fmt)
    ys = probe_values(ref)
    got = encode(torch.from_numpy(ys), fmt).tolist()
    want = [ref.rne(float(y)) for y in ys]
    bad = [(float(y), g, w) for y, g, w in zip(ys, got, want, strict=True) if g != w]
    assert not bad, bad[:5]
    # The grid helper and max agree with the reference grid.
    assert grid_values(fmt).double().tolist() == ref.grid
    assert max_finite(fmt) == ref.max
    assert max_exponent(fmt) == math.floor(math.log2(ref.max))


@pytest.mark.parametrize("fmt", NAMED, ids=ids)
def test_named_formats_match_formats_py(fmt: ElementFormat) -> None:
    assert max_finite(fmt) == fmt.max_finite
    assert max_exponent(fmt) == fmt.emax
    assert grid_values(fmt)[0].item() == (fmt.min_positive if fmt.exponent_only else 0.0)
    assert grid_values(fmt)[1].item() == (
        2 * fmt.min_positive if fmt.exponent_only else fmt.min_positive
    )


def test_e2m1_contract_thresholds() -> None:
    # Numerics contract section 1, written out.
    ys = [0.25, 0.2500001, 0.7499999, 0.75, 1.25, 1.2500001, 1.7499999, 1.75, 2.5, 2.5000002]
    ys += [3.4999998, 3.5, 5.0, 5.0000005, 100.0]
    want = [0.0, 0.5, 0.5, 1.0, 1.0, 1.5, 1.5, 2.0, 2.0, 3.0, 3.0, 4.0, 4.0, 6.0, 6.0]
    y = torch.tensor(ys, dtype=torch.float32)
    assert decode(encode(y, E2M1), E2M1).tolist() == want
    assert decode(encode(-y, E2M1), E2M1).tolist() == [-w for w in want]
    assert encode(-y, E2M1).tolist()[0] == 0x8  # -0.25 rounds to zero: negative zero


def test_signed_zero() -> None:
    """A negative value that rounds to zero keeps its sign; -0.0 encodes as code 0."""
    y = torch.tensor([-0.0, -1e-30, -0.2, 0.0, 1e-30], dtype=torch.float32)
    for fmt in (E2M1, E4M3, E5M2):
        sign = 1 << (fmt.bits - 1)
        assert encode(y, fmt).tolist()[:2] == [0, sign]
        assert encode(y, fmt).tolist()[3:] == [0, 0]
    assert encode(y, E2M1).tolist()[2] == 0x8


@pytest.mark.parametrize("fmt", NAMED + [ElementFormat(3, 4), ElementFormat(1, 2)], ids=ids)
def test_encode_zero_and_stochastic_sample(fmt: ElementFormat) -> None:
    ref = Ref(fmt)
    rng = np.random.default_rng(1234)
    g = np.array(ref.grid)
    lo, hi = max(g[0], 1e-30), g[-1] * 1.1
    ys = f32(np.exp(rng.uniform(np.log(lo), np.log(hi), 400)) * rng.choice([-1, 1], 400))
    ys = np.concatenate([ys, probe_values(ref)])
    rs = rng.integers(0, 2**32, ys.size, dtype=np.int64)
    y_t, r_t = torch.from_numpy(ys), torch.from_numpy(rs)
    assert encode(y_t, fmt, "zero").tolist() == [ref.toward_zero(float(y)) for y in ys]
    got = encode(y_t, fmt, "stochastic", r_t).tolist()
    assert got == [ref.stochastic(float(y), int(r)) for y, r in zip(ys, rs, strict=True)]


@pytest.mark.parametrize("bits", [8, 16])
@pytest.mark.parametrize("fmt", [E2M1, E4M3, ElementFormat(3, 2), ElementFormat(1, 2)], ids=ids)
def test_encode_stochastic_fields(fmt: ElementFormat, bits: int) -> None:
    # 8/16 random bits per value: up iff floor(frac * 2^bits) + r >= 2^bits, for every r at
    # probe values (grid points, midpoints and their neighbours) and random ones
    ref = Ref(fmt)
    rng = np.random.default_rng(bits)
    g = np.array(ref.grid)
    ys = f32(np.exp(rng.uniform(np.log(max(g[0], 1e-30)), np.log(g[-1] * 1.1), 300)))
    ys = np.concatenate([ys * rng.choice([-1, 1], ys.size), probe_values(ref)])
    rs = rng.integers(0, 2**bits, ys.size, dtype=np.int64)
    rs[:4] = [0, 1, 2**bits - 2, 2**bits - 1]
    got = encode(torch.from_numpy(ys), fmt, f"stochastic{bits}", torch.from_numpy(rs)).tolist()
    want = [ref.stochastic(float(y), int(r), bits) for y, r in zip(ys, rs, strict=True)]
    assert got == want


@pytest.mark.parametrize("fmt", [E2M1, E4M3, UE8M0], ids=ids)
def test_stochastic_threshold_is_exact(fmt: ElementFormat) -> None:
    # Round up iff r < t = floor(frac * 2^32): check r = t - 1 (up) and r = t (down).
    ref = Ref(fmt)
    rng = np.random.default_rng(7)
    k = rng.integers(1, len(ref.grid) - 1, 200)
    lo, hi = np.array(ref.grid)[k - 1], np.array(ref.grid)[k]
    ys = f32(lo + (hi - lo) * rng.uniform(0.001, 0.999, k.size))
    ys = ys[(ys.astype(np.float64) > lo) & (ys.astype(np.float64) < hi)]
    ts = []
    for y in ys:
        lo_i, hi_i = ref.neighbours(float(y))
        frac = (Fraction(float(y)) - Fraction(ref.grid[lo_i])) / (
            Fraction(ref.grid[hi_i]) - Fraction(ref.grid[lo_i])
        )
        ts.append(math.floor(frac * 2**32))
    t = torch.tensor(ts, dtype=torch.int64)
    y_t = torch.from_numpy(ys)
    up = encode(y_t, fmt, "stochastic", t - 1)
    down = encode(y_t, fmt, "stochastic", t)
    assert up.tolist() == [ref.up(float(y)) for y in ys]
    assert down.tolist() == [ref.toward_zero(float(y)) for y in ys]


@pytest.mark.parametrize("fmt", [E4M3, UE8M0, ElementFormat(5, 0, signed=False)], ids=ids)
def test_encode_scale_modes(fmt: ElementFormat) -> None:
    ref = Ref(fmt)
    ys = np.abs(probe_values(ref))
    ys = ys[np.isfinite(ys)]
    d = torch.from_numpy(ys)
    assert encode_scale(d, fmt, "nearest").tolist() == [ref.rne(float(y)) for y in ys]
    assert encode_scale(d, fmt, "up").tolist() == [ref.up(float(y)) for y in ys]
    assert encode_scale(d, fmt, "down").tolist() == [ref.toward_zero(float(y)) for y in ys]
    if fmt.exponent_only:  # no zero: 0 and tiny values clamp to the smallest value 2^-bias
        assert encode_scale(torch.tensor([0.0, 1e-45]), fmt, "down").tolist() == [0, 0]


def test_nan_codes() -> None:
    assert nan_code(E2M1) is None
    assert nan_code(E4M3) == 0x7F
    assert nan_code(E5M2) == 0x7F
    assert nan_code(UE8M0) == 0xFF
    y = torch.tensor([math.nan])
    assert encode(y, E4M3).tolist() == [0x7F]
    assert encode(y, UE8M0).tolist() == [0xFF]


# ----------------------------------------------------------------------------------------------
# torch's float8 types
# ----------------------------------------------------------------------------------------------


def dense_fp32(lo: float, hi: float, n: int = 20000, seed: int = 0) -> torch.Tensor:
    rng = np.random.default_rng(seed)
    mags = np.exp(rng.uniform(np.log(lo), np.log(hi), n))
    return torch.from_numpy(f32(mags * rng.choice([-1, 1], n)))


def with_midpoints(fmt: ElementFormat, y: torch.Tensor) -> torch.Tensor:
    probes = torch.from_numpy(probe_values(Ref(fmt)))
    probes = probes[probes.abs() <= fmt.max_finite]
    return torch.cat([y, probes])


@pytest.mark.parametrize("fmt,dtype", [(E4M3, torch.float8_e4m3fn), (E5M2, torch.float8_e5m2)])
def test_matches_torch_float8(fmt: ElementFormat, dtype: torch.dtype) -> None:
    codes = torch.arange(256, dtype=torch.uint8)
    ours, theirs = decode(codes, fmt), codes.view(dtype).float()
    assert torch.equal(ours.isnan(), theirs.isnan())
    assert torch.equal(ours[~ours.isnan()], theirs[~theirs.isnan()])
    # Encode within the finite range (torch's e5m2 cast does not saturate beyond it).
    y = with_midpoints(fmt, dense_fp32(1e-9, fmt.max_finite))
    torch_codes = y.to(dtype).view(torch.uint8)
    # Both keep the sign of a negative value that rounds to zero (0x80); torch's cast also
    # gives 0x80 for -0.0, which fp4gen encodes as code 0 (Transformer Engine's reference).
    assert int((y == 0).sum()) > 0 and int((torch_codes == 0x80).sum()) > int((y == 0).sum())
    torch_codes = torch.where(y == 0, torch.zeros_like(torch_codes), torch_codes)
    assert torch.equal(encode(y, fmt), torch_codes)


def test_ue8m0_against_torch_e8m0fnu() -> None:
    codes = torch.arange(256, dtype=torch.uint8)
    ours, theirs = decode(codes, UE8M0), codes.view(torch.float8_e8m0fnu).float()
    assert torch.equal(ours[:255], theirs[:255]) and ours[255].isnan() and theirs[255].isnan()
    # torch's cast rounds to the nearest power of two with ties (1.5 * 2^k) going up, where fp4gen
    # picks the even code: they agree everywhere except on ties whose lower code is odd.
    y = dense_fp32(2.0**-126, 2.0**126).abs()
    ties = torch.tensor([1.5 * 2.0**k for k in range(-126, 126)], dtype=torch.float32)
    y = torch.cat([y, ties])
    ours = encode_scale(y, UE8M0, "nearest")
    theirs = y.to(torch.float8_e8m0fnu).view(torch.uint8)
    differ = ours != theirs
    is_tie = torch.isin(y, ties)
    assert torch.equal(differ, is_tie & (ours % 2 == 0) & (theirs == ours + 1))
    assert int(differ.sum()) == 126  # half of the 252 ties
