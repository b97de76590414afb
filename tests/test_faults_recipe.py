"""Recipe-language faults: absurd numbers, deep include chains, huge strings, references to
files that are not recipes, recipe names, unreadable files. Each ends in one RecipeError (or,
on the command line, exit 1 and one message on stderr), never a traceback, an overflow, a
recursion error, a blocked open or gigabytes of memory."""

from __future__ import annotations

import os
import re
import threading
import time
import tracemalloc
from pathlib import Path

import pytest

from fp4gen.cli import main
from fp4gen.dsl import find_recipe, load_recipe, parse_recipe
from fp4gen.dsl.parser import is_recipe_text
from fp4gen.dsl.resolve import MAX_INCLUDE_DEPTH
from fp4gen.dsl.source import MAX_RECIPE_CHARS, MAX_STRING_CHARS, SHIPPED_RECIPES, shipped_names
from fp4gen.dsl.statements import MAX_BLOCK_DIM, MAX_BLOCK_ELEMENTS, MAX_COUNT, MAX_STEP
from fp4gen.errors import FP4GenError, RecipeError

OPS = "operands {\n    * : nvfp4\n}\n"
SHIPPED = sorted(SHIPPED_RECIPES.glob("*.fp4r"))
HUGE = "9" * 5000  # past int()'s 4300-digit limit: must not raise ValueError either


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def error_of(text: str, file: str = "bad.fp4r", base_dir: Path | None = None) -> RecipeError:
    with pytest.raises(RecipeError) as info:
        parse_recipe(text, file=file, base_dir=base_dir)
    return info.value


def located(err: RecipeError, line: int, column: int, reason: str) -> None:
    """The error is at (line, column) with exactly this reason, quoting one line and a caret."""
    assert (err.line, err.column, err.reason) == (line, column, reason), str(err)
    rendered = str(err).splitlines()
    assert len(rendered) == 3, str(err)
    assert rendered[0] == f"{err.file}:{line}:{column}: {reason}"
    assert rendered[2].endswith("^")


def write(directory: Path, name: str, text: str | bytes) -> Path:
    path = directory / name
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text)
    return path


# ------------------------------------------------------------------------------------------------
# 1. Numbers: block shapes, RHT, counts, steps, percentages
# ------------------------------------------------------------------------------------------------

TOO_BIG: list[tuple[str, str, int, int, str]] = [
    (
        "format_block_overflow",
        "format x = e2m1 block 1x99999999999999999999999 scale e4m3\n" + OPS,
        1, 23,
        "block 1x99999999999999999999999: a block dimension is at most 1024, e.g. 1x1024 or "
        "128x128",
    ),
    (
        "weight_block_65536",
        "operands {\n    * : nvfp4\n    weight : block 65536x65536\n}\n",
        3, 20,
        "block 65536x65536: a block dimension is at most 1024, e.g. 1x1024 or 128x128",
    ),
    (
        "block_1x1025",
        "operands {\n    * : nvfp4 block 1x1025\n}\n",
        2, 21,
        "block 1x1025: a block dimension is at most 1024, e.g. 1x1024 or 128x128",
    ),
    (
        "block_512x512_elements",
        "operands {\n    * : nvfp4\n    weight : block 512x512\n}\n",
        3, 20,
        "block 512x512 has 262,144 elements; a block has at most 65,536 (up to 256x256)",
    ),
    (
        "block_5000_digits",
        f"operands {{\n    * : nvfp4 block 1x{HUGE}\n}}\n",
        2, 21,
        f"block 1x{HUGE[:16]}...{HUGE[:18]} (5,002 characters): a block dimension is at most "
        "1024, e.g. 1x1024 or 128x128",
    ),
    (
        "mor_decide_block",
        "mor m {\n    decide block 2048x2048\n    scale tensor gam\n    try e4m3 if range\n"
        "    else bf16\n}\n" + OPS,
        2, 18,
        "block 2048x2048: a block dimension is at most 1024, e.g. 1x1024 or 128x128",
    ),
    (
        "mor_scale_block",
        "mor m {\n    decide tensor\n    scale block 1x99999999999 gam\n    try e4m3 if range\n"
        "    else bf16\n}\n" + OPS,
        3, 17,
        "block 1x99999999999: a block dimension is at most 1024, e.g. 1x1024 or 128x128",
    ),
    (
        "rht_size",
        "operands {\n    * : nvfp4 rht 99999999999999999999999999 seed 1\n}\n",
        2, 19,
        "RHT size 99999999999999999999999999 is not a power of two from 2 to 256 (the paper "
        "uses 16)",
    ),
    (
        "rht_seed",
        f"operands {{\n    * : nvfp4 rht 16 seed {HUGE}\n}}\n",
        2, 27,
        f"RHT seed {HUGE[:18]}...{HUGE[:18]} (5,000 characters) does not fit in 64 bits: a "
        "seed is a whole number from 0 to 18446744073709551615",
    ),
    (
        "layer_count",
        OPS + "layers {\n    first 99999999999999999999999999 blocks : bf16\n}\n",
        5, 11,
        "99999999999999999999999999 blocks is out of range: a count of blocks is at most "
        "1,000,000 (or give a share, e.g. 15%)",
    ),
    (
        "layer_count_5000_digits",
        OPS + f"layers {{\n    last {HUGE} layers : bf16\n}}\n",
        5, 10,
        f"{HUGE[:18]}...{HUGE[:18]} (5,000 characters) layers is out of range: a count of "
        "layers is at most 1,000,000 (or give a share, e.g. 15%)",
    ),
    (
        "layer_share",
        OPS + f"layers {{\n    last {HUGE}% layers : bf16\n}}\n",
        5, 10,
        f"{HUGE[:18]}...{HUGE[-17:]}% (5,001 characters) is out of range: a share of the "
        "layers lies in (0%, 100%]",
    ),
    (
        "schedule_step",
        OPS + "schedule {\n    at step 9223372036854775808 : bf16\n}\n",
        5, 13,
        "step 9223372036854775808 is out of range: a step is at most "
        "9,223,372,036,854,775,807 (2^63 - 1, a 64-bit step counter)",
    ),
    (
        "schedule_percent",
        OPS + "schedule {\n    at 1" + "0" * 400 + "% : bf16\n}\n",
        5, 8,
        "1" + "0" * 17 + "...0" + "0" * 16 + "% (402 characters) is out of range: a point in "
        "training lies strictly between 0% and 100% (use `at step 0` for the start)",
    ),
    (
        "mor_threshold",
        "mor m {\n    decide tensor\n    scale tensor gam\n    try e4m3 if relerr < "
        + HUGE + "%\n    else bf16\n}\n" + OPS,
        4, 26,
        f"threshold {HUGE[:18]}...{HUGE[-17:]}% (5,001 characters) is out of range: a "
        "relative-error threshold lies strictly between 0% and 100%",
    ),
    (
        "element_bits",
        "format x = e99999999999999999999999m1 block 1x16 scale e4m3\n" + OPS,
        1, 12,
        f"e99999999999999999999999m1 is {10**23 + 1} bits wide (1 sign + "
        "99999999999999999999999 exponent + 1 mantissa); element formats are 3 to 8 bits wide",
    ),
]  # fmt: skip


@pytest.mark.parametrize(
    ("text", "line", "column", "reason"),
    [c[1:] for c in TOO_BIG],
    ids=[c[0] for c in TOO_BIG],
)
def test_absurd_numbers_are_located_errors(text: str, line: int, column: int, reason: str) -> None:
    located(error_of(text), line, column, reason)


NUMBER_SLOTS = [
    "format x = e2m1 block 1x{n} scale e4m3\n" + OPS,
    "format x = e{n}m1 block 1x16 scale e4m3\n" + OPS,
    "format x = e2m1 block 1x16 scale ue{n}m0\n" + OPS,
    "operands {\n    * : nvfp4\n    weight : block {n}x{n}\n}\n",
    "operands {\n    * : nvfp4 rht {n} seed 1\n}\n",
    "operands {\n    * : nvfp4 rht 16 seed {n}\n}\n",
    "mor m {\n    decide block 1x{n}\n    scale tensor gam\n    try e4m3 if range\n"
    "    else bf16\n}\n" + OPS,
    "mor m {\n    decide tensor\n    scale tensor gam\n    try e4m3 if relerr < {n}.{n}%\n"
    "    else bf16\n}\n" + OPS,
    OPS + "layers {\n    first {n} blocks : bf16\n    last {n}% layers : bf16\n}\n",
    OPS + "schedule {\n    at step {n} : bf16\n    at {n}% : fp16\n}\n",
]


@pytest.mark.parametrize("template", NUMBER_SLOTS)
@pytest.mark.parametrize(
    "n", ["0", "1", "16", "1" * 25, HUGE], ids=["0", "1", "16", "e25", "e5000"]
)
def test_any_number_anywhere_is_a_recipe_or_a_recipe_error(template: str, n: str) -> None:
    """Never OverflowError, ValueError or a traceback: a recipe whose numbers all fit the
    limits, or a RecipeError that points at one of them."""
    from fp4gen import describe
    from fp4gen.cli import show_text

    text = template.replace("{n}", n)
    try:
        recipe = parse_recipe(text, file="n.fp4r")
    except RecipeError as err:
        assert err.line is not None and len(str(err)) < 1000
        return
    show_text(recipe, with_plan=False)
    describe.recipe_json(recipe)


def test_limits_admit_every_shipped_size() -> None:
    """The largest values the limits admit still parse, and the limits are the documented ones."""
    assert (MAX_BLOCK_DIM, MAX_BLOCK_ELEMENTS, MAX_COUNT, MAX_STEP) == (
        1024, 65536, 1_000_000, 2**63 - 1,
    )  # fmt: skip
    text = (
        "format wide = e2m1 block 1x1024 scale e4m3\n"
        "mor m {\n    decide block 256x256\n    scale block 128x128 gam\n"
        "    try e4m3 if relerr < 99.9%\n    else bf16\n}\n"
        "operands {\n    * : wide\n    weight : nvfp4 block 256x256\n    gradient : mor m\n}\n"
        "layers {\n    first 1000000 blocks : bf16\n    last 100% layers : bf16\n}\n"
        "schedule {\n    at step 9223372036854775807 : bf16\n}\n"
    )
    r = parse_recipe(text)
    assert r.layers[0].selector.count == MAX_COUNT
    assert r.schedule[0].step == MAX_STEP
    assert r.mors[0].decide.block == (256, 256)


def test_check_rejects_a_huge_block_in_one_message(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write(tmp_path, "big.fp4r", "operands {\n    * : nvfp4 block 65536x65536\n}\n")
    code, out, err = run(capsys, "check", str(path))
    assert (code, out) == (1, "")
    assert err == (
        f"{path}:2:21: block 65536x65536: a block dimension is at most 1024, e.g. 1x1024 or "
        "128x128\n        * : nvfp4 block 65536x65536\n" + " " * 24 + "^\n"
    )


# ------------------------------------------------------------------------------------------------
# 2. Deep extends / import / recipe chains
# ------------------------------------------------------------------------------------------------


def chain(directory: Path, kind: str, length: int) -> Path:
    """r0 -> r1 -> ... -> r{length}: each file reaches the next by ``kind``."""
    for i in range(length + 1):
        nxt = f"r{i + 1}.fp4r"
        if i == length:
            body = OPS + "format last = nvfp4\n"
        elif kind == "extends":
            body = f'extends "{nxt}"\n'
        elif kind == "import":
            body = f'import "{nxt}"\n' + OPS
        else:
            body = OPS + f'layers {{\n    match "*" : recipe "{nxt}"\n}}\n'
        write(directory, f"r{i}.fp4r", body)
    return directory / "r0.fp4r"


@pytest.mark.parametrize(("kind", "length"), [("extends", 500), ("import", 3000), ("recipe", 400)])
def test_deep_chains_stop_at_the_depth_limit(tmp_path: Path, kind: str, length: int) -> None:
    root = chain(tmp_path, kind, length)
    with pytest.raises(RecipeError) as info:
        load_recipe(root)
    err = info.value
    n = MAX_INCLUDE_DEPTH
    column = {"extends": 9, "import": 8, "recipe": 24}[kind]
    line = 5 if kind == "recipe" else 1
    located(
        err,
        line,
        column,
        f"{kind} 'r{n + 1}.fp4r' would be {n + 1} references deep (r0.fp4r -> r1.fp4r -> ... "
        f"-> r{n}.fp4r -> r{n + 1}.fp4r); extends, import and recipe references nest at most "
        f"{n} deep",
    )
    assert err.file == str(tmp_path / f"r{n}.fp4r")


@pytest.mark.parametrize("kind", ["extends", "import", "recipe"])
def test_a_chain_at_the_depth_limit_loads(tmp_path: Path, kind: str) -> None:
    recipe = load_recipe(chain(tmp_path, kind, MAX_INCLUDE_DEPTH))
    assert recipe.name == "r0"


def test_cycles_are_still_named(tmp_path: Path) -> None:
    write(tmp_path, "a.fp4r", 'extends "b"\n')
    b = write(tmp_path, "b.fp4r", 'import "a"\n' + OPS)
    with pytest.raises(RecipeError) as info:
        load_recipe(tmp_path / "a.fp4r")
    located(info.value, 1, 8, "extends/import cycle: a.fp4r -> b.fp4r -> a.fp4r")
    assert info.value.file == str(b)


# ------------------------------------------------------------------------------------------------
# 3. Long strings and long texts
# ------------------------------------------------------------------------------------------------


def measured(fn: object) -> tuple[object, float, float]:
    """(result or exception, seconds, peak MB traced) of calling ``fn``."""
    tracemalloc.start()
    start = time.perf_counter()
    try:
        result: object = fn()  # type: ignore[operator]
    except RecipeError as exc:
        result = exc
    seconds = time.perf_counter() - start
    peak = tracemalloc.get_traced_memory()[1] / 1e6
    tracemalloc.stop()
    return result, seconds, peak


def test_string_terminal_is_unrolled() -> None:
    """The grammar's STRING regex costs no memory per character (the old one took ~150 bytes
    per character: 5.5 GB for a 20 MB string)."""
    grammar = (Path(__file__).parent.parent / "fp4gen" / "dsl" / "grammar.lark").read_text()
    pattern = re.search(r"^STRING: /(.*)/$", grammar, flags=re.M)
    assert pattern is not None
    regex = re.compile(pattern.group(1))
    text = '"' + "a\\n" * 1_000_000 + "b" * 2_000_000 + '"'
    regex.match("warm-up")
    match, seconds, peak = measured(lambda: regex.match('"' + "x" * 4_000_000 + '"'))
    assert match is not None and peak < 10 and seconds < 2
    # escapes are bounded with the string length; more than that is not a STRING at all
    assert regex.match(text) is None
    assert regex.fullmatch('"' + "\\\\" * MAX_STRING_CHARS + '"') is not None


def test_a_long_string_is_an_error_quickly_and_cheaply() -> None:
    length = 900_000  # below the text limit, so the lexer really reads the string
    text = f'recipe x "{"a" * length}"\n' + OPS
    parse_recipe(OPS)  # build the parser outside the measurement
    err, seconds, peak = measured(lambda: parse_recipe(text, file="long.fp4r"))
    assert isinstance(err, RecipeError)
    assert err.reason == f"a string of {length:,} characters; strings are at most 4,096 characters"
    assert (err.line, err.column) == (1, 10)
    assert seconds < 5 and peak < 40, (seconds, peak)
    # the message quotes a window of the line, not the whole string
    assert max(len(line) for line in str(err).splitlines()) < 250


def test_many_escapes_are_a_too_long_string() -> None:
    text = 'recipe x "' + "\\\\" * 5000 + '"\n' + OPS
    located(
        error_of(text), 1, 10, "a string of 10,000 characters; strings are at most 4,096 characters"
    )


def test_an_unterminated_long_string_is_still_unterminated() -> None:
    text = 'recipe x "' + "\\\\" * 5000 + "\n" + OPS
    located(error_of(text), 1, 10, "unterminated string: the closing '\"' is missing on this line")


def test_multi_megabyte_text_is_refused_before_parsing() -> None:
    text = 'recipe x "' + "a" * 20_000_000 + '"\n' + OPS
    err, seconds, peak = measured(lambda: parse_recipe(text, file="huge.fp4r"))
    assert isinstance(err, RecipeError)
    assert str(err) == (
        f"huge.fp4r is {len(text):,} characters long; a recipe may be at most "
        f"{MAX_RECIPE_CHARS:,} characters"
    )
    assert seconds < 1 and peak < 5


def test_a_too_large_file_is_refused_without_reading_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write(tmp_path, "big.fp4r", b"#" * (MAX_RECIPE_CHARS + 1))
    code, out, err = run(capsys, "check", str(path))
    assert (code, out) == (1, "")
    assert err == f"{path} is 1,000,001 bytes long; a recipe may be at most 1,000,000 bytes\n"


@pytest.mark.parametrize("line", ["\n", "# a comment line\n", "   \t\n"])
def test_many_blank_and_comment_lines_cost_little(line: str) -> None:
    text = OPS + line * ((MAX_RECIPE_CHARS - 100) // len(line)) + "format x = nvfp4\n"
    parse_recipe(OPS)
    recipe, seconds, peak = measured(lambda: parse_recipe(text))
    assert not isinstance(recipe, RecipeError), recipe
    assert seconds < 10 and peak < 40, (seconds, peak)


def test_a_huge_name_is_an_error_with_a_short_message() -> None:
    name = "x" * 100_000
    err = error_of(f"format {name} = nvfp4\n" + OPS)
    located(
        err,
        1,
        8,
        f"a name of 100,000 characters ({'x' * 18}...{'x' * 18} (100,000 characters)); names "
        "are at most 256 characters",
    )
    err = error_of(f"{name}\n")
    assert len(err.reason) < 400 and err.reason.startswith("unknown keyword 'xxx")


# ------------------------------------------------------------------------------------------------
# 4. References to files: relative to the referencing recipe, .fp4r only, named when wrong
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("statement", "column"),
    [("extends", 9), ("import", 8), ("recipe", 0)],
)
def test_a_reference_never_reads_a_non_recipe_file(
    tmp_path: Path, statement: str, column: int
) -> None:
    secret = write(tmp_path, "secret", "SECRET-FIRST-LINE\n")
    if statement == "recipe":
        text = OPS + f'layers {{\n    match "*" : recipe "{secret}"\n}}\n'
        line, column = 5, 24
    else:
        text = f'{statement} "{secret}"\n' + OPS
        line = 1
    err = error_of(text, file=str(tmp_path / "main.fp4r"))
    located(
        err,
        line,
        column,
        f"cannot find recipe file '{secret}' (looked for secret.fp4r in {tmp_path}; references "
        "name .fp4r files)",
    )
    assert "SECRET" not in str(err)


def test_references_resolve_next_to_the_referencing_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write(tmp_path, "a/base.fp4r", "operands {\n    * : mxfp4\n}\n")
    write(tmp_path, "a/sub/layer.fp4r", "operands {\n    * : mxfp8_e4m3\n}\n")
    write(
        tmp_path, "a/mid.fp4r", 'extends "base"\nlayers {\n    match "*" : recipe "sub/layer"\n}\n'
    )
    main_path = write(tmp_path, "b/main.fp4r", 'extends "../a/mid.fp4r"\n')
    # decoys in the working directory must not be picked up
    work = tmp_path / "work"
    write(work, "base.fp4r", "operands {\n    * : bf16\n}\n")
    write(work, "sub/layer.fp4r", "operands {\n    * : bf16\n}\n")
    monkeypatch.chdir(work)
    r = load_recipe(main_path)
    assert r.operands.fprop_weight.format.name == "mxfp4"
    ref = r.layers[0].action
    assert ref.path == "../a/sub/layer.fp4r"  # rewritten relative to main.fp4r's directory
    assert ref.recipe.operands.fprop_weight.format.name == "mxfp8_e4m3"


@pytest.mark.parametrize("written", ["nvfp4", "nvfp4.fp4r"])
def test_shipped_names_resolve_in_references(tmp_path: Path, written: str) -> None:
    r = parse_recipe(
        f'extends "{written}"\nlayers {{\n    match "*" : recipe "{written}"\n}}\n',
        base_dir=tmp_path,
    )
    shipped = load_recipe(SHIPPED_RECIPES / "nvfp4.fp4r")
    assert r.operands == shipped.operands
    assert r.layers[0].action.recipe == shipped


def test_a_referenced_directory_fifo_or_binary_is_named(tmp_path: Path) -> None:
    (tmp_path / "d.fp4r").mkdir()
    write(tmp_path, "bin.fp4r", b"operands {\n\xff\n}\n")
    cases = [
        ("d", "is a directory, not a recipe file"),
        ("bin", "is not UTF-8 text (byte 0xff at line 2, column 1): save it as UTF-8"),
    ]
    if hasattr(os, "mkfifo"):
        os.mkfifo(tmp_path / "p.fp4r")
        cases.append(("p", "is a FIFO (named pipe), not a recipe file"))
    for written, why in cases:
        text = f'import "{written}"\n' + OPS
        err = error_of(text, file=str(tmp_path / "main.fp4r"))
        resolved = tmp_path / f"{written}.fp4r"
        located(err, 1, 8, f"cannot use '{written}': {resolved} {why}")


def test_an_error_inside_a_referenced_file_names_it_and_quotes_one_line(tmp_path: Path) -> None:
    write(tmp_path, "sub/base.fp4r", "# header\noperands {\n    * : nvfp5\n}\n")
    err = error_of('extends "sub/base"\n', file=str(tmp_path / "main.fp4r"))
    assert err.file == str(tmp_path / "sub" / "base.fp4r")
    assert str(err).splitlines() == [
        f"{err.file}:3:9: unknown format 'nvfp5' (did you mean 'nvfp4'?); formats in scope: "
        "bf16, fp16, fp32, mxfp4, mxfp6_e2m3, mxfp6_e3m2, mxfp8_e4m3, mxfp8_e5m2, nvfp4",
        "        * : nvfp5",
        "            ^",
    ]


# ------------------------------------------------------------------------------------------------
# 5. Recipe names resolve alike everywhere
# ------------------------------------------------------------------------------------------------


def test_find_recipe_rules(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    nvfp4 = SHIPPED_RECIPES / "nvfp4.fp4r"
    assert find_recipe("nvfp4") == nvfp4
    assert find_recipe("nvfp4.fp4r") == nvfp4
    assert find_recipe(Path("nvfp4")) == nvfp4
    # a bare shipped name wins over a file or folder of that name; ./ names the file
    write(tmp_path, "nvfp4", OPS)
    (tmp_path / "mxfp4").mkdir()
    assert find_recipe("nvfp4") == nvfp4
    assert find_recipe("mxfp4") == SHIPPED_RECIPES / "mxfp4.fp4r"
    assert find_recipe("./nvfp4") == Path("./nvfp4")
    # a .fp4r file here wins over the shipped one
    write(tmp_path, "mxfp8.fp4r", OPS)
    assert find_recipe("mxfp8.fp4r") == Path("mxfp8.fp4r")
    write(tmp_path, "mine", OPS)
    assert find_recipe("mine") == Path("mine")


@pytest.mark.parametrize("name", ["nvfp4", "nvfp4.fp4r", "mor_tensor"])
def test_every_entry_point_means_the_shipped_recipe(
    name: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.chdir(tmp_path)
    stem = name.removesuffix(".fp4r")
    path = SHIPPED_RECIPES / f"{stem}.fp4r"
    expected = load_recipe(path)
    assert load_recipe(name) == expected
    assert load_recipe(Path(name)) == expected
    code, out, err = run(capsys, "check", name)
    assert (code, out, err) == (0, f"ok  {name}  ({stem})\n", "")
    code, by_name, _ = run(capsys, "show", name, "--canonical")
    assert code == 0
    assert run(capsys, "show", str(path), "--canonical")[1] == by_name


def test_demo_recipes_resolve_like_show() -> None:
    pytest.importorskip("torch")
    from fp4gen.demo import train

    names = ("bf16", "nvfp4_small", "nvfp4_small.fp4r", str(SHIPPED_RECIPES / "nvfp4_small.fp4r"))
    loaded = train.load_recipes(names)
    expected = load_recipe(SHIPPED_RECIPES / "nvfp4_small.fp4r")
    assert loaded == {"bf16": None, **{name: expected for name in names[1:]}}
    with pytest.raises(RecipeError, match="^no such recipe file: nope/x.fp4r$"):
        train.load_recipes(("nope/x.fp4r",))


MISSING = [
    ("nope/x.fp4r", "no such recipe file: nope/x.fp4r"),
    ("x.fp4r", "no such recipe file: x.fp4r"),
    ("./nvfp4", "no such recipe file: ./nvfp4"),
    ("sub/nvfp4", "no such recipe file: sub/nvfp4"),
]


@pytest.mark.parametrize(("arg", "message"), MISSING, ids=[m[0] for m in MISSING])
def test_a_missing_path_is_a_missing_file(
    arg: str,
    message: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.chdir(tmp_path)
    calls = [find_recipe, load_recipe]
    if str(Path(arg)) == arg:  # Path("./nvfp4") is Path("nvfp4"), the shipped name
        calls.append(lambda a: load_recipe(Path(a)))
    for call in calls:
        with pytest.raises(RecipeError) as info:
            call(arg)
        assert str(info.value) == message
    assert run(capsys, "check", arg) == (1, "", message + "\n")
    assert run(capsys, "show", arg) == (1, "", f"fp4gen show: {message}\n")


def test_an_unknown_bare_name_lists_the_shipped_recipes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    message = (
        "no recipe named 'nvfp5' (did you mean 'nvfp4'?): it is neither a file nor a shipped "
        f"recipe (shipped: {', '.join(shipped_names())})"
    )
    with pytest.raises(RecipeError) as info:
        load_recipe("nvfp5")
    assert str(info.value) == message
    assert {"nvfp4", "mxfp4", "mor_tensor"} <= set(shipped_names())
    assert run(capsys, "show", "nvfp5") == (1, "", f"fp4gen show: {message}\n")


def test_a_directory_is_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "recipes.fp4r").mkdir()
    (tmp_path / "folder").mkdir()
    for arg in ("recipes.fp4r", "folder", str(tmp_path)):
        message = f"{arg} is a directory, not a recipe file"
        with pytest.raises(RecipeError) as info:
            load_recipe(arg)
        assert str(info.value) == message
        assert run(capsys, "check", arg) == (1, "", message + "\n")


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs on this platform")
def test_a_fifo_is_named_and_never_blocks(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    fifo = tmp_path / "pipe.fp4r"
    os.mkfifo(fifo)
    message = f"{fifo} is a FIFO (named pipe), not a recipe file"
    results: list[object] = []

    def attempt() -> None:
        for call in (
            lambda: load_recipe(str(fifo)),
            lambda: parse_recipe('extends "pipe"\n', base_dir=tmp_path),
            lambda: main(["show", str(fifo)]),
        ):
            try:
                results.append(call())
            except FP4GenError as exc:
                results.append(str(exc))

    worker = threading.Thread(target=attempt, daemon=True)
    worker.start()
    worker.join(timeout=20)
    assert not worker.is_alive(), "reading a FIFO blocked"
    assert results[0] == message
    assert results[1] == (
        f"<recipe>:1:9: cannot use 'pipe': {fifo} is a FIFO (named pipe), not a recipe file\n"
        '    extends "pipe"\n            ^'
    )
    assert results[2] == 1
    assert capsys.readouterr().err == f"fp4gen show: {message}\n"


@pytest.mark.parametrize(
    ("source", "text"),
    [
        ("operands { * : nvfp4 }", True),
        ("# just a comment", True),
        ("  recipe x", True),
        ("format x = nvfp4\n" + OPS, True),
        ("", True),
        ("nvfp4", False),
        ("nvfp4.fp4r", False),
        ("recipes/format.fp4r", False),
        ("format.fp4r", False),
        ("operands", False),
        ("my recipe.fp4r", False),
    ],
)
def test_the_text_or_name_rule(source: str, text: bool) -> None:
    assert is_recipe_text(source) is text


def test_load_recipe_still_takes_text() -> None:
    assert load_recipe("operands { * : mxfp4 }").name == "recipe"
    assert load_recipe("# c\n" + OPS) == parse_recipe(OPS)


# ------------------------------------------------------------------------------------------------
# 6. Unreadable files
# ------------------------------------------------------------------------------------------------


def test_a_file_that_is_not_utf8_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write(tmp_path, "latin1.fp4r", "# caf\u00e9\n".encode("latin-1") + OPS.encode())
    message = f"{path} is not UTF-8 text (byte 0xe9 at line 1, column 6): save it as UTF-8"
    with pytest.raises(RecipeError) as info:
        load_recipe(path)
    assert str(info.value) == message
    assert run(capsys, "check", str(path)) == (1, "", message + "\n")
    assert run(capsys, "show", str(path)) == (1, "", f"fp4gen show: {message}\n")


def test_permission_denied_is_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write(tmp_path, "locked.fp4r", OPS)
    real_open = os.open

    def denied(file: object, flags: int, *args: object) -> int:
        if Path(str(file)).name == "locked.fp4r":
            raise PermissionError(13, "Permission denied", str(file))
        return real_open(file, flags, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "open", denied)
    message = f"{path} cannot be read: permission denied"
    assert run(capsys, "check", str(path)) == (1, "", message + "\n")
    assert run(capsys, "show", str(path)) == (1, "", f"fp4gen show: {message}\n")
    with pytest.raises(RecipeError) as info:
        parse_recipe('import "locked"\n' + OPS, base_dir=tmp_path)
    located(info.value, 1, 8, f"cannot use 'locked': {message}")


@pytest.mark.skipif(
    not hasattr(os, "geteuid") or os.geteuid() == 0, reason="root reads files without permission"
)
def test_a_real_unreadable_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write(tmp_path, "locked.fp4r", OPS)
    path.chmod(0)
    try:
        code, out, err = run(capsys, "check", str(path))
    finally:
        path.chmod(0o644)
    assert (code, out, err) == (1, "", f"{path} cannot be read: permission denied\n")


def test_shipped_recipes_still_check(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "check", *(p.stem for p in SHIPPED))
    assert (code, err) == (0, "")
    assert out.count("ok  ") == len(SHIPPED)


# ------------------------------------------------------------------------------------------------
# 7. Byte order marks, files without statements, links that lead nowhere
# ------------------------------------------------------------------------------------------------

BOM = "\ufeff"
NEEDS = "a recipe needs at least an operands section, or an extends line"


def test_a_byte_order_mark_is_dropped_and_columns_stay(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    good = write(tmp_path, "good.fp4r", (BOM + "recipe marked\n" + OPS).encode())
    assert load_recipe(good) == parse_recipe("recipe marked\n" + OPS, file=str(good))
    assert run(capsys, "check", str(good)) == (0, f"ok  {good}  (marked)\n", "")
    # an error on the first line is at the column an editor shows, quoting no mark
    bad = write(tmp_path, "bad.fp4r", (BOM + "format x = nvfp5\n" + OPS).encode())
    with pytest.raises(RecipeError) as info:
        load_recipe(bad)
    assert (info.value.line, info.value.column) == (1, 12)
    assert str(info.value).splitlines()[1:] == ["    format x = nvfp5", "               ^"]
    # text and included files alike
    assert (
        load_recipe(BOM + "operands { * : mxfp4 }").operands
        == parse_recipe("operands { * : mxfp4 }").operands
    )
    child = parse_recipe('extends "good"\n', base_dir=tmp_path)
    assert child.operands == load_recipe(good).operands


NO_STATEMENTS = "has no statements, only blank lines and comments"
BLANK = [
    ("empty", b"", "is empty"),
    ("bom_only", BOM.encode(), "is empty"),
    ("cr_only", b"\r\r\r", NO_STATEMENTS),
    ("crlf_blanks", b"\r\n  \t\r\n\n", NO_STATEMENTS),
    ("comments", b"# a recipe, some day\n   # more\r\n", NO_STATEMENTS),
]


@pytest.mark.parametrize(("name", "data", "why"), BLANK, ids=[b[0] for b in BLANK])
def test_a_file_without_statements_says_so(
    name: str, data: bytes, why: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write(tmp_path, f"{name}.fp4r", data)
    message = f"{path} {why}: {NEEDS}"
    with pytest.raises(RecipeError) as info:
        load_recipe(path)
    assert str(info.value) == message
    assert run(capsys, "check", str(path)) == (1, "", message + "\n")
    assert run(capsys, "show", str(path)) == (1, "", f"fp4gen show: {message}\n")
    # extends and import read through the same loader
    for kind, column in (("extends", 9), ("import", 8)):
        err = error_of(f'{kind} "{name}"\n' + OPS, file=str(tmp_path / "main.fp4r"))
        located(err, 1, column, f"cannot use '{name}': {message}")
    # recipe text says so too
    text = data.decode("utf-8")
    assert str(error_of(text, file=str(path))) == message
    with pytest.raises(RecipeError) as info:
        parse_recipe(text)
    assert str(info.value) == f"<recipe>: the recipe text {why}: {NEEDS}"


def test_a_symbolic_link_loop_is_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    os.symlink("b.fp4r", tmp_path / "a.fp4r")
    os.symlink("a.fp4r", tmp_path / "b.fp4r")
    os.symlink("loopdir", tmp_path / "loopdir")  # a loop on the way to a file
    loop = "is a symbolic-link loop: following its links never reaches a file"
    for arg in ("a.fp4r", "loopdir/x.fp4r", str(tmp_path / "b.fp4r")):
        message = f"{arg} {loop}"
        with pytest.raises(RecipeError) as info:
            load_recipe(arg)
        assert str(info.value) == message
        assert run(capsys, "check", arg) == (1, "", message + "\n")
    for kind, column in (("extends", 9), ("import", 8)):
        err = error_of(f'{kind} "a"\n' + OPS, file=str(tmp_path / "main.fp4r"))
        located(err, 1, column, f"cannot use 'a': {tmp_path / 'a.fp4r'} {loop}")


def test_a_dangling_link_names_its_target(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    os.symlink("gone.fp4r", tmp_path / "link.fp4r")
    message = "link.fp4r is a symbolic link to gone.fp4r, which does not exist"
    assert run(capsys, "check", "link.fp4r") == (1, "", message + "\n")
    err = error_of('extends "link"\n', file=str(tmp_path / "main.fp4r"))
    located(
        err,
        1,
        9,
        f"cannot use 'link': {tmp_path / 'link.fp4r'} is a symbolic link to gone.fp4r, "
        "which does not exist",
    )


def test_bytes_that_are_not_utf8_are_placed_by_line_and_column(tmp_path: Path) -> None:
    # columns count characters (é is one), and a byte order mark is not one
    data = (BOM + OPS + "# caf\u00e9 ").encode() + b"\xff\n"
    path = write(tmp_path, "mixed.fp4r", data)
    with pytest.raises(RecipeError) as info:
        load_recipe(path)
    assert str(info.value) == (
        f"{path} is not UTF-8 text (byte 0xff at line 4, column 8): save it as UTF-8"
    )
    first = write(tmp_path, "first.fp4r", (BOM + "#").encode() + b"\xc3(\n")
    with pytest.raises(RecipeError, match=r"\(byte 0xc3 at line 1, column 2\)"):
        load_recipe(first)


def test_a_lone_carriage_return_is_named() -> None:
    err = error_of("recipe x\roperands {\r    * : nvfp4\r}\r")
    located(
        err,
        1,
        9,
        "a carriage return without a line feed: lines end with \\n or \\r\\n; save the file "
        "with Unix or Windows line endings",
    )


def test_a_folder_that_cannot_be_searched_is_not_a_missing_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write(tmp_path, "locked/r.fp4r", OPS)
    real_stat = os.stat

    def denied(file: object, *args: object, **kwargs: object) -> os.stat_result:
        if Path(str(file)).name == "r.fp4r":
            raise PermissionError(13, "Permission denied", str(file))
        return real_stat(file, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "stat", denied)
    message = f"{path} cannot be read: permission denied"
    assert run(capsys, "check", str(path)) == (1, "", message + "\n")
    err = error_of('import "locked/r"\n' + OPS, file=str(tmp_path / "main.fp4r"))
    located(err, 1, 8, f"cannot use 'locked/r': {message}")
