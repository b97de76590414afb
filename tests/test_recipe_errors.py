"""Bad recipes: every error is a RecipeError with file, line, column, a caret under the offending
token and a message that says what was expected or why the value is illegal."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fp4gen.dsl import load_recipe, parse_recipe
from fp4gen.errors import RecipeError

RECIPES = Path(__file__).resolve().parent.parent / "fp4gen" / "recipes"

MOR_HEAD = "mor m {\n    decide tensor\n    scale tensor gam\n"
OPS = "operands {\n    * : nvfp4\n}\n"

# (id, recipe text, line, column, phrase of the message)
CASES: list[tuple[str, str, int, int, str]] = [
    # --- syntax ---------------------------------------------------------------------------------
    ("scope_word", "operands {\n    * : nvfp4 global per tenso\n}\n", 2, 26,
     "expected 'expert' or 'tensor' after 'per' (did you mean 'tensor'?)"),
    ("scope_needs_per", "operands {\n    * : nvfp4 global tensor\n}\n", 2, 22,
     "expected 'per' after 'global'"),
    ("scope_twice", "operands {\n    * : nvfp4 global per tensor global per expert\n}\n", 2, 33,
     "'global' given twice in one statement (first at column 26)"),
    # --- the global scale's scope (global per tensor) needs a format with a global amax -------
    ("scope_ue8m0", "operands {\n    * : mxfp4 global per tensor\n}\n", 2, 26,
     "global per tensor on fprop.activation, but its format mxfp4 has no global amax scale "
     "(ue8m0 block scales, global none)"),
    ("scope_fp32_scales",
     "format f = e4m3 block 1x128 scale fp32\noperands {\n    * : f\n    weight : global per "
     "tensor\n}\n", 4, 25, "fprop.weight, but its format f has no global amax scale (fp32"),
    ("scope_then_bf16", "operands {\n    * : nvfp4 global per tensor\n    gradient : bf16\n}\n",
     3, 16, "global per tensor on dgrad.gradient, but it is bf16, which is not quantized"),
    ("scope_mor", MOR_HEAD + "    try e4m3 if range\n    else bf16\n}\noperands {\n    * : nvfp4"
     "\n    activation : mor m global per tensor\n}\n", 9, 35,
     "global per tensor on fprop.activation, but it uses the mor rule m"),
    ("scope_from", "operands {\n    * : nvfp4 global per tensor\n    wgrad.activation : from "
     "fprop.activation\n}\n", 3, 24, "global per tensor on wgrad.activation, but "
     "wgrad.activation is quantized from fprop.activation's copy"),
    ("scope_source_of_from", "operands {\n    * : nvfp4\n    wgrad.activation : from "
     "fprop.activation\n    fprop.activation : global per tensor\n}\n", 4, 35,
     "global per tensor on fprop.activation, but wgrad.activation is quantized from"),
    ("scope_row",
     "format r = nvfp4 global row\noperands {\n    * : nvfp4\n    fprop.activation : r global "
     "per tensor\n}\n", 4, 37, "its format r has per-row global scales (`global row`)"),
    ("missing_colon", "operands {\n    * nvfp4\n}\n", 2, 7,
     "expected ':' after the operand selector"),
    ("unknown_top_keyword", "formt x = e2m1\n", 1, 1,
     "unknown keyword 'formt': expected 'eval', 'extends', 'format'"),
    ("unknown_prop_keyword", "operands {\n    * : nvfp4 rund nearest\n}\n", 2, 15,
     "unknown keyword 'rund'"),
    ("did_you_mean", "operands {\n    * : nvfp4 rund nearest\n}\n", 2, 15,
     "(did you mean 'round'?)"),
    ("operand_round_value", "operands {\n    * : nvfp4 round up\n}\n", 2, 21,
     "expected 'nearest', 'stochastic', 'stochastic16', 'stochastic8' or 'zero' after 'round'"),
    ("unclosed_brace", "operands {\n    * : nvfp4\n", 2, 14,
     "expected '}' to close the operands block opened on line 1"),
    ("unterminated_string", 'recipe x "abc\n', 1, 10, "unterminated string"),
    ("block_needs_shape", "operands {\n    * : nvfp4 block 16\n}\n", 2, 21,
     "expected a block shape such as 1x16 or 16x16 after 'block'"),
    ("format_missing_equal", "format x e2m1 block 1x16 scale e4m3\n", 1, 10,
     "expected '=' after the format name 'x'"),
    ("threshold_without_percent", MOR_HEAD + "    try e4m3 if relerr < 4\n    else bf16\n}\n",
     4, 26, "write the threshold as a percentage"),
    ("bad_character", "operands {\n    * : nvfp4 @\n}\n", 2, 15, "unexpected character '@'"),
    ("missing_brace", "operands\n    * : nvfp4\n", 1, 9, "expected '{' after 'operands'"),
    ("empty_statement", "operands {\n    weight :\n}\n", 2, 13,
     "unexpected end of line: expected a format name, 'block', 'from', 'global', 'mor', 'rht' or "
     "'round'"),
    ("selector_missing_role", "operands {\n    wgrad. : nvfp4\n}\n", 2, 12,
     "expected a role (weight, activation, gradient) after '.'"),
    ("rht_shape", "operands {\n    * : nvfp4\n    wgrad : rht 16x16\n}\n", 3, 19,
     "the Hadamard size is one number"),
    ("decide_typo", "mor m {\n    decide tensr\n}\n", 2, 12,
     "expected 'block', 'channel' or 'tensor' after 'decide'"),
    ("bad_escape", 'recipe x "a\\qb"\n', 1, 12, "unknown escape '\\q'"),
    # --- elements, blocks and formats -----------------------------------------------------------
    ("unknown_format", "operands {\n    * : nvfp5\n}\n", 2, 9,
     "unknown format 'nvfp5' (did you mean 'nvfp4'?)"),
    ("unknown_base_format", "format x = nvfp5 block 1x16\n", 1, 12, "unknown format 'nvfp5'"),
    ("bad_element_name", "format x = e2mx block 1x16 scale e4m3\n", 1, 12,
     "bad element name 'e2mx': expected eXmY"),
    ("element_too_wide", "format x = e5m3 block 1x16 scale e4m3\n", 1, 12,
     "e5m3 is 9 bits wide"),
    ("element_too_narrow", "format x = e1m0 block 1x16 scale e4m3\n", 1, 12,
     "element formats are 3 to 8 bits wide"),
    ("ue_scale_with_mantissa", "format x = e2m1 block 1x16 scale ue4m3\n", 1, 34,
     "unsigned scale formats are exponent-only"),
    ("ue_as_element", "format x = ue8m0 block 1x16 scale e4m3\n", 1, 12,
     "elements need a sign bit"),
    ("ieee_without_mantissa", "format x = e4m0 ieee block 1x16 scale e4m3\n", 1, 17,
     "the ieee convention has no NaN codes"),
    ("special_on_format_name", "format x = nvfp4 fn\n", 1, 18, "'nvfp4' is a format name"),
    ("element_needs_scale", "format x = e2m1 block 1x16\n", 1, 12, "needs a scale format"),
    ("element_needs_block", "format x = e2m1 scale e4m3\n", 1, 12, "needs a block shape"),
    ("block_zero", "operands {\n    * : nvfp4\n    weight : block 0x16\n}\n", 3, 20,
     "block dimensions must be at least 1"),
    ("block_not_square", "format x = nvfp4 block 8x16\n", 1, 24, "2D blocks are square NxN"),
    ("clause_twice", "format x = nvfp4 block 1x16 block 1x32\n", 1, 29,
     "'block' given twice in the definition of x"),
    ("global_amax_fp32_scales", "format x = e4m3 block 1x128 scale fp32 global amax\n", 1, 47,
     "fp32 block scales do not need one"),
    ("global_inherited_fp32", "format x = nvfp4 scale fp32\n", 1, 24,
     "fp32 block scales do not need one (use global none)"),
    ("ocp_on_e4m3_scale", "format x = nvfp4 round ocp\n", 1, 24,
     "defined for exponent-only scales such as ue8m0, not for e4m3"),
    ("fp32_scale_round_up", "format x = e4m3 block 1x128 scale fp32 round up\n", 1, 46,
     "'round up' does not apply"),
    ("duplicate_format", "format x = nvfp4\nformat x = mxfp4\n", 2, 8,
     "format x is already defined on line 1"),
    ("element_name_as_format_name", "format e2m1 = nvfp4\n", 1, 8, "names an element format"),
    ("redefine_bf16", "format bf16 = nvfp4\n", 1, 8, "bf16 is a high-precision dtype"),
    # --- operands -------------------------------------------------------------------------------
    ("unknown_selector", "operands {\n    weights : nvfp4\n}\n", 2, 5,
     "unknown selector 'weights'"),
    ("no_such_operand", "operands {\n    fprop.gradient : nvfp4\n}\n", 2, 11,
     "fprop has no 'gradient' operand"),
    ("slot_without_format", "operands {\n    weight : nvfp4\n}\n", 1, 1,
     "operand fprop.activation has no format"),
    ("round_twice", "operands {\n    * : nvfp4 round nearest round zero\n}\n", 2, 29,
     "'round' given twice in one statement"),
    ("2d_block_on_activation", "operands {\n    * : nvfp4\n    activation : block 16x16\n}\n",
     3, 24, "only weights can have 2D blocks"),
    ("2d_format_on_gradient",
     "format w2d = nvfp4 block 16x16\noperands {\n    * : nvfp4\n    gradient : w2d\n}\n",
     4, 16, "dgrad.gradient cannot use 16x16 blocks"),
    ("block_on_bf16", "operands {\n    * : bf16 block 1x16\n}\n", 2, 20,
     "applies to block-scaled formats"),
    ("stochastic_on_bf16",
     "operands {\n    * : nvfp4\n    gradient : round stochastic\n    dgrad.gradient : bf16\n}\n",
     4, 22, "no neighbour to round to"),
    ("rht_on_bf16", "operands {\n    * : nvfp4\n    wgrad : bf16 rht 16\n}\n", 3, 18,
     "a high-precision operand is not quantized (use rht none)"),
    ("rht_not_power_of_two", "operands {\n    * : nvfp4 rht 12 seed 1\n}\n", 2, 19,
     "RHT size 12 is not a power of two from 2 to 256"),
    ("rht_too_large", "operands {\n    * : nvfp4 rht 512 seed 1\n}\n", 2, 19,
     "RHT size 512 is not a power of two from 2 to 256"),
    ("signs_te_wrong_size", "operands {\n    * : mxfp4\n    wgrad : rht 32 signs te\n}\n", 3, 26,
     "signs te is Transformer Engine's fixed 16-entry vector"),
    ("rht_needs_sign_source", "operands {\n    * : mxfp4\n    wgrad : rht 32\n}\n", 3, 17,
     "rht 32 needs a sign source"),
    ("sign_string_length", 'operands {\n    * : nvfp4\n    wgrad : rht 4 signs "++-"\n}\n', 3, 25,
     "the sign string has 3 signs but the RHT size is 4"),
    ("sign_string_character", 'operands {\n    * : nvfp4\n    wgrad : rht 4 signs "+0-+"\n}\n',
     3, 27, "holds only '+' and '-', found '0'"),
    ("rht_on_one_operand", "operands {\n    * : nvfp4\n    wgrad.gradient : rht 16\n}\n", 3, 22,
     "both operands of wgrad need the same transform"),
    ("unknown_mor", "operands {\n    * : mor nope\n}\n", 2, 13, "unknown mor 'nope'"),
    ("mor_without_keyword", MOR_HEAD + "    try e4m3 if range\n    else bf16\n}\n"
     "operands {\n    * : m\n}\n", 8, 9, "write `mor m` to use it"),
    # --- mixture of representations -------------------------------------------------------------
    ("threshold_100", MOR_HEAD + "    try e4m3 if relerr < 100%\n    else bf16\n}\n", 4, 26,
     "threshold 100% is out of range"),
    ("threshold_0", MOR_HEAD + "    try e4m3 if relerr < 0%\n    else bf16\n}\n", 4, 26,
     "strictly between 0% and 100%"),
    ("mor_without_else", MOR_HEAD + "    try e4m3 if range\n}\n", 1, 5,
     "mor m has no 'else' fallback"),
    ("mor_try_after_else", MOR_HEAD + "    else bf16\n    try e4m3 if range\n}\n", 5, 5,
     "'try' after 'else' (on line 4)"),
    ("mor_missing_scale", "mor m {\n    decide tensor\n    try e4m3 if range\n    else bf16\n}\n",
     1, 5, "mor m needs a 'scale' line"),
    ("relerr_versus_bf16", MOR_HEAD + "    try e4m3 if relerr < relerr(bf16)\n    else bf16\n}\n",
     4, 33, "compares against an element format"),
    ("range_on_fp16", MOR_HEAD + "    try fp16 if range\n    else bf16\n}\n", 4, 17,
     "'range' checks an element format's normal range"),
    ("duplicate_mor", MOR_HEAD + "    try e4m3 if range\n    else bf16\n}\n" + MOR_HEAD
     + "    try e4m3 if range\n    else bf16\n}\n", 7, 5, "mor m is already defined on line 1"),
    # --- layers and schedule --------------------------------------------------------------------
    ("layers_percent_too_big", OPS + "layers {\n    last 150% layers : bf16\n}\n", 5, 10,
     "150% is out of range"),
    ("layers_count_zero", OPS + "layers {\n    first 0 blocks : bf16\n}\n", 5, 11,
     "the count of blocks must be at least 1"),
    ("schedule_percent_100", OPS + "schedule {\n    at 100% : bf16\n}\n", 5, 8,
     "100% is out of range"),
    ("unknown_layer_format", OPS + "layers {\n    last 2 blocks : bf17\n}\n", 5, 21,
     "unknown format 'bf17' (did you mean 'bf16'?)"),
    ("second_layers_section",
     OPS + "layers {\n    last 2 blocks : bf16\n}\nlayers {\n    first 2 blocks : bf16\n}\n",
     7, 1, "a second layers section (the first is on line 4)"),
    ("second_recipe_line", 'recipe a "x"\nrecipe b "y"\n', 2, 1, "a second 'recipe' line"),
    # a format action stands for all six operands, activations and gradients too
    ("layer_rule_2d_format",
     "format w = nvfp4 block 16x16\n" + OPS + "layers {\n    first 1 block : w\n}\n", 6, 21,
     "w has 16x16 blocks, but a layer or schedule rule's format applies to every operand"),
    ("schedule_rule_2d_format",
     "format w = nvfp4 block 16x16\n" + OPS + "schedule {\n    at 50% : w\n}\n", 6, 14,
     "only weights can have 2D blocks"),
]  # fmt: skip


def check(err: RecipeError, text: str, line: int, column: int, phrase: str) -> None:
    assert (err.line, err.column) == (line, column), str(err)
    assert phrase in err.reason, str(err)
    rendered = str(err).splitlines()
    assert rendered[0] == f"{err.file}:{line}:{column}: {err.reason.splitlines()[0]}"
    # The offending source line, then a caret under the column.
    assert rendered[1] == "    " + text.splitlines()[line - 1]
    assert rendered[2] == "    " + " " * (column - 1) + "^"


def test_cases_are_distinct() -> None:
    assert len(CASES) >= 30
    assert len({c[0] for c in CASES}) == len(CASES)


@pytest.mark.parametrize(("text", "line", "column", "phrase"), [c[1:] for c in CASES],
                         ids=[c[0] for c in CASES])  # fmt: skip
def test_bad_recipe(text: str, line: int, column: int, phrase: str) -> None:
    with pytest.raises(RecipeError) as info:
        parse_recipe(text, file="bad.fp4r")
    assert info.value.file == "bad.fp4r"
    check(info.value, text, line, column, phrase)


# --- errors that involve several files ----------------------------------------------------------


def write(directory: Path, name: str, text: str) -> Path:
    path = directory / name
    path.write_text(text)
    return path


def test_missing_import(tmp_path: Path) -> None:
    text = 'import "nope.fp4r"\n' + OPS
    path = write(tmp_path, "a.fp4r", text)
    with pytest.raises(RecipeError) as info:
        load_recipe(path)
    check(info.value, text, 1, 8, "cannot find recipe file 'nope.fp4r'")
    assert info.value.file.endswith("a.fp4r")


def test_import_cycle_names_the_chain(tmp_path: Path) -> None:
    write(tmp_path, "a.fp4r", 'import "b.fp4r"\n' + OPS)
    b_text = 'import "a.fp4r"\nformat x = nvfp4\n'
    write(tmp_path, "b.fp4r", b_text)
    with pytest.raises(RecipeError) as info:
        load_recipe(tmp_path / "a.fp4r")
    check(info.value, b_text, 1, 8, "import cycle: a.fp4r -> b.fp4r -> a.fp4r")
    assert info.value.file.endswith("b.fp4r")


def test_extends_cycle_through_an_import(tmp_path: Path) -> None:
    write(tmp_path, "a.fp4r", 'extends "b.fp4r"\n')
    b_text = 'import "a.fp4r"\n' + OPS
    write(tmp_path, "b.fp4r", b_text)
    with pytest.raises(RecipeError) as info:
        load_recipe(tmp_path / "a.fp4r")
    check(info.value, b_text, 1, 8, "extends/import cycle: a.fp4r -> b.fp4r -> a.fp4r")


def test_extends_itself(tmp_path: Path) -> None:
    text = 'extends "a.fp4r"\n'
    write(tmp_path, "a.fp4r", text)
    with pytest.raises(RecipeError) as info:
        load_recipe(tmp_path / "a.fp4r")
    check(info.value, text, 1, 9, "extends cycle: a.fp4r -> a.fp4r")


def test_recipe_reference_cycle(tmp_path: Path) -> None:
    write(tmp_path, "a.fp4r", OPS + 'layers {\n    match "*" : recipe "b.fp4r"\n}\n')
    b_text = OPS + 'layers {\n    match "*" : recipe "a.fp4r"\n}\n'
    write(tmp_path, "b.fp4r", b_text)
    with pytest.raises(RecipeError) as info:
        load_recipe(tmp_path / "a.fp4r")
    check(info.value, b_text, 5, 24, "recipe cycle: a.fp4r -> b.fp4r -> a.fp4r")


def test_extends_twice() -> None:
    text = 'extends "nvfp4.fp4r"\nextends "mxfp4.fp4r"\n'
    with pytest.raises(RecipeError) as info:
        parse_recipe(text, file="two.fp4r")
    check(info.value, text, 2, 1, "a recipe extends at most one other")


def test_conflicting_imports(tmp_path: Path) -> None:
    write(tmp_path, "f1.fp4r", "format x = nvfp4\n")
    write(tmp_path, "f2.fp4r", "format x = mxfp4\n")
    text = 'import "f1.fp4r"\nimport "f2.fp4r"\n' + OPS
    with pytest.raises(RecipeError) as info:
        parse_recipe(text, file=tmp_path / "main.fp4r")
    check(info.value, text, 2, 8, "format x from 'f2.fp4r' differs from the format x imported")


def test_error_in_parent_points_into_the_parent(tmp_path: Path) -> None:
    # The parent transforms only one wgrad operand; the child never fixes it.
    parent = "operands {\n    * : nvfp4\n    wgrad.gradient : rht 16\n}\n"
    write(tmp_path, "base.fp4r", parent)
    write(tmp_path, "child.fp4r", 'extends "base.fp4r"\noperands {\n    weight : round zero\n}\n')
    with pytest.raises(RecipeError) as info:
        load_recipe(tmp_path / "child.fp4r")
    assert info.value.file.endswith("base.fp4r")
    check(info.value, parent, 3, 22, "both operands of wgrad need the same transform")


def test_child_error_against_parent_settings(tmp_path: Path) -> None:
    # Stochastic rounding comes from the shipped parent; bf16 from the child: report the child.
    text = 'extends "nvfp4.fp4r"\noperands {\n    dgrad.gradient : bf16\n}\n'
    path = write(tmp_path, "child.fp4r", text)
    with pytest.raises(RecipeError) as info:
        load_recipe(path)
    check(info.value, text, 3, 22, "stochastic8 rounding on dgrad.gradient, which is bf16")


def test_missing_recipe_file(tmp_path: Path) -> None:
    with pytest.raises(RecipeError, match="no such recipe file"):
        load_recipe(tmp_path / "absent.fp4r")


# --- nothing but RecipeError ever escapes -------------------------------------------------------

SHIPPED_TEXTS = [p.read_text() for p in sorted(RECIPES.glob("*.fp4r"))]
PIECES = list("{}:.*=#\"\n %x0123456789abcdefmr+-()<") + [
    "block", "rht", "round", "mor", "else", "try", "nvfp4", "e2m1", "16x16", " te", "signs",
    "seed", "global", "scale", "layers", "ue8m0", "fp32", "stochastic", "1x24", "e9m9",
]  # fmt: skip


@st.composite
def mutated_recipes(draw: st.DrawFn) -> str:
    text = draw(st.sampled_from(SHIPPED_TEXTS))
    for _ in range(draw(st.integers(1, 3))):
        at = draw(st.integers(0, len(text)))
        if draw(st.booleans()):
            text = text[:at] + text[at + draw(st.integers(1, 6)) :]
        else:
            text = text[:at] + draw(st.sampled_from(PIECES)) + text[at:]
    return text


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mutated_recipes())
def test_mutated_recipes_fail_cleanly(text: str) -> None:
    try:
        parse_recipe(text, base_dir=RECIPES)
    except RecipeError as err:
        assert err.line is not None and err.column is not None
        assert "Traceback" not in str(err) and "Token(" not in str(err)


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=80))
def test_arbitrary_text_fails_cleanly(text: str) -> None:
    try:
        parse_recipe(text)
    except RecipeError as err:
        assert err.reason
