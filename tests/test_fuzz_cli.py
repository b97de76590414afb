"""Fuzz the command line: whatever the arguments, ``fp4gen.cli.main`` returns 0 or 1, or exits
through argparse (SystemExit 2 for a usage error, 0 for --help); no other exception (a
traceback) ever escapes, and an exit 1 comes with a message on stderr that holds no traceback.

Recipes come from mutations of the shipped ones (tokens deleted, inserted and replaced, huge
numbers, odd unicode, long strings, absurd block shapes), names from the shipped names, missing
paths and folders. ``compile`` and ``demo`` only get arguments that fail before a kernel
compiles or a model trains (guards below turn either into a failure); the kernel cache is a
fresh temporary folder. Every run works in a temporary folder, never in the repository.

FP4GEN_FUZZ_SCALE=N multiplies the examples (for a longer hunt; the default keeps the file
under a minute on 2 cores).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
from collections.abc import Sequence
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fp4gen.compiler.build
import fp4gen.demo.train
import fp4gen.experiments.sweep
from fp4gen.cli import DISTRIBUTIONS, main
from fp4gen.dsl.source import SHIPPED_RECIPES
from fp4gen.formats import BUILTIN_FORMATS

SHIPPED = sorted(SHIPPED_RECIPES.glob("*.fp4r"))
SHIPPED_NAMES = [p.stem for p in SHIPPED]
SHIPPED_TEXTS = [p.read_text() for p in SHIPPED]
SCALE = max(1, int(os.environ.get("FP4GEN_FUZZ_SCALE", "1")))
REAL_COMPILE_RECIPES = fp4gen.compiler.build.compile_recipes  # before the sandbox guards it


def fuzz(examples: int) -> settings:
    return settings(
        max_examples=examples * SCALE,
        deadline=None,
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
        derandomize=SCALE == 1,  # the default run is reproducible; a hunt explores
        database=None,
    )


# ---------------------------------------------------------------------------------------------
# running the CLI
# ---------------------------------------------------------------------------------------------


def invoke(argv: Sequence[str]) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of ``main(argv)``; any exception but SystemExit escapes
    (and fails the test). StringIO, unlike capsys, takes any str (a surrogate-escaped name)."""
    out, err = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(list(argv))
    except SystemExit as exc:
        # argparse: 2 for a usage error, 0 for --help
        assert exc.code in (0, 2), f"SystemExit({exc.code!r}) for {argv!r}"
        if exc.code == 2:
            assert "usage:" in err.getvalue(), err.getvalue()
        assert "Traceback" not in err.getvalue()
        return int(exc.code), out.getvalue(), err.getvalue()
    assert type(code) is int and code in (0, 1), f"main returned {code!r} for {argv!r}"
    if code == 1:
        assert err.getvalue().strip(), f"exit 1 without a message for {argv!r}"
        assert "Traceback" not in err.getvalue(), err.getvalue()
    return code, out.getvalue(), err.getvalue()


def strict_json(text: str) -> object:
    """json.loads that refuses NaN and Infinity tokens (the --json outputs are strict JSON)."""

    def refuse(token: str) -> None:
        raise AssertionError(f"non-strict JSON token {token}")

    return json.loads(text, parse_constant=refuse)


@pytest.fixture
def sandbox(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A temporary working folder and kernel cache; compiling a kernel or training fails."""
    root = tmp_path_factory.mktemp("fuzz")
    (root / "work").mkdir()
    monkeypatch.chdir(root / "work")
    monkeypatch.setenv("FP4GEN_CACHE_DIR", str(root / "cache"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(root / "xdg"))
    monkeypatch.delenv("FP4GEN_CHECK_FINITE", raising=False)

    def never(*args: object, **kwargs: object) -> None:
        raise AssertionError("the fuzz reached a kernel compile or a training run")

    monkeypatch.setattr(fp4gen.compiler.build, "compile_recipes", never)
    monkeypatch.setattr(fp4gen.demo.train, "stdlib_corpus", never)
    return root


_COUNTER = [0]


def fresh(root: Path, name: str) -> Path:
    """A new path under ``root`` (hypothesis reuses the fixture across examples)."""
    _COUNTER[0] += 1
    return root / f"{_COUNTER[0]}-{name}"


# ---------------------------------------------------------------------------------------------
# strategies
# ---------------------------------------------------------------------------------------------

# text a command line can carry: no lone surrogates but the surrogate-escaped bytes of a
# non-UTF-8 argument (\udc80-\udcff, what Python makes of them)
ODD = ["\x00", "\udcff", "\udc80", "\u202e", "\ufeff", "\u200b", "é", "ǅ", "𝟘", "٣", "\r", "\x0c"]
text = st.text(st.characters(blacklist_categories=("Cs",)) | st.sampled_from(ODD), max_size=40)
HUGE = "9" * 5000  # past int()'s 4300-digit limit


def words(text: str) -> list[str]:
    """The words of ``text``: long lists of plain tokens, written as a paragraph."""
    return text.split()


# words of the recipe language and absurd values (more, with white space, are listed below)
ODD_TOKENS = words(
    """
    0x16 1x99999999999999999999 65536x65536 16x0 -1x16 1x1 0x0 1024x1024 256x256 1x1024 x16
    16x 16xx16 1e308 -1 nan inf 1e999% 100000000000% 0% -5% 99999999999999999999999% e2m1 e0m0
    e99m99 e2m99999999999999999999 ue8m0 ue0m0 e4m3 fn rht 0 3 512 99999999999 signs seed te
    block scale global decide try else if relerr range mor extends import "nvfp4.fp4r"
    "missing.fp4r" "." "" "\\q" "unterminated { } {{ }} : :: * *.* # operands layers schedule
    first last blocks at step forward backward match "*lm_head" bf16 fp16 fp32 dynamic round
    stochastic stochastic8 nearest zero up down ocp é 𝟘 ٣ ǅ nvfp5 recipe
    """
)
TOKEN_POOL = sorted(
    {tok for t in SHIPPED_TEXTS for tok in re.findall(r"\S+", t)}
    | set(ODD_TOKENS)
    | {HUGE, HUGE + "%", '"' + "x" * 5000 + '"', "a" * 300, "\t", "\r", "\x0c", "\x00"}
    | {"\ufeff", "\u202e", "\x1b[31m"}
)
NUMBERS = [*words("0 -1 1 3 7 1023 1025 65536 99999999999999999999 1e308 00 0.5 -0 ٣ 𝟘"), HUGE]
SHAPE_WORDS = words(
    """
    0x16 16x0 1x99999999999999999999 65536x65536 512x512 1x1025 99999999999999999999x1 -1x16
    16x-1 x16 16x 1x1 ٣x٣ 16X16
    """
)


def _number_like(draw: st.DrawFn, part: str) -> str:
    """``part`` with its digits replaced: a shape by an odd shape, a number by an odd number."""
    if re.fullmatch(r"\d+x\d+", part):
        return draw(st.sampled_from(SHAPE_WORDS))
    return re.sub(r"\d+(\.\d+)?", lambda _: draw(st.sampled_from(NUMBERS)), part, count=1)


@st.composite
def mutated_recipe(draw: st.DrawFn) -> str:
    """A shipped recipe with a few tokens deleted, inserted or replaced, or a number or a block
    shape in it made absurd."""
    base = draw(st.sampled_from(SHIPPED_TEXTS))
    parts = re.findall(r"\S+|\s+", base)
    numeric = [i for i, part in enumerate(parts) if re.search(r"\d", part)]
    token = st.sampled_from(TOKEN_POOL) | text
    for _ in range(draw(st.integers(1, 6))):
        i = draw(st.integers(0, len(parts)))
        ops = ["delete", "insert", "replace", "newline", "repeat", "number", "number"]
        op = draw(st.sampled_from(ops))
        if op == "delete" and i < len(parts):
            del parts[i]
        elif op == "insert":
            parts[i:i] = [" ", draw(token), " "]
        elif op == "replace" and i < len(parts):
            parts[i] = draw(token)
        elif op == "newline":
            parts.insert(i, "\n")
        elif op == "repeat" and i < len(parts):
            parts.insert(i, parts[i] * draw(st.integers(2, 200)))
        elif op == "number" and numeric:
            j = draw(st.sampled_from(numeric))
            if j < len(parts):
                parts[j] = _number_like(draw, parts[j])
    return "".join(parts)


@st.composite
def recipe_file(draw: st.DrawFn, root: Path) -> str:
    """The path of a mutated recipe, sometimes written with bytes that are not UTF-8."""
    path = fresh(root, "r" + draw(st.sampled_from([".fp4r", ".txt", ""])))
    data = draw(mutated_recipe()).encode("utf-8", "surrogateescape")
    if draw(st.booleans()) and draw(st.booleans()):
        at = draw(st.integers(0, len(data)))
        bad = draw(st.sampled_from([b"\xff", b"\xc3", b"\x00", b"\xed\xa0\x80"]))
        data = data[:at] + bad + data[at:]
    path.write_bytes(data)
    return str(path)


def recipe_name(root: Path) -> st.SearchStrategy[str]:
    """Names of recipes: shipped, missing, folders, odd text."""
    folder = root / "a-folder.fp4r"
    folder.mkdir(exist_ok=True)
    return st.one_of(
        st.sampled_from(SHIPPED_NAMES),
        st.sampled_from([f"{n}.fp4r" for n in SHIPPED_NAMES]),
        st.sampled_from(
            [
                "missing",
                "missing.fp4r",
                "no/such/dir/x.fp4r",
                str(root / "nope.fp4r"),
                str(root),
                str(folder),
                "",
                " ",
                ".",
                "..",
                "./nvfp4",
                "nvfp4\x00",
                "\udcff.fp4r",
                "a" * 5000,
                "a" * 300 + ".fp4r",
                "bf16",
                "-",
            ]
        ),
        text,
        recipe_file(root),
    )


# ---------------------------------------------------------------------------------------------
# check and show
# ---------------------------------------------------------------------------------------------


@fuzz(400)
@given(data=st.data())
def test_fuzz_check_and_show(sandbox: Path, data: st.DataObject) -> None:
    names = data.draw(st.lists(recipe_name(sandbox), min_size=1, max_size=3), label="names")
    command = data.draw(st.sampled_from(["check", "show"]), label="command")
    if command == "check":
        argv = ["check", *data.draw(st.sampled_from([[], ["-q"]])), *names]
    else:
        flags = data.draw(
            st.sampled_from([[], ["--json"], ["--canonical"], ["--json", "--canonical"]])
        )
        argv = ["show", names[0], *flags]
    code, out, _ = invoke(argv)
    if command == "show" and code == 0 and "--json" in argv:
        strict_json(out)


# ---------------------------------------------------------------------------------------------
# error
# ---------------------------------------------------------------------------------------------

SIZES = ["-1", "0", "1", "2", "3", "16", "17", "33", "99999999", "99999999999999999999", HUGE]
SHAPES = st.one_of(
    st.builds(lambda r, c: f"{r}x{c}", st.sampled_from(SIZES), st.sampled_from(SIZES)),
    st.sampled_from(["", " 3x3 "]),
    st.sampled_from(
        words(
            """
            0x5 -1x2 99999999x99999999 axb 3 x 1x1x1 3X3 ٣x٣ 3x x3 +3x+3 3_0x3 1e3x1 nanxnan
            infxinf 8193x8193
            """
        )
    ),
    text,
)


def cheap(shape: str) -> bool:
    """Not a valid shape of many elements (the fuzz measures tiny tensors only)."""
    try:
        rows, cols = (int(v) for v in shape.lower().split("x"))
    except ValueError:
        return True
    return not (rows >= 1 and cols >= 1 and 4096 < rows * cols <= 1 << 26)


def option(draw: st.DrawFn, flag: str, value: str) -> list[str]:
    """``--flag value``, or ``--flag=value`` (how a value starting with '-' reaches the type)."""
    return [f"{flag}={value}"] if draw(st.booleans()) else [flag, value]


def tensor_files(root: Path) -> list[str]:
    """Saved tensors a user may pass to --tensor: odd dtypes, shapes and values."""
    import numpy as np
    import torch

    folder = root / "tensors"
    if not folder.is_dir():
        folder.mkdir()
        items = {
            "scalar.pt": torch.tensor(1.5),
            "empty.pt": torch.zeros(0, 3),
            "nonfinite.pt": torch.tensor([[1.0, float("nan")], [float("inf"), 2.0]]),
            "bool.pt": torch.ones(3, dtype=torch.bool),
            "complex.pt": torch.ones(2, 2, dtype=torch.complex64),
            "wide.pt": torch.full((2, 17), 1e300, dtype=torch.float64),
            "int.pt": torch.full((3, 5), 2**62, dtype=torch.int64),
            "half.pt": torch.randn(4, 33, dtype=torch.float16),
            "nd.pt": torch.randn(2, 3, 2, 17),
            "row.pt": torch.randn(40),
            "two.pt": {"a": torch.ones(2), "b": torch.ones(2)},
            "list.pt": [1, 2, 3],
        }
        for name, obj in items.items():
            torch.save(obj, folder / name)
        np.save(folder / "object.npy", np.array([{"a": 1}], dtype=object), allow_pickle=True)
        np.save(folder / "u8.npy", np.arange(48, dtype=np.uint8).reshape(3, 16))
        (folder / "garbage.pt").write_bytes(b"PK\x03\x04" + bytes(range(60)))
    return sorted(str(p) for p in folder.iterdir())


@st.composite
def error_argv(draw: st.DrawFn, root: Path) -> list[str]:
    target = draw(
        st.one_of(
            st.sampled_from(sorted(BUILTIN_FORMATS)),
            st.sampled_from(["nvfp5", "mxfp3", "NVFP4", "e2m1", "fp8", "int4", ""]),
            st.sampled_from(SHIPPED_NAMES),
            text,
            recipe_file(root),
        )
    )
    argv = ["error", target]
    odd = draw(st.integers(0, 3)) == 0  # one draw in four: a bogus value where it may go
    if draw(st.booleans()):
        dist = st.sampled_from(DISTRIBUTIONS)
        if odd:
            dist = st.sampled_from(["cauchy", "", "Normal"]) | text
        argv += option(draw, "--dist", draw(dist))
    if draw(st.booleans()):
        size = st.sampled_from(["1", "2", "3", "16", "17", "33"]) | st.sampled_from(SIZES)
        shape = SHAPES if odd else st.builds("{}x{}".format, size, size)
        argv += option(draw, "--shape", draw(shape.filter(cheap)))
    else:
        argv += ["--shape", "16x33"]  # the default, 1024x1024, is slow for a fuzz
    if draw(st.booleans()):
        seed = st.integers(-(2**70), 2**70).map(str)
        if odd:
            seed = seed | st.sampled_from(["-0", "1e3", "0x10", "abc", "", HUGE])
        argv += option(draw, "--seed", draw(seed))
    if draw(st.booleans()):
        argv.append("--json")
    if draw(st.integers(0, 4)) == 0:
        garbage = fresh(root, draw(st.sampled_from(["t.pt", "t.npy", "t"])))
        garbage.write_bytes(draw(st.binary(max_size=64)))
        odd_paths = [str(garbage), str(root), "missing.pt", "\x00", "\udcff"]
        argv += ["--tensor", draw(st.sampled_from([*odd_paths, *tensor_files(root)]))]
    return argv


@fuzz(350)
@given(data=st.data())
def test_fuzz_error(sandbox: Path, data: st.DataObject) -> None:
    argv = data.draw(error_argv(sandbox), label="argv")
    code, out, _ = invoke(argv)
    if code == 0 and "--json" in argv:
        strict_json(out)


# ---------------------------------------------------------------------------------------------
# formats and cache
# ---------------------------------------------------------------------------------------------


@fuzz(10)
@given(extra=st.sampled_from([[], ["--json"], ["--json", "--json"], ["--bogus"], ["x"]]))
def test_fuzz_formats(sandbox: Path, extra: list[str]) -> None:
    code, out, _ = invoke(["formats", *extra])
    if code == 0 and "--json" in extra:
        assert set(strict_json(out)) == set(BUILTIN_FORMATS)  # type: ignore[arg-type]


@fuzz(150)
@given(data=st.data())
def test_fuzz_cache(sandbox: Path, data: st.DataObject, monkeypatch: pytest.MonkeyPatch) -> None:
    cache = fresh(sandbox, "cache")
    state = data.draw(st.sampled_from(["absent", "empty", "marked", "file"]), label="state")
    if state == "file":
        cache.write_text("not a folder")
    elif state != "absent":
        cache.mkdir()
        (cache / "user-file.txt").write_text("keep me")
        if state == "marked":
            (cache / ".fp4gen-cache").write_text("")
            (cache / "v1" / "kernels").mkdir(parents=True)
    monkeypatch.setenv("FP4GEN_CACHE_DIR", str(cache))
    action = data.draw(st.sampled_from(["info", "clear", "bogus", ""]), label="action")
    argv = ["cache", action]
    if data.draw(st.booleans()):
        argv.append("--json")
    if data.draw(st.integers(0, 3)) == 0:
        argv += [
            "--cache-dir",
            data.draw(
                st.sampled_from([str(cache), "\x00", "a\x00b", "~no-such-user-fp4gen/x", "\udcff"])
                # relative to the sandbox: never the home folder or the file-system root
                | text.filter(lambda s: not s.startswith(("/", "~")) and ".." not in s)
            ),
        ]
    code, out, _ = invoke(argv)
    if "--json" in argv and code in (0, 1):
        doc = strict_json(out)
        assert isinstance(doc, dict) and ("error" in doc) == (code == 1)
    if state != "file":
        assert not cache.is_file()
    if state in ("empty", "marked"):
        assert (cache / "user-file.txt").read_text() == "keep me"  # never removed


# ---------------------------------------------------------------------------------------------
# compile and demo: invalid arguments only
# ---------------------------------------------------------------------------------------------


@st.composite
def compile_argv(draw: st.DrawFn, root: Path) -> list[str]:
    """compile arguments with at least one fault that stops it before any kernel compiles."""
    recipes = draw(st.lists(st.sampled_from(SHIPPED_NAMES), min_size=0, max_size=2))
    out = str(fresh(root, "out"))
    faults = [
        option(draw, "--jobs", draw(st.sampled_from(["-3", "0", "x", "", "1.5", HUGE]))),
        option(draw, "--arch", draw(st.sampled_from(["bogus", "", ",", "sm_90", "SM_90A"]))),
        option(draw, "--arch", "sm_90a,bogus"),
        option(draw, "--input-dtype", draw(st.sampled_from(["fp8", "", "BF16"]))),
        option(draw, "--out", draw(st.sampled_from(["\x00", "a\x00b"]))),
        option(draw, "--cache-dir", draw(st.sampled_from(["\x00", "~no-such-user-fp4gen/x"]))),
        [draw(st.sampled_from(["missing.fp4r", "no/such.fp4r", str(root), "", "\x00"]))],
        ["--bogus-flag"],
        ["--help"],
    ]
    chosen = draw(st.lists(st.sampled_from(faults), min_size=1, max_size=3))
    extras = draw(
        st.lists(
            st.sampled_from([["--no-compile"], ["--keep-ptx"], ["--no-timings"], ["--out", out]]),
            max_size=2,
        )
    )
    argv = ["compile", *recipes]
    # a later option overrides an earlier one: the faults come last
    for piece in [*extras, *draw(st.permutations(chosen))]:
        argv += piece
    return argv


@fuzz(150)
@given(data=st.data())
def test_fuzz_compile_fails_before_compiling(sandbox: Path, data: st.DataObject) -> None:
    argv = data.draw(compile_argv(sandbox), label="argv")
    code, out, err = invoke(argv)
    if "--help" in argv and code == 0:
        assert "usage: fp4gen compile" in out
    else:
        assert code in (1, 2), (argv, out, err)


@st.composite
def demo_argv(draw: st.DrawFn, root: Path) -> list[str]:
    """demo arguments with at least one fault that stops it before a model trains."""
    bad_recipe = draw(recipe_file(root))
    recipes = st.sampled_from(["bogus", "", ",", " , ", "bf16,bogus", "nvfp4,\x00"])
    faults = [
        option(draw, "--lr", draw(st.sampled_from(["nan", "inf", "-inf", "-1", "0", "x", ""]))),
        option(draw, "--steps", draw(st.sampled_from(["0", "-5", "x", "1.5"]))),
        option(draw, "--batch", draw(st.sampled_from(["0", "-1"]))),
        option(draw, "--eval-every", "0"),
        option(draw, "--telemetry", "-1"),
        option(draw, "--time-budget", draw(st.sampled_from(["-1", "0", "nan", "inf", "-inf"]))),
        option(draw, "--seed", draw(st.sampled_from(["-1", str(2**64), HUGE]))),
        option(draw, "--size", draw(st.sampled_from(["huge", ""]))),
        option(draw, "--device", draw(st.sampled_from(["tpu", ""]))),
        option(draw, "--recipes", draw(recipes)),
        option(draw, "--recipes", "missing.fp4r,bf16"),
        [*option(draw, "--out", draw(st.sampled_from(["\x00", "a\x00b"]))), "--recipes", "bogus"],
        ["--help"],
    ]
    # a mutated recipe file may still be valid: only alongside a fault
    extras = [["--steps", "1"], ["--size", "tiny"], ["--out", str(fresh(root, "demo"))]]
    extras.append(["--recipes", f"bf16,{bad_recipe}"])
    chosen = draw(st.lists(st.sampled_from(faults), min_size=1, max_size=3))
    extra = draw(st.lists(st.sampled_from(extras), max_size=2))
    argv = ["demo"]
    # a later --recipes overrides an earlier one: the faults come last
    for piece in [*extra, *chosen]:
        argv += piece
    return argv


@fuzz(150)
@given(data=st.data())
def test_fuzz_demo_fails_before_training(sandbox: Path, data: st.DataObject) -> None:
    argv = data.draw(demo_argv(sandbox), label="argv")
    code, out, err = invoke(argv)
    if "--help" in argv and code == 0:
        assert "usage: fp4gen demo" in out
    else:
        assert code in (1, 2), (argv, out, err)


# ---------------------------------------------------------------------------------------------
# report
# ---------------------------------------------------------------------------------------------

HIST = [1] * 41
RECORD_VALUES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    text,
    st.lists(st.integers(-3, 3), max_size=45),
    st.just(HIST),
    st.just([1e308] * 41),
    st.just({"nested": [1]}),
)
unit = st.floats(0, 1)
VALID = {  # what fp4gen.telemetry writes, field by field
    "recipe": st.sampled_from(["mor_tensor", "mor_subtensor_3way", ""]),
    "layer": st.sampled_from(["blocks.0.attn", "blocks.1.mlp", "lm_head"]),
    "operand": st.sampled_from(["fprop.activation", "wgrad.gradient", "other"]),
    "rel_error_hist": st.lists(
        st.integers(0, 10**6) | st.floats(0, 1e308), min_size=41, max_size=41
    ),
    "mean_rel_error": st.floats(allow_nan=True, allow_infinity=True),
    "fallback": unit | st.none(),
    "units": st.integers(0, 2**53 - 1),
    "step": st.integers(0, 10**6),
    "call": st.integers(0, 10**6),
    "mor": st.sampled_from(["m", "tensor"]),
    "threshold": st.floats(0, 1, exclude_min=True, exclude_max=True) | st.none(),
}


@st.composite
def telemetry_record(draw: st.DrawFn) -> dict[str, object]:
    """Fields of the right kind, and in one record of three a field holding anything."""
    record = draw(st.fixed_dictionaries({}, optional=VALID))
    if draw(st.integers(0, 2)) == 0:
        record[draw(st.sampled_from(sorted(VALID)))] = draw(RECORD_VALUES)
    return record


@st.composite
def telemetry_file(draw: st.DrawFn, root: Path) -> str:
    path = fresh(root, "t.json")
    kind = draw(st.sampled_from(["records", "wrapped", "raw", "bytes", "deep", "bigint"]))
    if kind in ("records", "wrapped"):
        base = {"layer": "blocks.0.attn", "operand": "fprop.activation", "mean_rel_error": 0.01}
        records = [{**base, **r} for r in draw(st.lists(telemetry_record(), max_size=5))]
        doc: object = records if kind == "records" else {"records": records}
        path.write_text(json.dumps(doc))  # NaN and Infinity tokens, as json.dump writes them
    elif kind == "raw":
        raw = st.sampled_from(["[", "{}", "null", "[1, 2]", '{"records": 3}'])
        path.write_text(draw(text | raw), errors="surrogateescape")
    elif kind == "bytes":
        path.write_bytes(draw(st.binary(max_size=64)))
    elif kind == "deep":
        depth = draw(st.sampled_from([10, 900, 5000, 100_000]))
        path.write_text("[" * depth + "]" * depth)
    else:
        path.write_text(f'[{{"layer": "a", "operand": "b", "mean_rel_error": {HUGE}}}]')
    return str(path)


@fuzz(300)
@given(data=st.data())
def test_fuzz_report(sandbox: Path, data: st.DataObject) -> None:
    source = data.draw(
        telemetry_file(sandbox)
        | st.sampled_from(["missing.json", str(sandbox), "\x00", "\udcff.json", ""]),
        label="json",
    )
    argv = ["report", source]
    if data.draw(st.booleans()):
        argv += ["--by", data.draw(st.sampled_from(["layer", "operand", "bogus"]))]
    if data.draw(st.booleans()):
        argv += ["--recipe", data.draw(text)]
    if data.draw(st.booleans()):
        argv.append("--json")
    # drawing a PNG takes a second: most runs print only, a few write (or fail to write) one
    if data.draw(st.integers(0, 9)) == 0:
        outs = ["h.png", "h.txt", "h", ".", "\x00", "a\x00.png", "d/h.svg"]
        out = data.draw(st.sampled_from(outs))
        argv += ["--out", str(fresh(sandbox, out)) if out not in (".", "\x00") else out]
    else:
        argv.append("--no-png")
    invoke(argv)


# ---------------------------------------------------------------------------------------------
# regressions the fuzz found: each was a traceback out of main()
# ---------------------------------------------------------------------------------------------


def test_report_rejects_a_nul_byte_in_the_json_path(sandbox: Path) -> None:
    code, _, err = invoke(["report", "a\x00.json", "--no-png"])
    assert code == 1 and "no NUL byte" in err


def test_report_rejects_a_file_that_is_not_utf8(sandbox: Path) -> None:
    (sandbox / "bin.json").write_bytes(b"\xff\xfe\x00garbage")
    code, _, err = invoke(["report", str(sandbox / "bin.json"), "--no-png"])
    assert code == 1 and "not UTF-8" in err


def test_report_rejects_json_nested_too_deeply(sandbox: Path) -> None:
    (sandbox / "deep.json").write_text("[" * 100_000)
    code, _, err = invoke(["report", str(sandbox / "deep.json"), "--no-png"])
    assert code == 1 and "nests too deeply" in err


def test_report_rejects_an_integer_past_the_digit_limit(sandbox: Path) -> None:
    (sandbox / "big.json").write_text(HUGE)
    code, _, err = invoke(["report", str(sandbox / "big.json"), "--no-png"])
    assert code == 1 and "4300 digits" in err


@pytest.mark.parametrize(
    ("field", "value", "rule"),
    [
        ("rel_error_hist", ["x"] * 41, "a list of finite, non-negative counts"),
        ("rel_error_hist", 5, "a list of finite, non-negative counts"),
        ("rel_error_hist", [float("inf")] * 41, "a list of finite, non-negative counts"),
        ("mean_rel_error", "abc", "a number"),
        ("mean_rel_error", None, "a number"),
        ("mean_rel_error", 10**400, "a number"),
        ("fallback", "x", "a number"),
        ("units", "x", "a count of decision units from 0 to 2^53"),
        ("units", 1e308, "a count of decision units from 0 to 2^53"),
        ("step", [1], "a finite number"),
        ("threshold", 5, "a relative error between 0 and 1"),
        ("threshold", float("nan"), "a relative error between 0 and 1"),
        ("layer", [[1]], "a name (a string or a number)"),
    ],
)
def test_report_names_the_record_field_and_rule(
    sandbox: Path, field: str, value: object, rule: str
) -> None:
    record = {"layer": "a", "operand": "b", "mor": "m", "rel_error_hist": HIST, "fallback": 0.5}
    record[field] = value
    path = sandbox / "t.json"
    path.write_text(json.dumps([{"layer": "a", "operand": "b", "mean_rel_error": 0.1}, record]))
    code, _, err = invoke(["report", str(path), "--no-png"])
    assert code == 1
    assert f"telemetry record 1: {field!r} must be {rule}" in err
    assert len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("error", [8.98846567431158e305, -1e308, 1.7e308])
def test_report_bins_a_huge_finite_mean_error(sandbox: Path, error: float) -> None:
    # error * 200 overflows to inf: an OverflowError out of int() before the fix
    from fp4gen.report import BINS, error_bin

    assert error_bin(error) == (BINS - 1 if error > 0 else 0)
    path = sandbox / "t.json"
    path.write_text(json.dumps([{"layer": "a", "operand": "b", "mean_rel_error": error}]))
    assert invoke(["report", str(path), "--no-png"])[0] == 0


def test_report_accepts_a_non_finite_mean_error(sandbox: Path) -> None:
    # what json.dump writes for a NaN or an Inf input: it lands in the last bin, as before
    path = sandbox / "t.json"
    path.write_text('[{"layer": "a", "operand": "b", "mean_rel_error": NaN}]')
    assert invoke(["report", str(path), "--no-png"])[0] == 0


@pytest.mark.parametrize(
    ("out", "message"),
    [
        ("h.txt", "matplotlib cannot write .txt images"),
        (".", "names no file"),
        ("a\x00.png", "no NUL byte"),
    ],
)
def test_report_rejects_an_unusable_out_before_reading(
    sandbox: Path, out: str, message: str
) -> None:
    code, _, err = invoke(["report", "missing.json", "--out", out])
    assert code == 1 and message in err and "--out" in err


def test_cache_rejects_a_nul_byte_in_cache_dir(sandbox: Path) -> None:
    for action in ("info", "clear"):
        code, out, err = invoke(["cache", action, "--cache-dir", "a\x00b", "--json"])
        assert code == 1 and "--cache-dir" in err and "no NUL byte" in err
        assert "no NUL byte" in strict_json(out)["error"]  # type: ignore[index]


def test_cache_rejects_the_home_of_an_unknown_user(sandbox: Path) -> None:
    code, _, err = invoke(["cache", "info", "--cache-dir", "~no-such-user-fp4gen/x"])
    assert code == 1 and "cannot expand its '~'" in err


def test_cache_dir_empty_is_the_default(sandbox: Path) -> None:
    code, out, _ = invoke(["cache", "info", "--cache-dir", "", "--json"])
    assert code == 0 and strict_json(out)["location"] == os.environ["FP4GEN_CACHE_DIR"]  # type: ignore[index]


@pytest.mark.parametrize(
    ("flag", "value"),
    [("--out", "a\x00b"), ("--cache-dir", "\x00"), ("--cache-dir", "~no-such-user-fp4gen")],
)
def test_compile_rejects_an_unusable_folder_before_loading(
    sandbox: Path, flag: str, value: str
) -> None:
    code, _, err = invoke(["compile", "nvfp4", flag, value])
    assert code == 1 and flag in err


def test_demo_rejects_a_nul_byte_in_out(sandbox: Path) -> None:
    code, _, err = invoke(["demo", "--out", "a\x00b", "--recipes", "bogus"])
    assert code == 1 and "--out" in err and "no NUL byte" in err


# ---------------------------------------------------------------------------------------------
# recipe files with a byte order mark, without statements or behind links; a reader that leaves
# ---------------------------------------------------------------------------------------------

BLANK_PIECES = ["", " ", "\n", "\r", "\r\n", "\t", "\f", "# a comment", "#", "  # x\n"]


@st.composite
def marked_blank_or_linked(draw: st.DrawFn, root: Path) -> tuple[str, str, str | None]:
    """(argument, how it is reached, the shipped text it holds or None for a file without
    statements): a shipped recipe or blanks and comments, with or without a byte order mark,
    with \\n or \\r\\n line ends, named directly, through a link, a link loop or a dangling link."""
    shipped = draw(st.sampled_from([None, *SHIPPED_TEXTS]))
    if shipped is not None:
        text = shipped.replace("\n", draw(st.sampled_from(["\n", "\r\n"])))
    else:
        text = "".join(draw(st.lists(st.sampled_from(BLANK_PIECES), max_size=6)))
    path = fresh(root, "r.fp4r")
    path.write_bytes((draw(st.sampled_from(["", "\ufeff"])) + text).encode())
    how = draw(st.sampled_from(["file", "link", "loop", "dangling"]))
    if how == "file":
        return str(path), how, shipped
    link = fresh(root, "link.fp4r")
    if how == "link":
        os.symlink(path, link)
    elif how == "loop":
        os.symlink(link, link)
    else:
        os.symlink(root / "gone.fp4r", link)
    return str(link), how, shipped


def invoke_closed_stdout(argv: Sequence[str]) -> tuple[int, str]:
    """(exit status, stderr) of ``main(argv)`` writing to a pipe whose reader is gone."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    stream = open(write_end, "w", encoding="utf-8", errors="surrogateescape")  # noqa: SIM115
    err = io.StringIO()
    try:
        with contextlib.redirect_stdout(stream), contextlib.redirect_stderr(err):
            code = main(list(argv))
    finally:
        with contextlib.suppress(OSError):  # main pointed the descriptor at the null device
            stream.close()
    return code, err.getvalue()


@fuzz(120)
@given(data=st.data())
def test_fuzz_marked_blank_and_linked_recipes(sandbox: Path, data: st.DataObject) -> None:
    arg, how, shipped = data.draw(marked_blank_or_linked(sandbox), label="recipe")
    argv = data.draw(
        st.sampled_from([["check", arg], ["show", arg], ["show", arg, "--json"]]), label="argv"
    )
    code, out, err = invoke(argv)
    if how == "loop":
        assert code == 1 and "is a symbolic-link loop" in err
    elif how == "dangling":
        assert code == 1 and "which does not exist" in err
    elif shipped is None:
        assert code == 1 and ("is empty" in err or "has no statements" in err)
    else:  # a byte order mark and \r\n line ends change nothing
        assert code == 0, err
        from fp4gen.dsl import load_recipe, parse_recipe

        assert load_recipe(arg).operands == parse_recipe(shipped, base_dir=SHIPPED_RECIPES).operands
    if code == 1:  # one line naming the file (what a working link leads to: the file read)
        named = arg if how != "link" else os.path.realpath(arg)
        assert len(err.strip().splitlines()) == 1 and named in err, err
    # the same command with a reader that has left: quiet, 141 where it had output
    closed, closed_err = invoke_closed_stdout(argv)
    assert (closed, closed_err) == ((141, "") if out else (code, err))


# every command that writes files: a symbolic link where one of its files goes is refused
WRITERS: dict[str, tuple[str, ...]] = {
    "compile": ("manifest.json", "quant_e2m1_1x16_e4m3rn_g_bf16_row_rne.py"),
    "export": ("model.safetensors", "hf_quant_config.json", "model.safetensors.index.json"),
    "demo": ("losses.csv", "summary.json", "telemetry.json", "losses.png"),
    "sweep": ("summary.json", "losses.csv", "gap_to_bf16.png", "runs/bf16__seed0.json"),
    "report": ("heat.png", "heat_fallback.png"),
}


def writer_argv(command: str, root: Path, out: Path) -> list[str]:
    """Arguments of ``command`` that write into ``out`` and fail before any real work."""
    if command == "compile":
        return ["compile", "nvfp4", "--out", str(out), "--no-compile", "--arch", "sm_100a"]
    if command == "export":
        weights = root / "weights.pt"
        if not weights.exists():
            import torch

            torch.save({"blocks.0.fc.weight": torch.ones(32, 32)}, weights)
        return ["export", str(weights), "--recipe", "nvfp4_no_bf16", "--out", str(out)]
    if command == "demo":
        return ["demo", "--recipes", "bf16", "--device", "cpu", "--out", str(out)]
    if command == "sweep":
        return ["sweep", "nvfp4_small", "--seeds", "1", "--device", "cpu", "--out", str(out)]
    telemetry = root / "telemetry.json"
    telemetry.write_text("[]")
    return ["report", str(telemetry), "--out", str(out / "heat.png")]


@fuzz(40)
@given(data=st.data())
def test_fuzz_writing_commands_refuse_links(
    sandbox: Path, data: st.DataObject, monkeypatch: pytest.MonkeyPatch
) -> None:
    import sys

    from fp4gen.compiler import cache, jit

    tests = str(Path(__file__).resolve().parent)
    sys.path.insert(0, tests)
    try:
        from kernel_stub import render_stub
    finally:
        sys.path.remove(tests)

    def no_gemm(spec: object) -> str:
        raise NotImplementedError("no GEMM template in this test")

    # compile renders (the stub template) and writes, but compiles nothing (--no-compile)
    monkeypatch.setattr(fp4gen.compiler.build, "compile_recipes", REAL_COMPILE_RECIPES)
    monkeypatch.setattr(jit, "render_source", render_stub)
    monkeypatch.setattr(jit, "render_gemm_source", no_gemm)
    monkeypatch.setattr(cache, "template_version", lambda: "stub")

    def no_training(*args: object, **kwargs: object) -> None:
        raise AssertionError("a sweep run started before its files were checked")

    monkeypatch.setattr(fp4gen.experiments.sweep, "train_run", no_training)

    command = data.draw(st.sampled_from(sorted(WRITERS)), label="command")
    name = data.draw(st.sampled_from(WRITERS[command]), label="name")
    how = data.draw(st.sampled_from(["file", "dangling", "folder", "loop"]), label="link")
    root = fresh(sandbox, "w")
    out = root / "out"
    (out / "runs").mkdir(parents=True)
    victim = root / "users-file"
    victim.write_text("precious")
    link = out / name
    target = {"file": victim, "dangling": root / "gone", "folder": root, "loop": link}[how]
    os.symlink(target, link)
    before = sorted(p.name for p in out.rglob("*"))

    code, _, err = invoke(writer_argv(command, root, out))
    assert code == 1, err
    assert len(err.strip().splitlines()) == 1 and f"{link} is a symbolic link" in err, err
    assert victim.read_text() == "precious" and not (root / "gone").exists()
    assert sorted(p.name for p in out.rglob("*")) == before  # nothing written, no temporary
