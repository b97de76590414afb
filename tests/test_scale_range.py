"""Two-level (global amax) scaling with every element and scale format the grammar allows:
refused at the recipe's line and column where the global scale cannot work, otherwise every
scale finite and every element within its format's rounding (docs/numerics.md, section 2.1)."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch

import fp4gen
from fp4gen.cli import main
from fp4gen.dsl import load_recipe
from fp4gen.errors import ArgumentError, FP4GenError, RecipeError
from fp4gen.formats import (
    BUILTIN_FORMATS,
    FLT_MAX,
    BlockFormat,
    ElementFormat,
    ScaleSpec,
    global_scale_problem,
)
from fp4gen.numerics.quantize import quantize

REPRODUCER = "format f = e4m3 block 1x16 scale ue8m0 round nearest global amax\n"
OPS = "operands {\n    * : f\n}\n"
AMAXES = (1e-6, 3.1e-3, 1.0, 700.0, 1e6)
FLT_MIN_NORMAL = 2.0**-126
FP32_SLACK = 2.0**-20  # a few fp32 roundings on the way of S_enc, S_dec, d_b and e_b


def _signed_formats() -> list[ElementFormat]:
    """Every signed eXmY the grammar takes: 3 to 8 bits, each special-value convention."""
    out = []
    for exp_bits in range(1, 8):
        for man_bits in range(0, 8 - exp_bits):
            if not 3 <= 1 + exp_bits + man_bits <= 8:
                continue
            for special in ("finite", "fn", "ieee"):
                if special != "ieee" or man_bits:
                    out.append(ElementFormat(exp_bits, man_bits, True, special))  # type: ignore[arg-type]
    return out


ELEMENTS = _signed_formats()
SCALES: list[ElementFormat | None] = [
    *ELEMENTS,
    *(ElementFormat(e, 0, signed=False) for e in range(2, 9)),
    None,  # fp32
]


def _scale_name(scale: ElementFormat | None) -> str:
    return "fp32" if scale is None else scale.name


def _roundings(scale: ElementFormat | None) -> list[str]:
    if scale is None:
        return ["nearest"]
    return ["nearest", "up", "down"] + (["ocp"] if scale.exponent_only else [])


def _grid(fmt: ElementFormat) -> torch.Tensor:
    """The format's finite non-negative values, ascending, float64."""
    n = 1 << (fmt.bits if fmt.exponent_only else fmt.bits - 1)
    values = {fmt.value(c) for c in range(n)}
    return torch.tensor(sorted(v for v in values if math.isfinite(v)), dtype=torch.float64)


# ----------------------------------------------------------------------------------------------
# Refusals: the recipe, the command line and the Python API
# ----------------------------------------------------------------------------------------------


def test_the_reproducer_is_refused_at_its_line_and_column() -> None:
    with pytest.raises(RecipeError) as info:
        load_recipe("# a wide scale with a global scale\n" + REPRODUCER + OPS)
    err = info.value
    assert (err.line, err.column) == (2, 61)  # the `amax` of `global amax`
    assert "ue8m0 scale spans 2^-127 to 2^127" in err.reason
    assert "S_dec = amax / (448 * 2^127) subnormal for every amax below 896" in err.reason
    assert err.reason.endswith("write global none")


def test_check_exits_1_with_the_position(tmp_path: Path, capsys) -> None:
    path = tmp_path / "wide.fp4r"
    path.write_text(REPRODUCER + OPS)
    assert main(["check", str(path)]) == 1
    err = capsys.readouterr().err
    assert f"{path}:1:61: global amax cannot be used with e4m3 elements with ue8m0" in err
    assert "Traceback" not in err


@pytest.mark.parametrize(
    ("text", "token", "phrase"),
    [
        # a scale clause that breaks an inherited global scale: the error is at the scale
        ("format f = nvfp4 scale ue8m0\n", "ue8m0", "e2m1 elements with ue8m0 block scales"),
        ("format f = mxfp8_e4m3 global amax\n", "amax", "a ue8m0 scale spans"),
        ("format f = e7m0 block 1x16 scale e7m0 global amax\n", "amax", "2^64 * 2^64 = 2^128"),
        ("format f = e1m1 ieee block 1x16 scale ue2m0 global amax\n", "amax", "is below 4"),
        ("format f = e4m3 block 1x128 scale fp32 global amax\n", "amax", "fp32 block scales"),
    ],
)
def test_other_refusals_name_their_clause(text: str, token: str, phrase: str) -> None:
    with pytest.raises(RecipeError) as info:
        load_recipe(text + OPS)
    assert (info.value.line, info.value.column) == (1, text.index(token) + 1)
    assert phrase in info.value.reason


def test_formats_built_in_python_meet_the_same_rule() -> None:
    e4m3 = BUILTIN_FORMATS["mxfp8_e4m3"]
    assert isinstance(e4m3, BlockFormat)
    reason = global_scale_problem(e4m3.element, e4m3.scale.element)
    assert reason is not None
    with pytest.raises(ArgumentError) as info:
        replace(e4m3, global_scale=True)
    assert str(info.value) == f"format mxfp8_e4m3: {reason}"
    assert isinstance(info.value, FP4GenError) and isinstance(info.value, ValueError)
    with pytest.raises(ArgumentError, match="fp32 block scales hold any fp32 value"):
        BlockFormat("fp8", e4m3.element, (1, 128), ScaleSpec(None), True)
    # the same formats without a global scale stay valid
    assert not replace(e4m3, global_scale=False).global_scale


@pytest.mark.parametrize("element", ELEMENTS, ids=lambda e: e.name.replace(" ", "_"))
def test_every_pair_is_refused_at_its_column_or_parses(element: ElementFormat) -> None:
    """One recipe per element with every scale it takes a global scale with (the parser
    builds each), and each refused pair alone, refused at `amax`."""
    accepted = [s for s in SCALES if global_scale_problem(element, s) is None]
    lines = [
        f"format f{i} = {element.name} block 1x16 scale {_scale_name(s)} global amax"
        for i, s in enumerate(accepted)
    ]
    recipe = load_recipe("\n".join(lines) + "\noperands {\n    * : nvfp4\n}\n")
    built = dict(recipe.formats)
    for i, scale in enumerate(accepted):
        fmt = built[f"f{i}"]
        assert isinstance(fmt, BlockFormat) and fmt.global_scale
        assert (fmt.element, fmt.scale.element) == (element, scale)
    for scale in SCALES:
        reason = global_scale_problem(element, scale)
        if reason is None:
            continue
        head = f"format f = {element.name} block 1x16 scale {_scale_name(scale)} global "
        with pytest.raises(RecipeError) as info:
            load_recipe(head + "amax\n" + OPS)
        assert (info.value.line, info.value.column) == (1, len(head) + 1)
        if scale is not None:  # fp32 scales keep the parser's own wording
            assert info.value.reason == reason


def test_which_pairs_are_refused() -> None:
    """ue8m0 and fp32 scales always; otherwise only where elem_max * scale_max leaves
    [4, FLT_MAX]: one overflowing pair (e7m0 x e7m0) and pairs of formats whose maxima are
    below 4."""
    ue8m0 = ElementFormat(8, 0, signed=False)
    for element in ELEMENTS:
        assert global_scale_problem(element, ue8m0) is not None
        assert global_scale_problem(element, None) is not None
        for scale in ELEMENTS + [ElementFormat(e, 0, signed=False) for e in range(2, 8)]:
            product = element.max_finite * scale.max_finite
            refused = global_scale_problem(element, scale) is not None
            assert refused == (product > FLT_MAX or product < 4 * (1 - 2.0**-24)), (
                element.name,
                scale.name,
            )
    for name in ("nvfp4",):  # the shipped two-level format stays valid
        fmt = BUILTIN_FORMATS[name]
        assert isinstance(fmt, BlockFormat) and fmt.global_scale


# ----------------------------------------------------------------------------------------------
# Accepted pairs: finite scales and bounded errors for amaxes from 1e-6 to 1e6 (and beyond)
# ----------------------------------------------------------------------------------------------


def _tensor(amax: float) -> torch.Tensor:
    """[2, 64] in 1x16 blocks, each block holding +-amax once (so every block is a block of
    the tensor's amax) and values in (-amax, amax) elsewhere."""
    g = torch.Generator().manual_seed(5)
    u = torch.rand(2, 64, generator=g, dtype=torch.float64) * 2 - 1
    u[:, ::16] = torch.tensor([1.0, -1.0, 1.0, -1.0]).repeat(2, 1)
    return (u * amax).to(torch.float32)


def _max_step(grid: torch.Tensor, below: float) -> float:
    """The largest relative step 1 - g_i / g_{i+1} between neighbours of the grid up to
    ``below`` (a scale one grid step under its ideal value saturates by that much)."""
    pos = grid[(grid > 0) & (grid <= below)]
    if pos.numel() < 2:
        return 1.0  # the next value down is 0
    return float((1 - pos[:-1] / pos[1:]).max())


def _check(fmt: BlockFormat, amax: float) -> None:
    x = _tensor(amax)
    q = quantize(x, fmt)
    s_dec = float(q.global_scale)
    elem_max, scale_max = fmt.element.max_finite, fmt.scale.max_value
    product = elem_max * scale_max
    in_band = amax >= product * FLT_MIN_NORMAL  # S_enc <= 2^126: S_dec is a normal fp32
    where = f"{fmt.element.name} / {fmt.scale.name} {fmt.scale.rounding} at amax {amax:g}"
    # S_enc <= FLT_MAX keeps S_dec >= 2^-128 (22 significant bits) for every amax
    assert math.isfinite(s_dec) and s_dec >= 2.0**-128, where
    assert s_dec >= FLT_MIN_NORMAL or not in_band, where
    assert bool(torch.isfinite(q.scales).all()) and float(q.scales.max()) <= scale_max, where
    assert bool(torch.isfinite(q.encode_scales).all()), where
    assert bool(torch.isfinite(q.dequantize()).all()), where
    if amax < elem_max * FLT_MIN_NORMAL:
        return  # the decode step amax / elem_max is itself subnormal: fp32's limit, any format

    # every element: the element grid's rounding at its scaled value, plus what saturates
    step = q.block_values(q.scales).double() * s_dec  # s_b * S_dec per element
    y = x.double().abs() / step
    grid = _grid(fmt.element)
    hi_i = torch.searchsorted(grid, y.clamp(max=elem_max)).clamp(max=grid.numel() - 1)
    lo_i = (hi_i - 1).clamp(min=0)
    half_gap = (grid[hi_i] - grid[lo_i]) / 2
    saturated = (x.double().abs() - elem_max * step).clamp(min=0)
    err = (q.dequantize().double() - x.double()).abs()
    allowed = half_gap * step + saturated + FP32_SLACK * x.double().abs() + 2.0**-148
    assert bool((err <= allowed).all()), (where, float((err - allowed).max()))

    # what saturates: nothing beyond fp32 slack where the largest block lands on scale_max
    # (nearest, up); at most one step of the scale grid otherwise
    assert fmt.scale.element is not None
    scale_grid = _grid(fmt.scale.element)
    if in_band and fmt.scale.rounding in ("nearest", "up"):
        bound = FP32_SLACK
    elif in_band:  # down and ocp may take the grid value below scale_max
        bound = _max_step(scale_grid, scale_max)
    else:  # S_enc capped at FLT_MAX: the largest block's scale is rounded from below the max
        bound = _max_step(scale_grid, scale_max)
    assert float(saturated.max()) <= bound * amax, where


def _accepted(elements: list[ElementFormat]) -> list[BlockFormat]:
    out = []
    for element in elements:
        for scale in SCALES:
            if global_scale_problem(element, scale) is None:
                for rounding in _roundings(scale):
                    spec = ScaleSpec(scale, rounding)  # type: ignore[arg-type]
                    out.append(BlockFormat("f", element, (1, 16), spec, True))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("element", ELEMENTS, ids=lambda e: e.name.replace(" ", "_"))
def test_every_accepted_pair_quantizes_within_its_bound(element: ElementFormat) -> None:
    for fmt in _accepted([element]):
        for amax in AMAXES:
            _check(fmt, amax)


@pytest.mark.parametrize(
    "fmt",
    _accepted([ElementFormat(2, 1), ElementFormat(4, 3, special="fn"), ElementFormat(7, 0)]),
    ids=lambda f: f"{f.element.name}-{f.scale.name}-{f.scale.rounding}".replace(" ", "_"),
)
def test_accepted_pairs_of_three_elements_quantize_within_their_bound(fmt: BlockFormat) -> None:
    """The quick subset of the sweep above: e2m1, e4m3 and e7m0 (the widest element, where
    S_enc is capped for ordinary amaxes with the widest scales) with every scale."""
    for amax in AMAXES:
        _check(fmt, amax)


@pytest.mark.parametrize(
    "amax", [1e-37, 1e-35, 1e-30, 1e-12, 1e12, 1e30, 1e36, 3.4e38], ids=lambda a: f"{a:g}"
)
@pytest.mark.parametrize(
    "fmt",
    [
        BUILTIN_FORMATS["nvfp4"],
        fp4gen.load_recipe("exotic_e3m2_b8").formats[0][1],
        BlockFormat(
            "e5m2_ue7m0",
            ElementFormat(5, 2, special="ieee"),
            (1, 16),
            ScaleSpec(ElementFormat(7, 0, signed=False), "up"),
            True,
        ),
    ],
    ids=lambda f: f.name,
)
def test_tiny_and_huge_amaxes_keep_every_scale_finite(fmt: BlockFormat, amax: float) -> None:
    """From amaxes where S_enc is capped at FLT_MAX (S_dec subnormal, 2^-128 at the least) to
    fp32's largest values."""
    if fmt.block != (1, 16):
        fmt = fmt.with_block((1, 16))
    _check(fmt, amax)


def test_the_reproducer_without_a_global_scale_keeps_its_amax() -> None:
    """What the refusal says to write instead: ue8m0 scales alone reach an amax of 62 (the
    global scale made it 0.875). Rounded to nearest, 62 / 448 takes the scale 2^-3 and the
    block saturates at 448 * 2^-3 = 56, one scale step, as it does for any amax; rounded up
    (the default for ue8m0) it takes 2^-2 and decodes to 64, e4m3's rounding of 248."""
    want = {"nearest": 56.0, "up": 64.0}
    for rounding, top in want.items():
        text = REPRODUCER.replace("global amax", "global none").replace("nearest", rounding)
        fmt = load_recipe(text + OPS).formats[0][1]
        assert isinstance(fmt, BlockFormat) and not fmt.global_scale
        q = quantize(_tensor(62.0), fmt)
        assert float(q.global_scale) == 1.0
        got = q.dequantize()[:, ::16].abs()
        assert torch.equal(got, torch.full_like(got, top)), rounding
