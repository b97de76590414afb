"""The recipe parser: shipped recipes, the operand cascade, extends, import and formats."""

from __future__ import annotations

from pathlib import Path

import pytest

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
    Partition,
    Recipe,
    RecipeRef,
    RHTSpec,
    ScheduleRule,
)
from fp4gen.formats import (
    BUILTIN_FORMATS,
    E2M1,
    E3M2,
    E4M3,
    E5M2,
    UE8M0,
    BlockFormat,
    ElementFormat,
    HighPrecision,
    ScaleSpec,
)

RECIPES = Path(__file__).resolve().parent.parent / "fp4gen" / "recipes"
SHIPPED = sorted(RECIPES.glob("*.fp4r"))
NVFP4 = BUILTIN_FORMATS["nvfp4"]
MXFP4 = BUILTIN_FORMATS["mxfp4"]
BF16 = HighPrecision("bf16")
TE16 = RHTSpec(16, "fixed", TE_SIGNS_16)

W, A, G = "weight", "activation", "gradient"
FA, FW = Operand.FPROP_ACTIVATION, Operand.FPROP_WEIGHT
DG, DW = Operand.DGRAD_GRADIENT, Operand.DGRAD_WEIGHT
WG, WA = Operand.WGRAD_GRADIENT, Operand.WGRAD_ACTIVATION


def shipped(name: str) -> Recipe:
    return load_recipe(RECIPES / f"{name}.fp4r")


def ops(text: str) -> str:
    return "operands {\n" + text + "\n}\n"


# ------------------------------------------------------------------------------------------------
# Shipped recipes
# ------------------------------------------------------------------------------------------------


def test_the_expected_recipes_are_shipped() -> None:
    assert {p.stem for p in SHIPPED} >= {
        "nvfp4", "nvfp4_no_sr", "nvfp4_no_rht", "nvfp4_1d_weights", "nvfp4_fewer_bf16",
        "nvfp4_no_bf16", "mxfp4",
        "mxfp8", "fp8_blockwise", "mor_tensor", "mor_subtensor_2way", "mor_subtensor_3way",
        "exotic_e3m2_b8",
    }  # fmt: skip


@pytest.mark.parametrize("path", SHIPPED, ids=[p.stem for p in SHIPPED])
def test_shipped_recipe_parses(path: Path) -> None:
    text = path.read_text()
    assert text.startswith("# "), "each shipped recipe starts with a comment saying what it is"
    recipe = load_recipe(path)
    assert recipe.name == path.stem
    assert recipe.description
    assert recipe.source == path.resolve()
    for _, spec in recipe.operands.items():
        assert isinstance(spec.format, BlockFormat | HighPrecision | MoRRef)


def test_nvfp4_full_method() -> None:
    r = shipped("nvfp4")
    t = r.operands
    for op in Operand:
        fmt = t[op].format
        assert isinstance(fmt, BlockFormat)
        assert (fmt.name, fmt.element, fmt.scale, fmt.global_scale) == (
            "nvfp4", E2M1, ScaleSpec(E4M3, "nearest"), True,
        )  # fmt: skip
    # 2D 16x16 weights (both copies), 1x16 activations and gradients
    assert t[FW].format == NVFP4.with_block((16, 16)) == t[DW].format
    assert t[FA].format.block == t[DG].format.block == (1, 16)  # type: ignore[union-attr]
    assert t[WG].format == t[WA].format == NVFP4
    # stochastic rounding (8 random bits per value) on both gradient copies only
    assert [t[op].rounding for op in Operand] == [
        "nearest", "nearest", "stochastic8", "nearest", "stochastic8", "nearest",
    ]  # fmt: skip
    # RHT 16 with TE's signs on the wgrad inputs only
    assert t[WG] == OperandSpec(NVFP4, "stochastic8", TE16)
    assert t[WA] == OperandSpec(NVFP4, "nearest", TE16)
    assert t[WG].rht.signs == (1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1)  # type: ignore[union-attr]
    assert t[FA].rht is t[FW].rht is t[DG].rht is t[DW].rht is None
    # the 12B setup: first 2 and last 8 blocks in BF16, and the output head
    assert r.layers == (
        LayerRule(LayerSelector("first", "blocks", count=2), BF16),
        LayerRule(LayerSelector("last", "blocks", count=8), BF16),
        LayerRule(LayerSelector("match", pattern="*lm_head"), BF16),
    )
    assert r.formats == () and r.mors == () and r.schedule == ()


def test_nvfp4_ablations_change_one_thing() -> None:
    full = shipped("nvfp4")
    no_sr = shipped("nvfp4_no_sr")
    assert [s.rounding for _, s in no_sr.operands.items()] == ["nearest"] * 6
    assert no_sr.operands[WG].rht == TE16 and no_sr.layers == full.layers

    no_rht = shipped("nvfp4_no_rht")
    assert all(s.rht is None for _, s in no_rht.operands.items())
    assert no_rht.operands[WG].rounding == "stochastic8"

    one_d = shipped("nvfp4_1d_weights")
    assert one_d.operands[FW].format == one_d.operands[DW].format == NVFP4
    assert one_d.operands[WA] == full.operands[WA] and one_d.layers == full.layers

    switch = shipped("nvfp4_bf16_switch")
    assert switch.operands == full.operands
    assert switch.schedule == (ScheduleRule(None, 0.82, "forward", BF16),)


def test_mxfp4() -> None:
    r = shipped("mxfp4")
    assert BlockFormat("mxfp4", E2M1, (1, 32), ScaleSpec(UE8M0, "up")) == MXFP4
    assert all(s.format == MXFP4 for _, s in r.operands.items())
    rht = RHTSpec(32, "seeded", None, 0)
    assert r.operands[WG] == OperandSpec(MXFP4, "stochastic", rht)
    assert r.operands[WA] == OperandSpec(MXFP4, "nearest", rht)
    assert r.operands[DG] == OperandSpec(MXFP4, "stochastic", None)
    assert r.layers[0] == LayerRule(LayerSelector("last", "blocks", count=8), BF16)


def test_mxfp8() -> None:
    r = shipped("mxfp8")
    fmt = BlockFormat("mxfp8_e4m3", E4M3, (1, 32), ScaleSpec(UE8M0, "up"))
    assert r.operands == r.operands.uniform(OperandSpec(fmt))


def test_fp8_blockwise() -> None:
    r = shipped("fp8_blockwise")
    fmt = BlockFormat("fp8_block", E4M3, (1, 128), ScaleSpec(None, "nearest"), False)
    assert r.formats == (("fp8_block", fmt),)
    assert r.operands[FW].format == r.operands[DW].format == fmt.with_block((128, 128))
    for op in (FA, DG, WG, WA):
        assert r.operands[op] == OperandSpec(fmt)


def test_mor_tensor() -> None:
    r = shipped("mor_tensor")
    assert r.mors == (
        MoRSpec(
            name="tensor_e4m3",
            decide=Partition("tensor"),
            scale=Partition("block", (128, 128)),
            scaling="gam",
            candidates=(Candidate(E4M3, Metric("relerr", threshold=0.045)), Candidate(BF16)),
        ),
    )
    assert r.operands == r.operands.uniform(OperandSpec(MoRRef("tensor_e4m3")))
    assert r.mor("tensor_e4m3").candidates[0].metric.threshold == pytest.approx(0.045)  # type: ignore[union-attr]


def test_mor_subtensor() -> None:
    two = shipped("mor_subtensor_2way").mors[0]
    assert two.decide == two.scale == Partition("block", (128, 128))
    assert two.candidates == (Candidate(E4M3, Metric("relerr_vs", versus=E5M2)), Candidate(BF16))
    three = shipped("mor_subtensor_3way").mors[0]
    assert three.candidates == (
        Candidate(E4M3, Metric("relerr_vs", versus=E5M2)),
        Candidate(E5M2, Metric("range")),
        Candidate(BF16),
    )
    assert shipped("mor_subtensor_3way").operands[WG].format == MoRRef(three.name)


def test_exotic_format() -> None:
    r = shipped("exotic_e3m2_b8")
    fmt = BlockFormat("e3m2_b8", E3M2, (1, 8), ScaleSpec(E4M3, "nearest"), True)
    assert r.formats == (("e3m2_b8", fmt),)
    assert r.operands[FA] == OperandSpec(fmt)
    assert r.operands[DG] == OperandSpec(fmt, "stochastic")
    assert fmt.element.max_finite == 28.0


# ------------------------------------------------------------------------------------------------
# The operand cascade
# ------------------------------------------------------------------------------------------------


def test_later_statements_override_earlier_ones() -> None:
    r = parse_recipe(
        ops("* : nvfp4\nwgrad : mxfp4\nwgrad.gradient : round zero\n* : round stochastic")
    )
    t = r.operands
    assert t[FA] == OperandSpec(NVFP4, "stochastic")
    assert t[WA] == OperandSpec(MXFP4, "stochastic")
    assert t[WG] == OperandSpec(MXFP4, "stochastic")  # the later `*` wins over wgrad.gradient


def test_selectors_cover_the_right_slots() -> None:
    text = ops("* : bf16\nweight : nvfp4\ndgrad : fp16\nwgrad.activation : fp32")
    t = parse_recipe(text).operands
    assert t[FA].format == BF16 and t[WG].format == BF16
    assert t[FW].format == NVFP4
    assert t[DG].format == t[DW].format == HighPrecision("fp16")  # dgrad overrides dgrad.weight
    assert t[WA].format == HighPrecision("fp32")


def test_block_override_belongs_to_its_format() -> None:
    # A statement that names a new format drops an earlier block override...
    t = parse_recipe(ops("* : nvfp4\nweight : block 16x16\nfprop.weight : mxfp4")).operands
    assert t[FW].format == MXFP4 and t[DW].format == NVFP4.with_block((16, 16))
    # ...unless it gives one itself; rounding and RHT do carry over.
    text = ops("* : nvfp4 round stochastic\nweight : mxfp4 block 32x32")
    t = parse_recipe(text).operands
    assert t[FW] == OperandSpec(MXFP4.with_block((32, 32)), "stochastic")


def test_builtin_formats_and_derived_formats() -> None:
    text = (
        "format mx_e4 = mxfp4 scale e4m3\n"  # a new scale brings its own default rounding
        "format mx_ocp = mxfp4 round ocp\n"
        "format tiny = e2m1 fn block 1x8 scale ue5m0\n"
        "format hp = bf16\n"
        + ops("* : mx_e4\nfprop.weight : mx_ocp\ndgrad.weight : tiny\nwgrad : hp")
    )
    r = parse_recipe(text)
    mx_e4 = BlockFormat("mx_e4", E2M1, (1, 32), ScaleSpec(E4M3, "nearest"))
    mx_ocp = BlockFormat("mx_ocp", E2M1, (1, 32), ScaleSpec(UE8M0, "ocp"))
    tiny = BlockFormat(
        "tiny",
        ElementFormat(2, 1, special="fn"),
        (1, 8),
        ScaleSpec(ElementFormat(5, 0, False), "up"),
    )
    assert r.formats == (("mx_e4", mx_e4), ("mx_ocp", mx_ocp), ("tiny", tiny), ("hp", BF16))
    assert r.operands[FA].format == mx_e4
    assert r.operands[FW].format == mx_ocp
    assert r.operands[DW].format == tiny
    assert r.operands[WG].format == BF16


def test_redefined_builtin_is_recorded() -> None:
    r = parse_recipe("format nvfp4 = nvfp4 global none\n" + ops("* : nvfp4"))
    redefined = BlockFormat("nvfp4", E2M1, (1, 16), ScaleSpec(E4M3, "nearest"), False)
    assert r.formats == (("nvfp4", redefined),)
    assert r.operands[FA].format == redefined
    # Redefining a builtin as itself changes nothing, so it is not recorded.
    same = parse_recipe(
        "format nvfp4 = e2m1 block 1x16 scale e4m3 global amax\n" + ops("* : nvfp4")
    )
    assert same.formats == () and same == parse_recipe(ops("* : nvfp4"))


def test_format_defined_after_use_is_found() -> None:
    r = parse_recipe(ops("* : late") + "format late = mxfp4 block 1x16\n")
    assert r.operands[FA].format == BlockFormat("late", E2M1, (1, 16), ScaleSpec(UE8M0, "up"))


def test_rht_forms() -> None:
    text = ops(
        '* : nvfp4\nfprop : rht 4 signs "+-+-"\ndgrad : rht 32 seed 7\nwgrad : rht 16 signs none'
    )
    t = parse_recipe(text).operands
    assert t[FA].rht == t[FW].rht == RHTSpec(4, "fixed", (1, -1, 1, -1))
    assert t[DG].rht == RHTSpec(32, "seeded", None, 7)
    assert t[WG].rht == RHTSpec(16, "none", None)
    # `rht 16` alone means TE's fixed vector; `rht none` removes a transform
    t = parse_recipe(ops("* : nvfp4 rht 16\nfprop : rht none")).operands
    assert t[WA].rht == TE16 and t[FA].rht is None


def test_rht_size_may_be_a_multiple_of_the_block() -> None:
    # The paper also tried 128-point transforms on NVFP4's 16-element blocks.
    t = parse_recipe(ops("* : nvfp4\nwgrad : rht 128 seed 3")).operands
    assert t[WG].rht == RHTSpec(128, "seeded", None, 3)


# ------------------------------------------------------------------------------------------------
# extends and import
# ------------------------------------------------------------------------------------------------


def write(directory: Path, name: str, text: str) -> Path:
    path = directory / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_extends_continues_the_parent_cascade(tmp_path: Path) -> None:
    write(
        tmp_path,
        "base.fp4r",
        "format f = nvfp4 global none\n"
        + ops("* : f\nweight : block 16x16\ngradient : round stochastic")
        + "layers {\n    last 2 blocks : bf16\n}\n",
    )
    child = write(tmp_path, "child.fp4r", 'extends "base.fp4r"\n' + ops("fprop : round zero"))
    r = load_recipe(child)
    base = load_recipe(tmp_path / "base.fp4r")
    assert r.name == "child" and base.name == "base"
    assert r.formats == base.formats
    assert r.operands[FW].rounding == "zero"
    assert r.operands[FW].format == base.operands[FW].format
    assert r.operands[DG] == base.operands[DG]
    assert r.layers == base.layers  # inherited when the child has no layers section


def test_child_sections_replace_the_parents(tmp_path: Path) -> None:
    write(tmp_path, "base.fp4r", ops("* : nvfp4") + "layers {\n    last 2 blocks : bf16\n}\n")
    text = 'extends "base.fp4r"\nlayers {\n}\nschedule {\n    at step 10 backward : fp16\n}\n'
    r = parse_recipe(text, base_dir=tmp_path)
    assert r.layers == ()
    assert r.schedule == (ScheduleRule(10, None, "backward", HighPrecision("fp16")),)


def test_child_redefinition_rebinds_inherited_operands(tmp_path: Path) -> None:
    # The parent's 16x16 weight override survives; the format under it is the child's.
    write(tmp_path, "base.fp4r", "format f = nvfp4\n" + ops("* : f\nweight : block 16x16"))
    r = parse_recipe('extends "base.fp4r"\nformat f = mxfp4 block 1x16\n', base_dir=tmp_path)
    f = BlockFormat("f", E2M1, (1, 16), ScaleSpec(UE8M0, "up"))
    assert r.formats == (("f", f),)
    assert r.operands[FA].format == f and r.operands[FW].format == f.with_block((16, 16))


def test_extends_falls_back_to_shipped_recipes(tmp_path: Path) -> None:
    r = parse_recipe('extends "nvfp4"\n' + ops("gradient : round nearest"), base_dir=tmp_path)
    assert r.operands[WG] == OperandSpec(NVFP4, "nearest", TE16)
    assert r.operands == shipped("nvfp4_no_sr").operands
    assert r.layers == shipped("nvfp4").layers


def test_import_brings_formats_and_mors_only(tmp_path: Path) -> None:
    write(
        tmp_path,
        "lib/formats.fp4r",
        "format f = nvfp4 block 1x32\n"
        "mor m {\n    decide channel\n    scale channel e8m0\n    try e5m2 if range\n"
        "    else fp16\n}\n" + ops("* : bf16") + "layers {\n    last 1 blocks : bf16\n}\n",
    )
    r = parse_recipe('import "lib/formats.fp4r"\n' + ops("* : f\nwgrad : mor m"), base_dir=tmp_path)
    assert [name for name, _ in r.formats] == ["f"]
    assert r.mors[0] == MoRSpec(
        "m", Partition("channel"), Partition("channel"), "e8m0",
        (Candidate(E5M2, Metric("range")), Candidate(HighPrecision("fp16"))),
    )  # fmt: skip
    assert r.operands[FA].format.block == (1, 32)  # type: ignore[union-attr]
    assert r.operands[WG].format == MoRRef("m")
    assert r.layers == ()


def test_imports_are_relative_to_the_including_file(tmp_path: Path) -> None:
    write(tmp_path, "lib/a.fp4r", 'import "b.fp4r"\n')
    write(tmp_path, "lib/b.fp4r", "format deep = mxfp4 block 1x64\n")
    r = parse_recipe('import "lib/a.fp4r"\n' + ops("* : deep"), base_dir=tmp_path)
    assert r.operands[FA].format.block == (1, 64)  # type: ignore[union-attr]


def test_the_same_format_from_two_imports_is_fine(tmp_path: Path) -> None:
    write(tmp_path, "common.fp4r", "format c = mxfp4 round down\n")
    write(tmp_path, "x.fp4r", 'import "common.fp4r"\n')
    write(tmp_path, "y.fp4r", 'import "common.fp4r"\n')
    text = 'import "x.fp4r"\nimport "y.fp4r"\n' + ops("* : c")
    r = parse_recipe(text, base_dir=tmp_path)
    assert r.operands[FA].format.scale == ScaleSpec(UE8M0, "down")  # type: ignore[union-attr]


def test_recipe_reference_in_layers(tmp_path: Path) -> None:
    text = ops("* : nvfp4") + 'layers {\n    match "*.attn.*" : recipe "mxfp8.fp4r"\n}\n'
    r = parse_recipe(text, base_dir=tmp_path)
    (rule,) = r.layers
    assert rule.selector == LayerSelector("match", pattern="*.attn.*")
    assert isinstance(rule.action, RecipeRef) and rule.action.path == "mxfp8.fp4r"
    assert rule.action.recipe == shipped("mxfp8")


def test_inherited_recipe_reference_stays_valid(tmp_path: Path) -> None:
    write(tmp_path, "lib/other.fp4r", ops("* : mxfp4"))
    layers = (
        'layers {\n    last 1 layers : recipe "other.fp4r"\n'
        '    first 1 layers : recipe "mxfp8"\n}\n'
    )
    write(tmp_path, "lib/base.fp4r", ops("* : nvfp4") + layers)
    r = parse_recipe('extends "lib/base.fp4r"\n', base_dir=tmp_path)
    local, shipped_ref = (rule.action for rule in r.layers)
    assert isinstance(local, RecipeRef) and isinstance(shipped_ref, RecipeRef)
    assert local.path == str(Path("lib") / "other.fp4r")  # rewritten relative to this file
    assert local.recipe is not None and local.recipe.operands[FA].format == MXFP4
    assert shipped_ref.path == "mxfp8"  # still resolves from here: kept as written
    assert round_trip_ok(r, tmp_path)


def round_trip_ok(recipe: Recipe, base_dir: Path) -> bool:
    return parse_recipe(print_recipe(recipe), base_dir=base_dir) == recipe


# ------------------------------------------------------------------------------------------------
# Header, layers, schedule, lexical details
# ------------------------------------------------------------------------------------------------


def test_names_and_descriptions(tmp_path: Path) -> None:
    assert parse_recipe(ops("* : nvfp4")).name == "recipe"
    path = write(tmp_path, "my_recipe.fp4r", ops("* : nvfp4"))
    assert load_recipe(path).name == "my_recipe"
    r = parse_recipe('recipe "odd name" "say \\"hi\\"\\tthen\\nbye"\n' + ops("* : nvfp4"))
    assert r.name == "odd name" and r.description == 'say "hi"\tthen\nbye'


def test_load_recipe_takes_text_or_paths(tmp_path: Path) -> None:
    path = write(tmp_path, "r.fp4r", ops("* : mxfp4"))
    from_text = load_recipe(ops("* : mxfp4"))
    assert load_recipe(path) == load_recipe(str(path))
    assert load_recipe(path).operands == from_text.operands
    assert (load_recipe(path).name, from_text.name) == ("r", "recipe")
    # A bare name that is not a file here is looked up among the shipped recipes.
    assert load_recipe("nvfp4_no_sr.fp4r") == shipped("nvfp4_no_sr")


def test_layers_and_schedule() -> None:
    text = ops("* : nvfp4") + (
        "layers {\n    first 1 block : fp16\n    last 15% layers : mxfp8_e4m3\n"
        '    match "*lm_head" : bf16\n}\n'
        "schedule {\n    at 82% forward : bf16\n    at step 1000 : fp32\n}\n"
    )
    r = parse_recipe(text)
    assert r.layers == (
        LayerRule(LayerSelector("first", "blocks", count=1), HighPrecision("fp16")),
        LayerRule(LayerSelector("last", "layers", fraction=0.15), BUILTIN_FORMATS["mxfp8_e4m3"]),
        LayerRule(LayerSelector("match", pattern="*lm_head"), BF16),
    )
    assert r.schedule == (
        ScheduleRule(None, 0.82, "forward", BF16),
        ScheduleRule(1000, None, "both", HighPrecision("fp32")),
    )


def test_comments_blank_lines_crlf_and_one_line_blocks() -> None:
    text = (
        "# leading comment\r\n\r\n   # indented comment\r\nrecipe r  # trailing comment\r\n"
        "operands { * : nvfp4 }   # one line\r\n\r\n# final comment"
    )
    r = parse_recipe(text)
    assert r.name == "r" and r.operands[FA].format == NVFP4


def test_keywords_can_be_names_where_no_keyword_fits() -> None:
    r = parse_recipe("format up = nvfp4\nformat tensor = mxfp4\n" + ops("* : up\nweight : tensor"))
    assert r.operands[FA].format.name == "up"  # type: ignore[union-attr]
    assert r.operands[FW].format.name == "tensor"  # type: ignore[union-attr]
