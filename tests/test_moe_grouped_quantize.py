"""Grouped quantize (fp4gen.runtime.grouped_quantize, fp4gen.kernels.grouped_quantize): the
rowwise copies of every expert's tokens in one launch, each group bit for bit its own
reference quantization (its global amax and S_dec, its seed and Philox offset, its stochastic
rounding indexed from its first element), on unequal and empty groups.

On the CPU: the CTA table, the per-group path (what every device falls back to), the cases the
grouped path leaves to the per-expert quantize, and the kernels cross-compiled for sm_90a and
sm_100a (no GPU). On a GPU (``-m gpu``): the kernels against the reference per group, and the
grouped experts quantizing their tokens in one launch with the loop's bits."""

from __future__ import annotations

import dataclasses
import random
import sys
from pathlib import Path

import pytest
import torch

import fp4gen
import fp4gen.runtime.grouped as grouped
from fp4gen.formats import BUILTIN_FORMATS
from fp4gen.numerics.quantize import quantize as reference_quantize
from fp4gen.runtime.grouped_quantize import (
    compile_grouped,
    cta_table,
    cta_table_tensor,
    quantize_groups,
)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_moe_grouped import dequant_loop  # noqa: E402,F401  (a fixture, used by name)

COUNTS = [37, 0, 5, 60, 0, 300]  # rows per group: empty groups, very unequal ones
SEEDS = [11, 12, 13, 2**40 + 14, 15, 16]
OFFSETS = [8 * 3 + 0, 0, 8 * 1 + 0, 2**33 + 5, 7, 8 * 40]
# (format, rounding, RHT size or None): the NVFP4 activation and gradient copies, an RHT, MX
CASES = [
    ("nvfp4", "nearest", None),
    ("nvfp4", "stochastic8", None),
    ("nvfp4", "nearest", 16),
    ("nvfp4", "stochastic", None),
    ("mxfp8_e4m3", "nearest", None),
    ("mxfp4", "stochastic8", None),
    ("nvfp4", "stochastic8", 128),  # an RHT across 4 lanes (RowwiseBase.clamped)
]


def grouped_input(device: str, k: int = 128) -> torch.Tensor:
    """bf16 rows whose groups differ in magnitude by up to 2^30 (per-group global scales that
    a single scale could not serve) and a zero row."""
    g = torch.Generator().manual_seed(5)
    parts = []
    for i, n in enumerate(COUNTS):
        parts.append(torch.randn(n, k, generator=g) * 2.0 ** (10 * (i % 4) - 15))
    x = torch.cat(parts)
    x[40] = 0
    return x.to(torch.bfloat16).to(device)


def rht_spec(size: int | None):
    if size is None:
        return None
    from fp4gen.dsl.model import RHTSpec

    if size > 16:  # no fixed vector of this size is shipped: signs drawn from a seed
        return RHTSpec(size=size, sign_source="seeded", signs=None, seed=3)
    return RHTSpec(size=size)


def with_whole(out, rows: torch.Tensor):
    """A grouped quantize's result ``out`` of ``rows`` with every row as one tensor
    (``GroupedOperands.whole``), as the kernels give it (the grouped GEMMs decode it once)."""
    parts = [q for q in out if q is not None]
    out.whole = dataclasses.replace(
        parts[0],
        codes=torch.cat([q.codes for q in parts]),
        scales=torch.cat([q.scales for q in parts]),
        scale_codes=None,
        shape=torch.Size((rows.shape[0], parts[0].shape[1])),
    )
    return out


def reference_groups(x: torch.Tensor, fmt, rounding: str, rht) -> list:
    out: list = []
    start = 0
    for count, seed, offset in zip(COUNTS, SEEDS, OFFSETS, strict=True):
        if count == 0:
            out.append(None)
            continue
        out.append(
            reference_quantize(
                x[start : start + count].cpu(),
                fmt,
                rounding=rounding,
                hadamard=rht,
                seed=seed,
                offset=offset,
            )
        )
        start += count
    return out


@pytest.fixture(autouse=True)
def grouped_quantize_on(monkeypatch: pytest.MonkeyPatch) -> None:
    """This module tests the grouped quantize: on for each test (the default, docs/moe.md),
    whatever an earlier test in the worker set."""
    monkeypatch.setattr(grouped, "_grouped_quantize", [True])


def test_the_cta_table() -> None:
    """One row per tile of one group: (group, first unit, the group's end, the group's first
    unit); empty groups have none; a group's last tile may be partial."""
    assert cta_table([3, 0, 1, 5], units_per_row=2, tile=4) == [
        (0, 0, 6, 0),
        (0, 4, 6, 0),
        (2, 6, 8, 6),
        (3, 8, 18, 8),
        (3, 12, 18, 8),
        (3, 16, 18, 8),
    ]
    assert cta_table([0, 0], units_per_row=8, tile=64) == []
    with pytest.raises(fp4gen.FP4GenError, match="group 1 has -1 rows"):
        cta_table([2, -1], units_per_row=1, tile=4)


@pytest.mark.parametrize("seed", range(4))
def test_the_launched_cta_table_is_the_listed_one(seed: int) -> None:
    """The tensor the kernels read (built by torch ops) holds ``cta_table``'s rows in order, for
    drawn groups (empty, single-row, partial last tiles) and tile sizes."""
    rng = random.Random(seed)
    for _ in range(50):
        counts = [rng.choice([0, 1, 2, 3, 7, 64, 129]) for _ in range(rng.randint(0, 9))]
        units, tile = rng.randint(1, 40), rng.randint(1, 200)
        listed = cta_table(counts, units, tile)
        table = cta_table_tensor(counts, units, tile)
        assert table.dtype == torch.int32 and table.shape == (len(listed), 4)
        assert table.tolist() == [list(row) for row in listed]
    with pytest.raises(fp4gen.FP4GenError, match="group 1 has -1 rows"):
        cta_table_tensor([2, -1], units_per_row=1, tile=4)


@pytest.mark.parametrize(("fmt", "rounding", "rht"), CASES[:3])
def test_the_per_group_path_is_the_reference(fmt: str, rounding: str, rht) -> None:
    """On the CPU (where no kernel runs) each group is the reference quantization of its rows,
    an empty group None: the definition the kernels are held to."""
    x = grouped_input("cpu")
    got = quantize_groups(
        x, COUNTS, BUILTIN_FORMATS[fmt], rounding=rounding, rht=rht_spec(rht), seeds=SEEDS,
        offsets=OFFSETS,
    )  # fmt: skip
    want = reference_groups(x, BUILTIN_FORMATS[fmt], rounding, rht_spec(rht))
    assert len(got) == len(COUNTS)
    assert [q is None for q in got] == [n == 0 for n in COUNTS]
    for g, (a, b) in enumerate(zip(got, want, strict=True)):
        if b is None:
            continue
        assert a.shape == (COUNTS[g], 128)
        assert torch.equal(a.codes, b.codes) and torch.equal(a.scales, b.scales), g
        assert torch.equal(a.global_scale, b.global_scale), g
    # the groups have their own global scales (a single one would be the largest group's)
    assert len({float(q.global_scale) for q in got if q is not None}) > 2


def test_bad_groups_are_one_line_errors() -> None:
    x = torch.randn(10, 32)
    with pytest.raises(fp4gen.errors.TensorError, match=r"groups of \[4, 4\] rows"):
        quantize_groups(x, [4, 4], BUILTIN_FORMATS["nvfp4"], seeds=[0, 0], offsets=[0, 0])
    with pytest.raises(fp4gen.FP4GenError, match="2 groups, 1 seeds, 2 offsets"):
        quantize_groups(x, [4, 6], BUILTIN_FORMATS["nvfp4"], seeds=[0], offsets=[0, 0])
    with pytest.raises(fp4gen.FP4GenError, match="backend='cute'.*a CPU tensor"):
        quantize_groups(
            x, [4, 6], BUILTIN_FORMATS["nvfp4"], seeds=[0, 0], offsets=[0, 0], backend="cute"
        )


def test_the_grouped_path_quantizes_per_expert_where_the_kernels_do_not_serve() -> None:
    """CPU tensors, the reference backend, 2D blocks, or the setting off: no grouped quantize
    (None: each expert's layer quantizes its tokens)."""
    from test_moe import build, experts_of

    module = experts_of(fp4gen.convert(build("mixtral"), "nvfp4_no_bf16"))
    groups = grouped.Groups([0, 1], [3, 4], [module.gemms[0][0], module.gemms[1][0]], False,
                            torch.float32, "up")  # fmt: skip
    assert grouped.grouped_fprop_inputs(torch.randn(7, 64), groups, 64) is None
    assert grouped.set_grouped_quantize(False) is True
    try:
        assert grouped.grouped_fprop_inputs(torch.randn(7, 64), groups, 64) is None
    finally:
        grouped.set_grouped_quantize(True)


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
@pytest.mark.parametrize(("fmt", "rounding", "rht"), CASES)
def test_the_grouped_kernels_cross_compile(tmp_path: Path, arch: str, fmt, rounding, rht) -> None:
    """The grouped amax (with a global scale) and quantize kernels compile for both arches from
    the rowwise spec's parameters; the amax kernel's atomic max goes to the group's slot."""
    pytest.importorskip("cutlass")
    from fp4gen.codegen.quantize import render
    from fp4gen.compiler.jit import import_source
    from fp4gen.runtime.cute_backend import spec_for

    spec = spec_for(BUILTIN_FORMATS[fmt], rounding, rht_spec(rht), torch.bfloat16)
    source = tmp_path / f"{spec.name}.py"
    source.write_text(render(spec))
    module = import_source(source)
    fns = compile_grouped(module.PARAMS, arch, module.K_MULTIPLE, dump_dir=str(tmp_path / "ptx"))
    global_scale = BUILTIN_FORMATS[fmt].global_scale
    assert sorted(fns) == (["amax", "quantize"] if global_scale else ["quantize"])
    ptx = {p.name: p.read_text() for p in (tmp_path / "ptx").glob("*.ptx")}
    assert len(ptx) == len(fns)
    if global_scale:
        (amax,) = [text for name, text in ptx.items() if "Amax" in name]
        assert amax.count("atom.global.max") == 1


# ---------------------------------------------------------------------------------------------
# On a GPU
# ---------------------------------------------------------------------------------------------

gpu = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(("fmt", "rounding", "rht"), CASES)
def test_cuda_grouped_quantize_is_the_reference_per_group(fmt: str, rounding: str, rht) -> None:
    """One launch (two with a global scale) for six groups, two of them empty, from 5 to 300
    rows (several CTAs), magnitudes 2^30 apart: each group's codes, scales and S_dec are its
    own reference quantization's, bit for bit; a NaN in one group makes only its S_dec NaN."""
    from test_recipe_fuzz_gpu import differences

    x = grouped_input("cuda")
    got = quantize_groups(
        x, COUNTS, BUILTIN_FORMATS[fmt], rounding=rounding, rht=rht_spec(rht), seeds=SEEDS,
        offsets=OFFSETS, backend="cute",
    )  # fmt: skip
    want = reference_groups(x, BUILTIN_FORMATS[fmt], rounding, rht_spec(rht))
    assert [g is None for g in got] == [c == 0 for c in COUNTS]  # an empty group: None
    bad = [
        d
        for g, (a, b) in enumerate(zip(got, want, strict=True))
        if b is not None
        for d in differences(a, b, f"group {g}")
    ]
    assert not bad, "\n".join(bad)
    x[COUNTS[0] + 2, 3] = float("nan")  # group 2's third row
    got = quantize_groups(
        x, COUNTS, BUILTIN_FORMATS[fmt], rounding=rounding, rht=rht_spec(rht), seeds=SEEDS,
        offsets=OFFSETS, backend="cute",
    )  # fmt: skip
    nan = [q is not None and bool(torch.isnan(q.global_scale)) for q in got]
    assert nan == [False, False, True, False, False, False]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_grouped_experts_quantize_their_tokens_in_one_launch(monkeypatch) -> None:
    """The grouped path's fprop activations come from one grouped quantize per projection
    (counted), with the operands of the per-expert quantize bit for bit (the GPU harness test
    test_cuda_grouped_experts_match_the_loop compares every operand with the loop's)."""
    from moe_harness import harnessed_run, operand_differences
    from test_moe_grouped import pair, unequal_routing

    import fp4gen.runtime.grouped_quantize as gq

    calls = []
    real = gq.quantize_groups

    def counted(*args, **kw):
        calls.append(kw["backend"])
        return real(*args, **kw)

    monkeypatch.setattr(gq, "quantize_groups", counted)
    _, group = pair("qwen3_moe", torch.bfloat16, device="cuda")
    index, weights = unequal_routing()
    hidden = torch.randn(70, 64).to(torch.bfloat16).cuda()
    args = (hidden, index.cuda(), weights.to(torch.bfloat16).cuda())
    got = harnessed_run(group, *args, check=False)
    assert calls == ["cute", "cute"]  # up and down projection
    previous = grouped.set_grouped_quantize(False)
    try:
        _, per_expert = pair("qwen3_moe", torch.bfloat16, device="cuda")
        want = harnessed_run(per_expert, *args, check=False)
    finally:
        grouped.set_grouped_quantize(previous)
    assert len(calls) == 2
    assert not operand_differences(got.harness, want.harness)


# every operand 1x16 NVFP4 with stochastic rounding: the fprop activations and weights and the
# dgrad weights are all grouped, each group drawing its expert's stream
ALL_SR = "operands {\n * : nvfp4 round stochastic8\n}\n"
# the NVFP4 method with 1x16 weight blocks (nvfp4_1d_weights without its BF16 blocks)
ONE_D = (
    "operands {\n * : nvfp4\n gradient : round stochastic8\n"
    " wgrad.activation : rht 16 signs te\n wgrad.gradient : rht 16 signs te\n}\n"
)
RECIPES = {"all_sr": ALL_SR, "1d_weights": ONE_D}


@pytest.mark.parametrize("arch", ["mixtral", "gpt_oss"])
@pytest.mark.parametrize("recipe", ["nvfp4_no_bf16", "1d_weights", "all_sr"])
def test_grouped_operands_are_the_loops_bits(monkeypatch, dequant_loop, arch, recipe) -> None:  # noqa: F811
    """The grouped path with its grouped quantize (the per-group definition standing in for the
    kernels, so this runs on the CPU): every expert's seed, Philox offset, padding, batched
    weight layout (gpt-oss's transposed [E, in, out] too) and group order as its own layer's
    quantize, so the results equal the loop's bit for bit, over two steps (the call counts
    move the offsets); one grouped quantize per operand the grouped path serves, its block
    values decoded once for every expert (``GroupedOperands.whole``)."""
    from test_moe import routing, run
    from test_moe_grouped import pair

    import fp4gen.runtime.grouped_quantize as gq
    from fp4gen.dsl import parse_recipe

    ops: list[int] = []
    real = gq.quantize_groups

    def per_group_definition(rows, counts, fmt, **kw):
        ops.append(len(counts))
        return with_whole(real(rows, counts, fmt, **{**kw, "backend": "reference"}), rows)

    decoded: list[tuple[int, ...]] = []
    real_whole = grouped._whole_values

    def whole_values(operands):
        values = real_whole(operands)
        if values is not None:
            decoded.append(tuple(values.shape))
        return values

    monkeypatch.setattr(grouped, "_serves", lambda t: True)
    monkeypatch.setattr(gq, "quantize_groups", per_group_definition)
    monkeypatch.setattr(grouped, "_whole_values", whole_values)
    spec = parse_recipe(RECIPES[recipe], base_dir=None) if recipe in RECIPES else recipe
    loop, group = pair(arch, torch.bfloat16, spec)
    index, weights = routing(40, empty=1)
    for step in range(2):
        hidden = torch.randn(40, 64, generator=torch.Generator().manual_seed(step))
        hidden = hidden.to(torch.bfloat16)
        want = run(loop, hidden, index, weights.to(torch.bfloat16))
        got = run(group, hidden, index, weights.to(torch.bfloat16))
        assert all(torch.equal(a, b) for a, b in zip(got[:3], want[:3], strict=True)), step
        assert all(torch.equal(got[3][n], want[3][n]) for n in want[3]), step
    # per step, for each of the two projections: x (fprop), and with 1x16 weights W (fprop)
    # and W^T (dgrad); nvfp4's 16x16 weights are the tile kernels'
    per_step = {"nvfp4_no_bf16": 2, "1d_weights": 6, "all_sr": 6}[recipe]
    assert len(ops) == 2 * per_step and set(ops) == {3}  # 3 experts with tokens
    assert len(decoded) == len(ops)  # each grouped operand decoded once, for every expert


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss"])
@pytest.mark.parametrize("recipe", ["1d_weights", "all_sr"])
def test_cuda_grouped_quantize_in_the_experts_is_the_loops(monkeypatch, arch, recipe) -> None:
    """On CUDA with the grouped kernels: tokens, weights and transposed weights of every
    expert quantized in one launch per operand (six per step: none fell back), and every
    expert GEMM's operands the per-expert loop's bit for bit (tests/moe_harness.py), with the
    products handed on the results too, very unequal groups with an empty expert."""
    from moe_harness import harnessed_run, operand_differences, result_differences
    from test_moe_grouped import pair, unequal_routing

    import fp4gen.runtime.grouped_quantize as gq
    from fp4gen.dsl import parse_recipe

    calls: list[str] = []
    real = gq.quantize_groups

    def counted(*args, **kw):
        calls.append(kw["backend"])
        return real(*args, **kw)

    monkeypatch.setattr(gq, "quantize_groups", counted)
    loop, group = pair(arch, torch.bfloat16, parse_recipe(RECIPES[recipe], base_dir=None), "cuda")
    index, weights = unequal_routing()
    hidden = torch.randn(70, 64).to(torch.bfloat16).cuda()
    args = (hidden, index.cuda(), weights.to(torch.bfloat16).cuda())
    want = harnessed_run(loop, *args, check=True)
    got = harnessed_run(group, *args, check=True)
    assert calls == ["cute"] * 6
    problems = want.harness.problems + got.harness.problems
    problems += operand_differences(got.harness, want.harness)
    problems += result_differences(got, want)
    assert not problems, "\n".join(problems)


def option_spec(option: str):
    """(format, RHT) of an option the grouped kernels do not take."""
    from fp4gen.dsl import parse_recipe
    from fp4gen.dsl.model import RHTSpec

    nvfp4 = BUILTIN_FORMATS["nvfp4"]
    if option == "per-row":
        return dataclasses.replace(nvfp4, global_rows=True), None
    if option == "eden":
        fmt = "format e = nvfp4 global amax 384 correct eden 128"
        text = f'recipe r "r"\n{fmt}\noperands {{\n * : e\n}}\n'
        return parse_recipe(text).operands.fprop_activation.format, None
    return nvfp4, RHTSpec(size=16, sign_source=option, signs=None, seed=1)


@pytest.mark.parametrize(
    ("option", "reason"),
    [
        ("per-row", "per-row global scales"),
        ("eden", "MS-EDEN"),
        ("step", "signs drawn per layer or step"),
        ("layer", "signs drawn per layer or step"),
    ],
)
def test_options_without_grouped_gpu_tests_are_refused(
    tmp_path: Path, option: str, reason: str
) -> None:
    """Per-row global scales, the MS-EDEN correction and RHT signs drawn per layer or step
    compile in the grouped kernels (the drawn signs fail to), but no GPU test holds them to the
    reference per group: ``grouped_reason`` refuses them, so each group is quantized on its
    own (per-row scales compiled, and would have taken one amax per group: a silent error)."""
    from fp4gen.codegen.quantize import render
    from fp4gen.compiler.jit import import_source
    from fp4gen.kernels.grouped_quantize import grouped_reason
    from fp4gen.runtime.cute_backend import spec_for

    fmt, rht = option_spec(option)
    spec = spec_for(fmt, "nearest", rht, torch.bfloat16)
    source = tmp_path / f"{spec.name}.py"
    source.write_text(render(spec))
    found = grouped_reason(import_source(source).PARAMS)
    assert found is not None and reason in found


def test_lazy_groups_build_each_entry_once_on_first_read() -> None:
    """LazyGroups (a grouped launch's per-group operands): an entry is made on its first read,
    kept after, by positive or negative index or slice; given items are kept as they are."""
    from fp4gen.runtime.grouped_quantize import GroupedOperands, LazyGroups

    made = []

    def make(g: int) -> object:
        made.append(g)
        return None if g == 1 else ("group", g)

    groups = GroupedOperands(make=make, count=4)
    assert len(groups) == 4 and groups.built == 0 and made == []
    assert groups[2] == ("group", 2) and groups[-2] == ("group", 2) and made == [2]
    assert groups[1] is None and groups.built == 2
    assert groups[0:2] == [("group", 0), None] and made == [2, 1, 0]
    assert list(groups) == [("group", 0), None, ("group", 2), ("group", 3)]
    assert made == [2, 1, 0, 3] and groups.built == 4
    given = LazyGroups([None, "q"])
    given.append("r")
    assert list(given) == [None, "q", "r"] and given.built == 3
    with pytest.raises(IndexError):
        groups[4]


def test_lazy_groups_hold_no_reference_cycle() -> None:
    """A grouped launch's lazy operands are freed by reference counting alone (a cycle would
    keep the launch's device buffers until the garbage collector ran)."""
    import gc
    import weakref

    from fp4gen.runtime.grouped_quantize import GroupedOperands
    from fp4gen.runtime.grouped_tile import GroupedCopies

    buffer = torch.zeros(4)
    copies = GroupedCopies(make_copy=lambda g, i: (buffer, g, i), count=2, copies=2)
    lazy = GroupedOperands(make=lambda g: buffer, count=2)
    assert copies[1] == ((buffer, 1, 0), (buffer, 1, 1))
    assert copies.copy(1)[0] == (buffer, 0, 1) and lazy[0] is buffer
    refs = [weakref.ref(copies), weakref.ref(lazy)]
    gc.disable()
    try:
        del copies, lazy
        assert [ref() for ref in refs] == [None, None]
    finally:
        gc.enable()


def test_u64_table_is_the_words_of_each_value() -> None:
    """host.u64_table: each value's (low, high) int32 words in row order, as u64_words gives
    them one by one; a value outside [0, 2^64) or not an int is refused, named."""
    from fp4gen.kernels import host

    rows = [[0, 1, 2**32 - 1], [2**32, 2**63, 2**64 - 1], [12345678901234, 7, 2**31]]
    got = host.u64_table(rows, ["seed", "offset", "offset"])
    want = [[w for v in row for w in host.u64_words(v)] for row in rows]
    assert got.dtype.name == "int32" and got.tolist() == want
    assert host.u64_table([], ["seed"]).shape == (0, 2)
    # rows as tuples (a zip of the columns), and values only int64 holds or only uint64 does
    assert (
        host.u64_table([tuple(row) for row in rows], ["seed", "offset", "offset"]).tolist() == want
    )
    assert host.u64_table([(5, 2**63 + 1)], ["seed", "offset"]).tolist() == [[5, 0, 1, -(2**31)]]
    for bad in (-1, 2**64, 1.0, True):
        with pytest.raises(ValueError, match="offset must be an integer in"):
            host.u64_table([[3, bad]], ["seed", "offset"])
        with pytest.raises(ValueError, match="offset must be an integer in"):
            host.u64_table([(3, 4), (3, bad)], ["seed", "offset"])  # one bad row of several
    with pytest.raises(ValueError):
        host.u64_table([(3, 4), (3,)], ["seed", "offset"])  # a short row
