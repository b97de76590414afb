"""The recipe fuzzer: recipes drawn over the whole grammar (``tests/recipe_strategies.py``) run
correctly on every path that can serve them.

For every drawn recipe (with its ``extends``/``import``/``recipe "..."`` files in a temporary
folder):

1. it resolves to the operands the cascade promises, and ``parse(print(r)) == r``;
2. ``fp4gen check`` accepts it, or refuses it with ``file:line:column``, the offending source
   line and a documented reason (the one refusal drawn on purpose: a global amax scale that the
   element and scale formats cannot carry);
3. ``fp4gen.compiler`` plans it: every kernel of the quantize plan and of the runtime plan
   renders for sm_90a and sm_100a or carries the reason it does not (the runtime then takes the
   stand-ins or the reference), and every GEMM of every context names what runs it on both archs
   (a fallback with its reason); a few cross-compile one randomly chosen quantize kernel;
4. the reference quantizer keeps its invariants on every operand format: finite scales and
   values, the rounding error bound, unbiased stochastic rounding.

Invalid recipes come from mutations of drawn ones: every rejection names file, line and column
and quotes the line; nothing raises a traceback.

The default run is derandomized (the same examples every time) and takes about a minute on two
cores. ``FP4GEN_FUZZ_EXAMPLES=N`` runs N examples per test with a fresh random seed, printed at
the start of each test (``FP4GEN_FUZZ_SEED=S`` replays seed S).
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import math
import os
import random
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, Phase, assume, given, note, seed, settings
from hypothesis import strategies as st

from fp4gen.cli import main
from fp4gen.compiler.build import prepare_builds
from fp4gen.compiler.jit import ARCHS
from fp4gen.dsl import load_recipe, parse_recipe, print_recipe
from fp4gen.dsl.model import Operand, Recipe
from fp4gen.errors import FP4GenError
from fp4gen.formats import FLT_MAX, BlockFormat, ElementFormat, ScaleSpec, sr_bits
from fp4gen.numerics.hadamard import rht
from fp4gen.numerics.quantize import QuantizedTensor, quantize

sys.path.insert(0, str(Path(__file__).resolve().parent))
from recipe_strategies import REFUSALS, RecipeCase, recipe_cases  # noqa: E402

sys.path.remove(str(Path(__file__).resolve().parent))

HUNT = "FP4GEN_FUZZ_EXAMPLES" in os.environ
SEED = int(os.environ.get("FP4GEN_FUZZ_SEED", random.randrange(2**32)))


def fuzz(examples: int) -> Callable[[Any], Any]:
    """Hypothesis settings: ``examples`` derandomized by default; FP4GEN_FUZZ_EXAMPLES per
    test, from SEED, when hunting."""
    count = int(os.environ["FP4GEN_FUZZ_EXAMPLES"]) if HUNT else examples
    chosen = settings(
        max_examples=max(1, count),
        deadline=None,
        suppress_health_check=[
            HealthCheck.function_scoped_fixture,
            HealthCheck.too_slow,
            HealthCheck.data_too_large,
            HealthCheck.filter_too_much,
        ],
        derandomize=not HUNT,
        database=None,
        print_blob=True,
        # shrinking these recipes takes minutes: the default run reports the example as drawn
        phases=tuple(Phase) if HUNT else (Phase.explicit, Phase.generate),
    )

    def wrap(test: Any) -> Any:
        return seed(SEED)(chosen(test)) if HUNT else chosen(test)

    return wrap


@pytest.fixture(autouse=True)
def _announce_seed() -> None:
    if HUNT:  # pytest shows it with a failure; -s shows it always
        print(f"recipe fuzz: FP4GEN_FUZZ_SEED={SEED} replays this run")


_COUNTER = [0]


def written(case: RecipeCase, root: Path) -> Path:
    """The case's files in a fresh folder under ``root`` (a fixture outlives the examples)."""
    _COUNTER[0] += 1
    folder = root / f"case{_COUNTER[0]}"
    folder.mkdir()
    note(case.listing())
    return case.write(folder)


def invoke(argv: list[str]) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of ``fp4gen.cli.main``; any exception fails the test."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    return code, out.getvalue(), err.getvalue()


def load(case: RecipeCase, path: Path) -> Recipe | None:
    """The recipe, or None where it is refused on purpose (any other error fails)."""
    try:
        return load_recipe(path)
    except FP4GenError as err:
        if case.refusable and any(reason in str(err) for reason in REFUSALS):
            return None
        raise


# ---------------------------------------------------------------------------------------------
# 1. the model, and parse(print(r)) == r
# ---------------------------------------------------------------------------------------------


@fuzz(300)
@given(case=recipe_cases())
def test_drawn_recipes_resolve_and_round_trip(case: RecipeCase, tmp_path: Path) -> None:
    path = written(case, tmp_path)
    recipe = load(case, path)
    assume(recipe is not None)
    assert recipe is not None
    if case.expected is not None:
        assert dict(recipe.operands.items()) == case.expected
    assert (len(recipe.layers), len(recipe.schedule)) == (case.layer_count, case.schedule_count)
    assert (recipe.evaluation is not None) == case.evaluated
    text = print_recipe(recipe)
    again = parse_recipe(text, base_dir=path.parent)
    assert again == recipe, text
    assert print_recipe(again) == text  # the canonical text is a fixed point
    # the recipes layer and schedule rules run read back as the files they name
    for mine, theirs in zip(
        [*recipe.layers, *recipe.schedule], [*again.layers, *again.schedule], strict=True
    ):
        ref, back = getattr(mine.action, "recipe", None), getattr(theirs.action, "recipe", None)
        assert (ref is None) == (back is None)
        if ref is not None:
            assert back == ref


# ---------------------------------------------------------------------------------------------
# 2. fp4gen check
# ---------------------------------------------------------------------------------------------

WHERE = re.compile(r"^(?P<file>.+?):(?P<line>\d+):(?P<column>\d+): (?P<reason>.+)$")


def assert_placed(message: str, root: Path) -> re.Match[str]:
    """``message`` is ``file:line:column: reason``, the quoted source line of that file and a
    caret under the column; returns the match of the first line."""
    lines = message.rstrip("\n").split("\n")
    assert "Traceback" not in message, message
    found = WHERE.match(lines[0])
    assert found is not None, message
    file = Path(found["file"])
    file = file if file.is_absolute() else Path.cwd() / file
    assert file.is_file() and root in file.parents, message
    source = file.read_bytes().decode("utf-8").split("\n")
    line, column = int(found["line"]), int(found["column"])
    assert 1 <= line <= len(source), message
    breaks = "\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029"  # quoted as blanks
    text = source[line - 1].removesuffix("\r").translate(str.maketrans(breaks, " " * 9))
    text = text.expandtabs(1)
    assert 1 <= column <= len(text) + 1, message
    if len(text) <= 160:  # a longer line is quoted as a window around the column
        assert len(lines) == 3, message
        assert lines[1] == f"    {text}", message
        assert lines[2] == "    " + " " * (column - 1) + "^", message
    return found


@fuzz(250)
@given(case=recipe_cases())
def test_check_accepts_drawn_recipes_or_places_the_refusal(
    case: RecipeCase, tmp_path: Path
) -> None:
    path = written(case, tmp_path)
    code, out, err = invoke(["check", str(path)])
    if code == 0:
        assert out.startswith("ok  ") and not err
        return
    assert code == 1 and case.refusable, err
    found = assert_placed(err, tmp_path)
    assert any(reason in found["reason"] for reason in REFUSALS), err


# ---------------------------------------------------------------------------------------------
# 3. planning
# ---------------------------------------------------------------------------------------------


def build(recipe: Recipe, tmp_path: Path) -> Any:
    return prepare_builds([recipe], out=tmp_path / "generated")[0]


def check_build(build_: Any) -> None:
    plan, runtime = build_.plan, build_.runtime
    # every kernel renders, or says why the template does not cover it
    for item in build_.kernels:
        assert item.error is None, f"{item.name}: {item.error}"
        if item.source is None:
            assert item.unsupported and "\n" not in item.unsupported.strip(), item.name
        else:
            assert item.kernels, f"{item.name} defines no kernel"
    # every quantized operand slot of every context has a kernel; every other one a reason
    skipped = {(s.recipe, s.context, op): s.reason for s in plan.skipped for op in s.operands}
    for owner, context in plan.contexts():
        for op in Operand:
            kernel = plan.kernel_for(op, context, owner)
            reason = skipped.get((owner, context, op))
            assert (kernel is None) != (reason is None), (owner, context, op)
            if reason is not None:
                assert reason.strip()
    # every GEMM of every context: what runs it on each arch, a fallback with its reason
    for route in runtime.gemms:
        archs = {arch for arch, _ in route.routes}
        assert archs == {"all"} or set(ARCHS) <= archs, route
        for arch, what in route.routes:
            assert what.strip(), route
            if what.startswith(("no fused kernel", "no native MMA")) or arch == "all":
                assert re.search(r"\(.+\)|: .+", what), route


@fuzz(100)
@given(case=recipe_cases())
def test_drawn_recipes_plan_for_both_archs(case: RecipeCase, tmp_path: Path) -> None:
    path = written(case, tmp_path)
    recipe = load(case, path)
    assume(recipe is not None)
    assert recipe is not None
    check_build(build(recipe, tmp_path))


@pytest.fixture(scope="module")
def dsl_ready() -> None:
    pytest.importorskip("cutlass")


@fuzz(4)
@given(case=recipe_cases(), data=st.data())
def test_a_planned_quantize_kernel_cross_compiles(
    case: RecipeCase, data: st.DataObject, tmp_path: Path, dsl_ready: None
) -> None:
    from fp4gen.codegen import import_source

    path = written(case, tmp_path)
    recipe = load(case, path)
    assume(recipe is not None)
    assert recipe is not None
    items = [k for k in build(recipe, tmp_path).kernels if k.kind == "quantize" and k.source]
    assume(items)
    item = data.draw(st.sampled_from(items), label="kernel")
    arch = data.draw(st.sampled_from(ARCHS), label="arch")
    module = import_source(item.source, tmp_path / "modules")
    kernel = data.draw(st.sampled_from(module.KERNELS), label="kernel function")
    fn = module.compile_kernel(kernel, arch, dump_dir=str(tmp_path / "ptx"))
    assert f".target {arch}" in fn.__ptx__


# ---------------------------------------------------------------------------------------------
# 4. reference invariants
# ---------------------------------------------------------------------------------------------

# Magnitudes (log2 of the amax) of the drawn tensors: fp32 subnormals, tiny, ordinary, huge (up
# to just below FLT_MAX without an RHT: the transform's sums may overflow).
SCALES = [-140, -135, -126, -60, 0, 40, 100, 126]


def grid_step(v: torch.Tensor, element: ElementFormat) -> torch.Tensor:
    """The spacing of the element grid at magnitude ``v``: 2^(max(floor(log2 v), emin) - m)
    with emin = 1 - bias (the subnormal step below the smallest normal)."""
    emin = 1 - element.bias
    exponent = torch.floor(torch.log2(v.clamp(min=2.0**emin)))
    return torch.exp2(exponent - element.man_bits)


def error_bound(x: torch.Tensor, q: QuantizedTensor, rounding: str) -> torch.Tensor:
    """Per element, the bound on |x - decode(encode(x))| (float64, x in the space the codes
    live in, after any RHT):

        bound = u * step(min(|x| / s, elem_max)) * s          the element rounding
              + max(|x| - elem_max * s, 0)                    saturation (scale rounded down
                                                              or capped, a zero scale)
              + 2^-20 * |x| + 2^-147                          fp32 arithmetic

    with s = s_b * S_dec the element's decode scale, step() the grid spacing from the element's
    mantissa bits m and emin = 1 - bias (``grid_step``), u = 1/2 for round to nearest and 1 for
    stochastic and toward-zero rounding. The fp32 terms cover x * e_b, e_b = 1 / (s_b * S_dec)
    and the two products of the dequantization, each correctly rounded (relative 2^-24, or an
    absolute half ulp of fp32's subnormals).

    Not covered: a block whose s is non-zero but below 1 / FLT_MAX (amaxes in fp32's subnormal
    range, with fp32 scales or a global scale capped at FLT_MAX). Its e_b is capped at FLT_MAX
    (docs/numerics.md, section 2, step 5), so it encodes x * FLT_MAX instead of x / s and its
    codes come out up to 4x too small (nvfp4 1x1 on 4.6e-39: 1.5 where 6 fits). There the
    bound is |x| + bound: no overshoot, the sign kept (``capped_blocks``).
    """
    element = q.element
    elem_max = element.max_finite
    s = q.block_values(q.scales).double() * q.global_scale.double()
    ax = x.double().abs()
    y = torch.where(s > 0, ax / s, torch.full_like(ax, math.inf))
    u = 0.5 if rounding == "nearest" else 1.0
    rounding_error = u * grid_step(y.clamp(max=elem_max), element) * s
    saturation = (ax - elem_max * s).clamp(min=0)
    return rounding_error * (1 + 2.0**-20) + saturation + 2.0**-20 * ax + 2.0**-147


def capped_blocks(q: QuantizedTensor) -> torch.Tensor:
    """Per element: its block's e_b was capped at FLT_MAX though its scale is not zero."""
    s = q.block_values(q.scales).double() * q.global_scale.double()
    return (q.block_values(q.encode_scales) >= FLT_MAX) & (s > 0)


def drawn_tensor(
    data: st.DataObject, fmt: BlockFormat, width_unit: int, huge_ok: bool
) -> torch.Tensor:
    """A seeded tensor whose shape is not a multiple of the block (widths a multiple of
    ``width_unit``, the RHT size) and whose amax may be tiny or huge."""
    rows_block, cols_block = fmt.block
    rows = data.draw(st.sampled_from(sorted({1, 3, rows_block + 1, 2 * rows_block - 1})))
    cols = data.draw(st.sampled_from(sorted({1, 5, cols_block + 3, 2 * cols_block - 1})))
    cols = -(-min(cols, 300) // width_unit) * width_unit
    # at most 4096 elements where the width unit allows: the width stays a multiple of it
    cols = min(cols, max(width_unit, 4096 // rows // width_unit * width_unit))
    generator = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31 - 1)))
    x = torch.randn(rows, cols, generator=generator)
    kind = data.draw(st.sampled_from(["normal", "outliers", "sparse", "constant"]))
    if kind == "outliers":
        x = torch.where(torch.rand(x.shape, generator=generator) < 0.05, x * 2.0**20, x)
    elif kind == "sparse":
        x = x * (torch.rand(x.shape, generator=generator) < 0.3)
    elif kind == "constant":
        x = torch.full_like(x, data.draw(st.sampled_from([0.0, -1.0, 3.0])))
    exponent = data.draw(st.sampled_from([e for e in SCALES if huge_ok or e <= 40]))
    top = x.abs().max().item()
    # the amax at 2^exponent (just below FLT_MAX for the largest), finite
    x = x / top * min(2.0**exponent, 3.0e38) if top > 0 else x
    return x.to(torch.float32)


@fuzz(150)
@given(case=recipe_cases(), data=st.data())
def test_reference_invariants_of_every_operand_format(
    case: RecipeCase, data: st.DataObject, tmp_path: Path
) -> None:
    path = written(case, tmp_path)
    recipe = load(case, path)
    assume(recipe is not None)
    assert recipe is not None
    specs = {
        (spec.format, spec.rounding, spec.rht): op
        for op, spec in recipe.operands.items()
        if isinstance(spec.format, BlockFormat)
    }
    for (fmt, rounding, transform), op in specs.items():
        width = transform.size if transform is not None else 1
        if transform is not None:  # signs drawn per layer or step: a layer's at a step
            transform = transform.at(
                data.draw(st.integers(0, 2**64 - 1)), data.draw(st.integers(0, 2**63 - 1))
            )
        x = drawn_tensor(data, fmt, width, huge_ok=transform is None)
        note(f"{op.selector}: {fmt} {rounding} {transform} x {tuple(x.shape)}")
        q = quantize(
            x, fmt, rounding=rounding, hadamard=transform, seed=data.draw(st.integers(0, 2**64 - 1))
        )
        assert torch.isfinite(q.scales).all() and (q.scales >= 0).all()
        assert torch.isfinite(q.global_scale).all() and (q.global_scale > 0).all()
        assert torch.isfinite(q.dequantize()).all()
        rotated = rht(x, transform) if transform is not None else x
        err = (rotated.double() - q.dequantize(rotated=True).double()).abs()
        # MS-EDEN rescales the scales after the codes are made: the bound is that of the codes'
        # own scale (the format without the correction, its scale rounded to nearest) plus
        # the exact move of each value the correction makes
        coded = q
        if fmt.eden_group is not None:
            plain = dataclasses.replace(fmt, eden_group=None)
            if plain.scale.rounding == "stochastic":
                plain = dataclasses.replace(plain, scale=ScaleSpec(plain.scale.element))
            coded = quantize(x, plain, rounding=rounding, hadamard=transform, seed=q.seed)
            assert torch.equal(coded.codes, q.codes)
        bound = error_bound(rotated, coded, rounding)
        bound = torch.where(capped_blocks(coded), bound + rotated.double().abs(), bound)
        if coded is not q:
            moved = coded.dequantize(rotated=True).double() - q.dequantize(rotated=True).double()
            bound = bound + moved.abs() * (1 + 2.0**-20)
        worst = int(torch.argmax(err - bound))
        assert torch.all(err <= bound), (
            f"element {worst}: x = {rotated.reshape(-1)[worst].item()!r}, "
            f"error {err.reshape(-1)[worst].item()!r} > bound {bound.reshape(-1)[worst].item()!r}"
        )


@fuzz(80)
@given(case=recipe_cases(), data=st.data())
def test_zero_padding_is_exact_where_the_kernels_pad(
    case: RecipeCase, data: st.DataObject, tmp_path: Path
) -> None:
    """What lets the quantize kernels take any shape (cute_backend._zero_padded): for every
    operand format of a drawn recipe that ``padding_is_exact`` admits (1D blocks and 2D tiles),
    the reference of x zero-padded by any number of rows and columns, the padding's codes,
    block scales and per-row global scales dropped, is the reference of x bit for bit (codes,
    scales, global scale)."""
    from fp4gen.runtime.cute_backend import padding_is_exact

    path = written(case, tmp_path)
    recipe = load(case, path)
    assume(recipe is not None)
    assert recipe is not None
    specs = {
        (spec.format, spec.rounding, spec.rht)
        for _, spec in recipe.operands.items()
        if isinstance(spec.format, BlockFormat) and padding_is_exact(spec.format, spec.rounding)
    }
    assume(specs)
    for fmt, rounding, transform in specs:
        width = transform.size if transform is not None else 1
        if transform is not None:
            transform = transform.at(data.draw(st.integers(0, 2**20)), data.draw(st.integers(0, 9)))
        x = drawn_tensor(data, fmt, width, huge_ok=transform is None)
        rows, cols = x.shape
        if not padding_is_exact(fmt, rounding, cols):
            continue  # block targets on a 2D tile wider than K: not padded
        extra = data.draw(st.integers(1, 2 * fmt.block[1])) * width
        extra_rows = data.draw(st.integers(0, 2 * fmt.block[0]))
        note(f"{fmt} {rounding} {transform} x {tuple(x.shape)} padded by {extra_rows}, {extra}")
        padded = torch.nn.functional.pad(x, (0, extra, 0, extra_rows))
        want = quantize(x, fmt, rounding=rounding, hadamard=transform)
        got = quantize(padded, fmt, rounding=rounding, hadamard=transform)
        block_rows, block_cols = want.scales.shape
        assert torch.equal(got.codes[:rows, :cols], want.codes)
        assert torch.equal(got.scales[:block_rows, :block_cols], want.scales)
        global_scale = got.global_scale[:block_rows] if fmt.global_rows else got.global_scale
        assert torch.equal(global_scale, want.global_scale)


ROWS = 1024  # identical rows: i.i.d. draws of each element's stochastic rounding


@fuzz(20)
@given(case=recipe_cases(), data=st.data())
def test_stochastic_rounding_is_unbiased(
    case: RecipeCase, data: st.DataObject, tmp_path: Path
) -> None:
    """One fixed seed, ROWS copies of a row: each element's mean decoded value is x within
    5 standard errors (sd = step * s * sqrt(q (1 - q)), q = floor(p * 2^b) / 2^b the chance of
    rounding up with b random bits, p the position of y = fp32(|x| * e_b) between its grid
    neighbours), plus
    the bias of b random bits (step * s * 2^-b, toward zero), plus fp32 slack. Saturated
    elements are left out (a clamp is biased on purpose)."""
    path = written(case, tmp_path)
    recipe = load(case, path)
    assume(recipe is not None)
    assert recipe is not None
    # block targets, stochastic scales and MS-EDEN choose or move a block's scale after seeing
    # its rounded codes (or draw it per row): the element rounding alone is what is unbiased
    stochastic = [
        spec
        for _, spec in recipe.operands.items()
        if isinstance(spec.format, BlockFormat)
        and sr_bits(spec.rounding)
        and not (
            spec.format.targets
            or spec.format.eden_group
            or spec.format.scale.rounding == "stochastic"
        )
    ]
    assume(stochastic)
    spec = data.draw(st.sampled_from(stochastic))
    fmt = spec.format
    assert isinstance(fmt, BlockFormat)
    cols = min(max(fmt.block_len, 8), 128)
    generator = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31 - 1)))
    row = torch.randn(cols, generator=generator) * 2.0 ** data.draw(st.integers(-20, 20))
    rows = fmt.block[0] if fmt.is_2d else 1
    tile = row.expand(ROWS * rows, cols).contiguous()
    q = quantize(tile, fmt, rounding=spec.rounding, seed=12345)
    mean = q.dequantize().double().mean(0)
    s = q.block_values(q.scales)[0].double() * q.global_scale.double()
    ax = row.double().abs()
    # y as the quantizer scales it, fp32(|x| * e_b): near a grid point the chance of rounding
    # up depends on which side y fell
    e_b = q.block_values(q.encode_scales)[0]
    y = torch.where(s > 0, (row.abs() * e_b).double(), torch.full_like(ax, math.inf))
    kept = y <= q.element.max_finite
    y = torch.where(kept, y, torch.zeros_like(y))
    step = grid_step(y, q.element)
    p = (y - torch.floor(y / step) * step) / step
    bits = sr_bits(spec.rounding)
    up = torch.floor(p * 2.0**bits) / 2.0**bits
    se = step * s * torch.sqrt(up * (1 - up) / (ROWS * rows))
    tolerance = 5 * se + step * s * 2.0**-bits + 2.0**-20 * ax + 2.0**-147
    off = (mean - row.double()).abs()
    assert torch.all((off <= tolerance)[kept]), (spec, off[kept].max().item())


# ---------------------------------------------------------------------------------------------
# invalid recipes: mutations of drawn ones
# ---------------------------------------------------------------------------------------------

ODD_TOKENS = [
    "{", "}", ":", "*", "#", '"', '"\\q"', "0", "00", "99999999999999999999", "1x0", "0x16",
    "1x1025", "512x512", "3x5", "1e9", "-1", "150%", "0%", "100%", "nan", "e0m3", "e9m9",
    "ue1m0", "ue8m1", "e4m3 ieee", "e3m0 ieee", "rht 3", "rht 512", "signs te", 'signs "+-"',
    "seed 18446744073709551616", "round ocp", "round up", "scale fp32 round up", "global amax",
    "mor", "block", "recipe", "extends", 'import "missing"', 'extends "main"', "layers",
    "schedule", "operands", "bf16", "fp32", "mor nowhere", "try", "else", "decide", "é", "\t",
    "\x0b", "\ufeff", "weight.fprop", "fprop.gradient",
]  # fmt: skip


@st.composite
def mutated(draw: st.DrawFn, text: str) -> str:
    """``text`` with a few tokens deleted, inserted, replaced or repeated, or lines swapped."""
    parts = re.findall(r"\S+|[ \t]+|\n", text)
    for _ in range(draw(st.integers(1, 4))):
        i = draw(st.integers(0, max(0, len(parts) - 1)))
        op = draw(st.sampled_from(["delete", "insert", "replace", "repeat", "newline", "digits"]))
        if not parts:
            parts = [draw(st.sampled_from(ODD_TOKENS))]
        elif op == "delete":
            del parts[i]
        elif op == "insert":
            parts[i:i] = [" ", draw(st.sampled_from(ODD_TOKENS)), " "]
        elif op == "replace":
            parts[i] = draw(st.sampled_from(ODD_TOKENS))
        elif op == "repeat":
            parts.insert(i, parts[i])
        elif op == "newline":
            parts.insert(i, "\n")
        else:
            parts[i] = re.sub(
                r"\d+", lambda _: draw(st.sampled_from(["0", "7", "10" * 12])), parts[i]
            )
    return "".join(parts)


@fuzz(400)
@given(case=recipe_cases(), data=st.data())
def test_mutated_recipes_are_refused_with_a_place(
    case: RecipeCase, data: st.DataObject, tmp_path: Path
) -> None:
    target = data.draw(st.sampled_from(sorted(case.files)), label="file")
    case.files[target] = data.draw(mutated(case.files[target]), label="mutated")
    path = written(case, tmp_path)
    code, out, err = invoke(["check", str(path)])
    if code == 0:
        return  # the mutation left a valid recipe
    assert code == 1 and not out, (out, err)
    first = err.split("\n")[0]
    if WHERE.match(first) is None:  # a whole file: one line naming it
        assert err.count("\n") == 1 and "fp4r" in first, err
        return
    assert_placed(err, tmp_path)


# ---------------------------------------------------------------------------------------------
# what the fuzzer found
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("odd", ["\x0b", "\x0c", "\x1c", "\x85", "\u2028"])
def test_an_error_quotes_its_own_line_after_a_string_holding_a_unicode_line_break(
    odd: str,
) -> None:
    # such a character is no line end for the grammar; the quoted line was once the text after
    # it (str.splitlines splits there), one line off
    text = f'recipe a "x{odd}y"\noperands {{ * : nvfp4 rht 3 }}\n'
    with pytest.raises(FP4GenError) as caught:
        parse_recipe(text)
    assert str(caught.value).splitlines() == [
        "<recipe>:2:26: RHT size 3 is not a power of two from 2 to 256 (the paper uses 16)",
        "    operands { * : nvfp4 rht 3 }",
        "    " + " " * 25 + "^",
    ]


def test_an_unfinished_statement_is_placed_on_its_line_after_a_unicode_line_break() -> None:
    with pytest.raises(FP4GenError) as caught:
        parse_recipe('recipe a "\x85\x0b"\noperands { * : nvfp4 round')
    first, quoted, caret = str(caught.value).splitlines()
    assert first.startswith("<recipe>:2:27: ")
    assert quoted == "    operands { * : nvfp4 round"
    assert caret == "    " + " " * 26 + "^"


def test_plan_contexts_of_close_schedule_points_have_distinct_names() -> None:
    # the spelling rounded percentages to 6 digits: both rules were "at 10% both : mxfp4"
    from fp4gen.compiler.plan import plan_recipe

    recipe = parse_recipe(
        "operands { * : nvfp4 }\nschedule {\n    at 10.0000001% : mxfp4\n"
        "    at 10.0000002% : mxfp4\n}\n"
    )
    labels = [context for _, context in plan_recipe(recipe).contexts()]
    assert labels == [
        "operands",
        "schedule: at 10.0000001% both : mxfp4",
        "schedule: at 10.0000001% both : mxfp4; schedule: at 10.0000002% both : mxfp4",
    ]


def test_spellings_of_patterns_and_paths_stay_on_one_line_and_read_back() -> None:
    from fp4gen.dsl.model import LayerSelector, RecipeRef
    from fp4gen.dsl.spelling import action_text, percent, selector_text

    pattern = 'a"b\\c\nd\te'
    assert selector_text(LayerSelector("match", pattern=pattern)) == 'match "a\\"b\\\\c\\nd\\te"'
    assert action_text(RecipeRef('x"y.fp4r')) == 'recipe "x\\"y.fp4r"'
    rule = selector_text(LayerSelector("match", pattern=pattern))
    recipe = parse_recipe(f"operands {{ * : nvfp4 }}\nlayers {{\n    {rule} : bf16\n}}\n")
    assert recipe.layers[0].selector.pattern == pattern
    assert [percent(f) for f in (0.82, 0.15, 0.123456781, 1.0)] == [
        "82%",
        "15%",
        "12.3456781%",
        "100%",
    ]


def test_a_line_holding_a_unicode_line_break_is_quoted_whole_with_a_blank_for_it() -> None:
    with pytest.raises(FP4GenError) as caught:
        parse_recipe('recipe a "x\x85y" "z" 5\noperands { * : nvfp4 }\n')
    first, quoted, caret = str(caught.value).split("\n")  # the reason quotes the token as is
    assert first.startswith('<recipe>:1:16: unexpected string "z"')
    assert quoted == '    recipe a "x y" "z" 5'
    assert caret == "    " + " " * 15 + "^"
