"""Minifloat encode/decode for any :class:`~fp4gen.formats.ElementFormat`, from its parameters.

Every table here is generated from (exp_bits, man_bits, signed, special); there is no per-format
code. Two families are handled:

* signed ExMy, 3 to 8 bits: sign in the top bit, subnormals when the exponent field is 0, the
  all-ones exponent used per ``special`` ("finite": all finite, "fn": only S.1..1.1..1 is NaN,
  "ieee": all-ones exponent is Inf (mantissa 0) or NaN).
* unsigned exponent-only UExM0 (ue8m0): code E is 2^(E - bias), there is no zero, and the
  all-ones code is NaN.

The magnitude code of a finite value is monotone in the value (code k+1 is the next larger
value), so rounding reduces to finding the two neighbouring grid entries of |y| and picking one.
All comparisons happen in float32 and are exact: grid values, their differences (powers of two)
and the fraction (|y| - lo) / (hi - lo) are all exactly representable.
"""

from __future__ import annotations

import math
from functools import cache
from itertools import pairwise
from typing import Literal

import torch

from fp4gen.formats import ELEMENT_ROUNDINGS, ElementFormat, ElementRounding, is_stochastic, sr_bits
from fp4gen.numerics.tables import device_table

Rounding = ElementRounding
ScaleRoundingMode = Literal["nearest", "up", "down", "stochastic"]

_ROUNDINGS = ELEMENT_ROUNDINGS
_SCALE_MODES = ("nearest", "up", "down", "stochastic")


# ----------------------------------------------------------------------------------------------
# Tables generated from the format parameters
# ----------------------------------------------------------------------------------------------


def code_value(code: int, fmt: ElementFormat) -> float:
    """The value of one code as a Python float (NaN and +-Inf where the format has them)."""
    return fmt.value(code)


@cache
def _value_table(fmt: ElementFormat) -> tuple[float, ...]:
    return tuple(code_value(c, fmt) for c in range(1 << fmt.bits))


@cache
def _magnitude_grid(fmt: ElementFormat) -> tuple[float, ...]:
    """Finite non-negative values in code order; entry k is the value of magnitude code k."""
    values = _value_table(fmt)
    n_mag = (1 << fmt.bits) if fmt.exponent_only else (1 << (fmt.bits - 1))
    grid = []
    for v in values[:n_mag]:
        if not math.isfinite(v):
            break  # the finite codes are a prefix of the magnitude codes
        grid.append(v)
    # Monotone by construction; checked because rounding relies on it.
    assert all(a < b for a, b in pairwise(grid)), fmt
    return tuple(grid)


def grid_values(fmt: ElementFormat, device: torch.device | str | None = None) -> torch.Tensor:
    """The finite non-negative values of ``fmt`` ascending, as float32; index = magnitude code."""
    return _grid_tensor(fmt, torch.device(device) if device is not None else torch.device("cpu"))


def _grid_tensor(fmt: ElementFormat, device: torch.device) -> torch.Tensor:
    return device_table(("grid", fmt), lambda: _magnitude_grid(fmt), device)


def _decode_tensor(fmt: ElementFormat, device: torch.device) -> torch.Tensor:
    return device_table(("decode", fmt), lambda: _value_table(fmt), device)


def max_finite(fmt: ElementFormat) -> float:
    """Largest finite value, read off the generated grid (agrees with ``fmt.max_finite``)."""
    return _magnitude_grid(fmt)[-1]


def max_exponent(fmt: ElementFormat) -> int:
    """floor(log2(max finite)): OCP MX's emax_elem, read off the generated grid (agrees with
    ``fmt.emax`` wherever the largest value is a normal number)."""
    return math.frexp(max_finite(fmt))[1] - 1


def nan_code(fmt: ElementFormat) -> int | None:
    """The canonical NaN code (the largest positive one: all magnitude bits set), or None."""
    n_pos = (1 << fmt.bits) if fmt.exponent_only else (1 << (fmt.bits - 1))
    values = _value_table(fmt)
    return next((c for c in reversed(range(n_pos)) if math.isnan(values[c])), None)


# ----------------------------------------------------------------------------------------------
# Decode
# ----------------------------------------------------------------------------------------------


def decode(codes: torch.Tensor, fmt: ElementFormat) -> torch.Tensor:
    """Codes (uint8, any shape) -> float32 values. Every value of a <= 8-bit minifloat is exact
    in float32 (ue8m0's 2^-127 is an fp32 subnormal)."""
    if codes.dtype != torch.uint8:
        raise TypeError(f"decode expects uint8 codes, got {codes.dtype}")
    table = _decode_tensor(fmt, codes.device)
    # Bits above the format's width are ignored (as a kernel reading a packed field would).
    return table[(codes & ((1 << fmt.bits) - 1)).long()]


# ----------------------------------------------------------------------------------------------
# Encode
# ----------------------------------------------------------------------------------------------


def _neighbours(a: torch.Tensor, grid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Magnitude codes lo <= hi with grid[lo] <= a <= grid[hi]; lo == hi when a is on the grid.

    ``a`` must already be inside [grid[0], grid[-1]].
    """
    lo = torch.searchsorted(grid, a, right=True) - 1  # count of grid values <= a, minus one
    lo = lo.clamp(0, grid.numel() - 1)
    on_grid = grid[lo] == a
    hi = torch.where(on_grid, lo, (lo + 1).clamp(max=grid.numel() - 1))
    return lo, hi


def _round_magnitude(
    a: torch.Tensor,
    fmt: ElementFormat,
    mode: str,
    random_bits: torch.Tensor | None = None,
) -> torch.Tensor:
    """Magnitude code (int64) of a non-negative, NaN-free float32 ``a``.

    ``a`` is clamped into the finite range first (saturation), and for exponent-only formats
    into [min_positive, max_finite] since they have no zero.
    """
    grid = _grid_tensor(fmt, a.device)
    bounds = _magnitude_grid(fmt)  # Python floats: no device sync; both are fp32-exact
    a = a.clamp(min=bounds[0], max=bounds[-1])
    lo, hi = _neighbours(a, grid)
    if mode in ("zero", "down"):
        return lo
    if mode == "up":
        return hi
    g_lo, g_hi = grid[lo], grid[hi]
    # hi - lo is a power of two and a - lo is exact (Sterbenz), so frac is exact in fp32.
    # Where lo == hi the denominator is 0: frac is forced to 0 there.
    gap = torch.where(hi > lo, g_hi - g_lo, torch.ones_like(g_hi))
    frac = (a - g_lo) / gap
    if mode == "nearest":
        up = (frac > 0.5) | ((frac == 0.5) & (lo % 2 == 1))  # tie -> the even code
        return torch.where(up, hi, lo)
    if is_stochastic(mode):
        if random_bits is None:
            raise ValueError(f"{mode} rounding needs random_bits (one field per element)")
        # t = floor(frac * 2^bits) is exact: frac has at most 24 significant bits.
        bits = sr_bits(mode)
        t = torch.floor(frac.double() * float(2**bits)).to(torch.int64)
        r = random_bits.to(device=a.device, dtype=torch.int64)
        # 32 bits: r < t. 8 and 16 bits: the carry out of t + r, as a hardware adder makes it.
        up = r < t if bits == 32 else t + r >= 1 << bits
        return torch.where(up, hi, lo)
    raise ValueError(f"unknown rounding mode {mode!r}")


def encode(
    y: torch.Tensor,
    fmt: ElementFormat,
    rounding: Rounding = "nearest",
    random_bits: torch.Tensor | None = None,
    negative: torch.Tensor | None = None,
) -> torch.Tensor:
    """float32 values -> uint8 codes of ``fmt`` (same shape).

    rounding:
      nearest     round to the nearest value, ties to the even code (code LSB 0);
      stochastic  with a = |y| between neighbouring grid values lo <= a <= hi: exact if a is on
                  the grid, else t = floor((a - lo) / (hi - lo) * 2^32) and the result is hi
                  (away from zero) iff r < t, r being the element's 32-bit word in
                  ``random_bits`` (int64 tensor of uint32 values, same shape as y);
      stochastic16, stochastic8
                  t = floor((a - lo) / (hi - lo) * 2^b) with b = 16 / 8, and the result is hi
                  iff t + r >= 2^b (the carry out of adding the element's b-bit field r);
      zero        truncate toward zero (lo).

    Saturating: |y| beyond the largest finite value (including +-Inf) gives +-max finite.
    Signed zero: the sign bit is set for every strictly negative y, whatever its magnitude
    rounds to, so a negative value that rounds to zero encodes as negative zero (e2m1: -0.1 ->
    0x8, which decodes to -0.0), as Transformer Engine's reference, torchao and torch's float8
    casts do; -0.0 (and +0.0) encode as code 0. ``negative`` (bool, same shape) overrides which
    values are negative: a quantizer passes x < 0 for y = fp32(x * e), so that a negative x whose
    product underflows to -0.0 keeps its sign (docs/numerics.md 1). NaN gives the format's NaN
    code when it has one, else the code of +0 (the quantizer rejects non-finite input before it
    gets here).
    Exponent-only (unsigned) formats encode |y| clamped into [min_positive, max_finite]; the sign
    is dropped since they have none.
    """
    if rounding not in _ROUNDINGS:
        raise ValueError(f"rounding must be one of {_ROUNDINGS}, got {rounding!r}")
    y = y.to(torch.float32)
    nan = torch.isnan(y)
    a = torch.where(nan, torch.zeros_like(y), y.abs())
    if random_bits is not None and random_bits.shape != y.shape:
        raise ValueError(f"random_bits has shape {tuple(random_bits.shape)}, y {tuple(y.shape)}")
    if negative is not None and negative.shape != y.shape:
        raise ValueError(f"negative has shape {tuple(negative.shape)}, y {tuple(y.shape)}")
    mag = _round_magnitude(a, fmt, rounding, random_bits)
    if fmt.signed:
        neg = y < 0 if negative is None else negative.to(device=y.device, dtype=torch.bool)
        mag = mag | (neg.to(torch.int64) << (fmt.bits - 1))
    nc = nan_code(fmt)
    if nc is not None:
        mag = torch.where(nan, torch.full_like(mag, nc), mag)
    return mag.to(torch.uint8)


def encode_scale(
    d: torch.Tensor,
    fmt: ElementFormat,
    rounding: ScaleRoundingMode = "nearest",
    random_bits: torch.Tensor | None = None,
) -> torch.Tensor:
    """Round non-negative ideal scales ``d`` (float32) onto the grid of ``fmt``; returns codes.

    nearest: nearest value, ties to the even code; up: smallest grid value >= d; down: largest
    grid value <= d; stochastic: as ``encode``'s 32-bit stochastic rounding, with one word per
    scale in ``random_bits`` (same shape as d). Results are clamped to max finite;
    exponent-only formats also clamp up to their smallest value 2^-bias (they have no zero).
    Signed formats keep 0 for d == 0 and can give 0 or a subnormal for tiny d (no lower clamp,
    per the NVFP4 contract).
    """
    if rounding not in _SCALE_MODES:
        raise ValueError(f"scale rounding must be one of {_SCALE_MODES}, got {rounding!r}")
    d = d.to(torch.float32)
    return _round_magnitude(d.abs(), fmt, rounding, random_bits).to(torch.uint8)
