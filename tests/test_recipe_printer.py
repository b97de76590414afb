"""The canonical printer: parse(print(r)) == r for shipped and generated recipes."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fp4gen.dsl import load_recipe, parse_recipe, print_recipe
from fp4gen.dsl.model import (
    TE_SIGNS_16,
    Candidate,
    LayerRule,
    LayerSelector,
    Metric,
    MoRRef,
    MoRSpec,
    Operand,
    OperandSpec,
    OperandTable,
    Partition,
    Recipe,
    RecipeRef,
    RHTSpec,
    ScheduleRule,
)
from fp4gen.dsl.printer import _percent
from fp4gen.formats import (
    BUILTIN_FORMATS,
    HIGH_PRECISION_DTYPES,
    BlockFormat,
    ElementFormat,
    HighPrecision,
    ScaleSpec,
    global_scale_problem,
)

RECIPES = Path(__file__).resolve().parent.parent / "fp4gen" / "recipes"
SHIPPED = sorted(RECIPES.glob("*.fp4r"))


def round_trip(recipe: Recipe, base_dir: Path | None = None) -> Recipe:
    return parse_recipe(print_recipe(recipe), base_dir=base_dir or RECIPES)


@pytest.mark.parametrize("path", SHIPPED, ids=[p.stem for p in SHIPPED])
def test_shipped_recipes_round_trip(path: Path) -> None:
    recipe = load_recipe(path)
    text = print_recipe(recipe)
    assert "extends" not in text and "import" not in text  # self-contained
    again = parse_recipe(text, base_dir=path.parent)
    assert again == recipe
    assert print_recipe(again) == text  # printing is a fixed point


def test_canonical_text_of_nvfp4() -> None:
    text = print_recipe(load_recipe(RECIPES / "nvfp4.fp4r"))
    assert text.splitlines()[0].startswith('recipe nvfp4 "NVFP4 pretraining')
    assert text.split("\n\n")[1:] == [
        "operands {\n"
        "    fprop.activation : nvfp4 block 1x16 round nearest rht none\n"
        "    fprop.weight     : nvfp4 block 16x16 round nearest rht none\n"
        "    dgrad.gradient   : nvfp4 block 1x16 round stochastic8 rht none\n"
        "    dgrad.weight     : nvfp4 block 16x16 round nearest rht none\n"
        "    wgrad.gradient   : nvfp4 block 1x16 round stochastic8 rht 16 signs te\n"
        "    wgrad.activation : nvfp4 block 1x16 round nearest rht 16 signs te\n"
        "}",
        "layers {\n"
        "    first 2 blocks : bf16\n"
        "    last 8 blocks : bf16\n"
        '    match "*lm_head" : bf16\n'
        "}\n",
    ]


def test_formats_are_printed_in_full() -> None:
    text = "format x = mxfp4 block 1x64 round ocp\nformat h = fp16\noperands {\n * : x\n}\n"
    printed = print_recipe(parse_recipe(text))
    assert "format x = e2m1 block 1x64 scale ue8m0 round ocp global none\n" in printed
    assert "format h = fp16\n" in printed


def test_printer_rejects_a_format_missing_from_the_recipe() -> None:
    stray = BlockFormat("stray", ElementFormat(3, 2), (1, 8), ScaleSpec(None))
    recipe = Recipe("r", "", (), OperandTable.uniform(OperandSpec(stray)))
    with pytest.raises(ValueError, match="stray"):
        print_recipe(recipe)
    recipe = Recipe("r", "", (), OperandTable.uniform(OperandSpec(MoRRef("m"))))
    with pytest.raises(ValueError, match="mor m"):
        print_recipe(recipe)


@pytest.mark.parametrize("text", ["4.5", "0.015", "33.3333", "99.99", "1e-7", "12.345678901234"])
def test_percentages_read_back_exactly(text: str) -> None:
    fraction = float(text) / 100
    printed = _percent(fraction)
    assert float(printed[:-1]) / 100 == fraction


# ------------------------------------------------------------------------------------------------
# Generated recipes
# ------------------------------------------------------------------------------------------------

FORMAT_NAMES = ["f_a", "f_b", "up", "none", "nvfp4", "mxfp4", "mxfp8_e5m2"]
MOR_NAMES = ["m1", "tensor_e4m3", "block"]
BLOCK_LENGTHS = [1, 8, 16, 24, 32, 64, 128]


@st.composite
def elements(draw: st.DrawFn) -> ElementFormat:
    exp_bits = draw(st.integers(1, 7))
    man_bits = draw(st.integers(max(0, 2 - exp_bits), 7 - exp_bits))
    specials = ["finite", "fn"] + (["ieee"] if man_bits else [])
    return ElementFormat(exp_bits, man_bits, True, draw(st.sampled_from(specials)))


@st.composite
def scales(draw: st.DrawFn) -> ScaleSpec:
    kind = draw(st.sampled_from(["fp32", "signed", "unsigned"]))
    if kind == "fp32":
        return ScaleSpec(None)
    if kind == "signed":
        return ScaleSpec(draw(elements()), draw(st.sampled_from(["nearest", "up", "down"])))
    element = ElementFormat(draw(st.integers(2, 8)), 0, signed=False)
    return ScaleSpec(element, draw(st.sampled_from(["nearest", "up", "down", "ocp"])))


@st.composite
def shapes(draw: st.DrawFn, two_d: bool = True) -> tuple[int, int]:
    n = draw(st.sampled_from(BLOCK_LENGTHS))
    return (n, n) if two_d and draw(st.booleans()) else (1, n)


@st.composite
def formats(draw: st.DrawFn, name: str) -> BlockFormat | HighPrecision:
    if draw(st.integers(0, 4)) == 0:
        return HighPrecision(draw(st.sampled_from(HIGH_PRECISION_DTYPES)))
    scale = draw(scales())
    element = draw(elements())
    # only where a global scale can work (ue8m0 or fp32 scales take none)
    global_scale = global_scale_problem(element, scale.element) is None and draw(st.booleans())
    return BlockFormat(name, element, draw(shapes()), scale, global_scale)


@st.composite
def percent_fractions(draw: st.DrawFn, upper: int) -> float:
    # Values as the parser makes them: a decimal percentage divided by 100.
    hundredths = draw(st.integers(1, upper * 100 - 1))
    return float(f"{hundredths // 100}.{hundredths % 100:02d}") / 100


@st.composite
def rhts(draw: st.DrawFn) -> RHTSpec:
    size = 2 ** draw(st.integers(1, 8))
    source = draw(st.sampled_from(["fixed", "seeded", "none"]))
    if source == "seeded":
        return RHTSpec(size, "seeded", None, draw(st.integers(0, 2**64 - 1)))
    if source == "none":
        return RHTSpec(size, "none", None)
    if size == 16 and draw(st.booleans()):
        return RHTSpec(16, "fixed", TE_SIGNS_16)
    signs = draw(st.lists(st.sampled_from([1, -1]), min_size=size, max_size=size))
    return RHTSpec(size, "fixed", tuple(signs))


@st.composite
def mors(draw: st.DrawFn, name: str) -> MoRSpec:
    def partition() -> Partition:
        kind = draw(st.sampled_from(["tensor", "channel", "block"]))
        return Partition("block", draw(shapes())) if kind == "block" else Partition(kind)  # type: ignore[arg-type]

    candidates = []
    for _ in range(draw(st.integers(1, 3))):
        element = draw(elements())
        kind = draw(st.sampled_from(["relerr", "relerr_vs", "range"]))
        if kind == "relerr":
            metric = Metric("relerr", threshold=draw(percent_fractions(100)))
        elif kind == "relerr_vs":
            metric = Metric("relerr_vs", versus=draw(elements()))
        else:
            metric = Metric("range")
        candidates.append(Candidate(element, metric))
    fallback = draw(
        st.one_of(elements(), st.sampled_from(HIGH_PRECISION_DTYPES).map(HighPrecision))
    )
    candidates.append(Candidate(fallback))
    scaling = draw(st.sampled_from(["gam", "e8m0", "amax"]))
    return MoRSpec(name, partition(), partition(), scaling, tuple(candidates))  # type: ignore[arg-type]


def nests(fmt: object, rht: RHTSpec) -> bool:
    if isinstance(fmt, HighPrecision):
        return False
    if isinstance(fmt, BlockFormat):
        return fmt.block_len % rht.size == 0 or rht.size % fmt.block_len == 0
    return True


@st.composite
def recipes(draw: st.DrawFn) -> Recipe:
    names = draw(st.lists(st.sampled_from(FORMAT_NAMES), unique=True, max_size=3))
    defined = [(n, draw(formats(n))) for n in names]
    defined = [(n, f) for n, f in defined if BUILTIN_FORMATS.get(n) != f]
    scope = {**BUILTIN_FORMATS, **dict(defined)}
    mor_specs = [
        draw(mors(n)) for n in draw(st.lists(st.sampled_from(MOR_NAMES), unique=True, max_size=2))
    ]
    choices: list[object] = [f for f in scope.values() if isinstance(f, BlockFormat)]
    choices += [HighPrecision(d) for d in HIGH_PRECISION_DTYPES]
    choices += [MoRRef(m.name) for m in mor_specs]

    specs: dict[Operand, OperandSpec] = {}
    for op in Operand:
        fmt = draw(st.sampled_from(choices))
        rounding = "nearest"
        if isinstance(fmt, BlockFormat):
            weight = op.role == "weight"
            if not weight and fmt.is_2d or draw(st.booleans()):
                fmt = fmt.with_block(draw(shapes(two_d=weight)))
        if not isinstance(fmt, HighPrecision):
            rounding = draw(st.sampled_from(["nearest", "stochastic", "zero"]))
        specs[op] = OperandSpec(fmt, rounding)  # type: ignore[arg-type]
    for gemm in ("fprop", "dgrad", "wgrad"):
        pair = [op for op in Operand if op.gemm == gemm]
        rht = draw(st.one_of(st.none(), rhts()))
        if rht is not None and all(nests(specs[op].format, rht) for op in pair):
            for op in pair:
                specs[op] = OperandSpec(specs[op].format, specs[op].rounding, rht)

    actions = st.one_of(
        # a rule's format applies to activations too: no 2D blocks (the parser refuses them)
        st.sampled_from([f for f in scope.values() if not getattr(f, "is_2d", False)]),
        st.just(RecipeRef("mxfp8.fp4r")),
    ).map(lambda f: HighPrecision(f.name) if isinstance(f, HighPrecision) else f)
    selectors = st.one_of(
        st.builds(
            LayerSelector,
            kind=st.sampled_from(["first", "last"]),
            unit=st.sampled_from(["layers", "blocks"]),
            count=st.integers(1, 200),
        ),
        st.builds(
            LayerSelector,
            kind=st.sampled_from(["first", "last"]),
            unit=st.sampled_from(["layers", "blocks"]),
            fraction=percent_fractions(100) | st.just(1.0),
        ),
        st.builds(LayerSelector, kind=st.just("match"), pattern=st.text(min_size=1, max_size=12)),
    )
    layers = draw(st.lists(st.builds(LayerRule, selectors, actions), max_size=3))
    points = st.one_of(
        st.tuples(st.integers(0, 10**9), st.none()), st.tuples(st.none(), percent_fractions(100))
    )
    schedule = [
        ScheduleRule(step, fraction, draw(st.sampled_from(["forward", "backward", "both"])), act)
        for (step, fraction), act in draw(st.lists(st.tuples(points, actions), max_size=2))
    ]
    return Recipe(
        name=draw(st.text(min_size=1, max_size=16)),
        description=draw(st.text(max_size=24)),
        formats=tuple(defined),
        operands=OperandTable(**{op.name.lower(): spec for op, spec in specs.items()}),
        mors=tuple(mor_specs),
        layers=tuple(layers),
        schedule=tuple(schedule),
        evaluation=draw(st.none() | actions),
    )


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(recipes())
def test_generated_recipes_round_trip(recipe: Recipe) -> None:
    text = print_recipe(recipe)
    assert parse_recipe(text) == recipe, text
    assert print_recipe(parse_recipe(text)) == text
