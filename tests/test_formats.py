"""Format descriptions: derived constants agree with the decoded grid for every format."""

from __future__ import annotations

import math

import pytest

from fp4gen.formats import (
    BUILTIN_FORMATS,
    E2M1,
    E2M3,
    E3M2,
    E4M3,
    E5M2,
    SPECIALS,
    UE8M0,
    BlockFormat,
    ElementFormat,
    ScaleSpec,
    parse_element_name,
)
from fp4gen.numerics.minifloat import grid_values


def all_formats() -> list[ElementFormat]:
    out = []
    for bits in range(3, 9):
        for exp_bits in range(1, bits):
            man_bits = bits - 1 - exp_bits
            for special in SPECIALS:
                if special == "ieee" and man_bits == 0:
                    continue  # ieee needs a mantissa for NaN
                out.append(ElementFormat(exp_bits, man_bits, True, special))  # type: ignore[arg-type]
    out += [ElementFormat(e, 0, signed=False) for e in range(2, 9)]
    return out


@pytest.mark.parametrize("fmt", all_formats(), ids=lambda f: f.name.replace(" ", "_"))
def test_max_finite_and_emax_match_grid(fmt: ElementFormat) -> None:
    grid = grid_values(fmt)
    assert fmt.max_finite == float(grid[-1])
    assert fmt.emax == math.frexp(float(grid[-1]))[1] - 1
    assert fmt.min_positive == float(grid[0] if fmt.exponent_only else grid[1])


@pytest.mark.parametrize(
    ("fmt", "max_finite", "emax", "min_positive"),
    [
        (E2M1, 6.0, 2, 0.5),
        (E2M3, 7.5, 2, 0.125),
        (E3M2, 28.0, 4, 0.0625),
        (E4M3, 448.0, 8, 2.0**-9),
        (E5M2, 57344.0, 15, 2.0**-16),
        (UE8M0, 2.0**127, 127, 2.0**-127),
    ],
)
def test_named_constants(fmt: ElementFormat, max_finite: float, emax: int, min_positive: float):
    assert (fmt.max_finite, fmt.emax, fmt.min_positive) == (max_finite, emax, min_positive)


def test_names_round_trip() -> None:
    for fmt in all_formats():
        base, *special = fmt.name.split()
        assert parse_element_name(base, special[0] if special else None) == fmt


def test_bad_element_names() -> None:
    with pytest.raises(ValueError, match="3 to 8 bits"):
        parse_element_name("e6m3")
    with pytest.raises(ValueError, match="exponent-only"):
        parse_element_name("ue4m3")
    with pytest.raises(ValueError, match="not an element format name"):
        parse_element_name("fp8")


def test_bf16_exactness_of_block_products() -> None:
    """Numerics contract section 8: element x scale significands fit bf16's 8 bits."""
    exact = {
        n: f.gemm_exact_in_bf16() for n, f in BUILTIN_FORMATS.items() if isinstance(f, BlockFormat)
    }
    assert exact == {
        "nvfp4": True,  # 2 + 4 bits
        "mxfp4": True,  # 2 + 1
        "mxfp6_e2m3": True,  # 4 + 1
        "mxfp6_e3m2": True,  # 3 + 1
        "mxfp8_e4m3": True,  # 4 + 1
        "mxfp8_e5m2": True,  # 3 + 1
    }
    fp32_scaled = BlockFormat("fp8_block", E4M3, (1, 128), ScaleSpec())
    assert not fp32_scaled.gemm_exact_in_bf16()  # fp32 scales carry 24 bits
