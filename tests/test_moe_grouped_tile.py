"""Grouped tile quantize (fp4gen.runtime.grouped_tile, fp4gen.kernels.grouped_tile): the tile
kernel's copies of every expert's rows in one launch: the wgrad copies of the tokens and of the
output gradient (blocks along the tokens, each expert's tokens zero-padded to the wgrad block
length inside the kernel) and the batched expert weights with 2D (16x16) tiles, each group bit
for bit its own reference quantization (its global amaxes and S_decs, its seed and Philox
offsets, its stochastic rounding indexed inside its padded copy), on unequal and empty groups.

On the CPU: the CTA table and the padding arithmetic, the definition, the kernels cross-compiled
for sm_90a and sm_100a (no GPU), and the grouped experts' operands equal to the loop's with the
definition standing in for the kernels. On a GPU (``-m gpu``): the kernels against the definition
per group, and the grouped experts with them against the loop."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest
import torch

import fp4gen
import fp4gen.runtime.grouped as grouped
from fp4gen.dsl.model import RHTSpec
from fp4gen.formats import BUILTIN_FORMATS
from fp4gen.numerics.quantize import quantize as reference_quantize
from fp4gen.runtime import grouped_tile
from fp4gen.runtime.grouped_tile import (
    cached_tile_table,
    compile_grouped_tile,
    k_reason,
    padded_counts,
    quantize_groups_tile,
    reference_groups_tile,
    tile_table,
    tile_table_tensor,
)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_moe_grouped import dequant_loop  # noqa: E402,F401  (a fixture, used by name)

COUNTS = [37, 0, 5, 60, 0, 300]  # rows per group: empty groups, very unequal ones
SEEDS = [11, 12, 13, 2**40 + 14, 15, 16]
OFFSETS = [8 * 3 + 4, 0, 8 * 1 + 4, 2**33 + 5, 7, 8 * 40 + 4]


def nvfp4_2d():
    return dataclasses.replace(BUILTIN_FORMATS["nvfp4"], block=(16, 16))


def rht(size: int | None) -> RHTSpec | None:
    if size is None:
        return None
    if size > 16:  # no fixed vector of this size is shipped: signs drawn from a seed
        return RHTSpec(size=size, sign_source="seeded", signs=None, seed=3)
    return RHTSpec(size=size)


# (format, copies as (direction, rounding, RHT size)): NVFP4's wgrad activation (RHT 16) and its
# gradient pair (dgrad rowwise stochastic, wgrad columnwise stochastic with RHT 16), an RHT of
# 32 along the tokens (seeded signs; the largest a tile strip holds), MXFP8 and MXFP4
# columnwise copies, MXFP8's gradient pair
CASES = {
    "nvfp4_wgrad_activation": ("nvfp4", (("columnwise", "nearest", 16),)),
    "nvfp4_gradient_pair": (
        "nvfp4",
        (("rowwise", "stochastic8", None), ("columnwise", "stochastic8", 16)),
    ),
    "nvfp4_col_sr_rht32": ("nvfp4", (("columnwise", "stochastic", 32),)),
    "mxfp8_col": ("mxfp8_e4m3", (("columnwise", "nearest", None),)),
    "mxfp8_pair": ("mxfp8_e4m3", (("rowwise", "nearest", None), ("columnwise", "nearest", None))),
    "mxfp4_col_sr": ("mxfp4", (("columnwise", "stochastic8", None),)),
    # fp8_blockwise's gradient pair: fp32 scales, column blocks across several warps
    "fp8_block_pair": (
        "fp8_block",
        (("rowwise", "nearest", None), ("columnwise", "nearest", None)),
    ),
}


def fp8_block(rows: int = 1):
    """fp8_blockwise's format: e4m3, 1x128 (or 128x128) blocks, fp32 scales, no global scale."""
    from fp4gen.dsl.parser import load_recipe

    recipe = load_recipe(Path(fp4gen.__file__).parent / "recipes" / "fp8_blockwise.fp4r")
    fmt = recipe.operands.fprop_activation.format
    return dataclasses.replace(fmt, block=(rows, 128))


def fmt_of(name: str):
    if name == "nvfp4_2d":
        return nvfp4_2d()
    if name.startswith("fp8_block"):
        return fp8_block(128 if name.endswith("2d") else 1)
    return BUILTIN_FORMATS[name]


def copies_of(copies) -> list:
    return [(d, r, rht(h)) for d, r, h in copies]


def pads_for(fmt, copies, counts=COUNTS) -> list[int]:
    """What the wgrad GEMM pads each expert's tokens to: the block length and RHT size."""
    import math

    multiple = fmt.block[1]
    for _, _, size in copies:
        multiple = math.lcm(multiple, size or 1)
    return padded_counts(counts, multiple)


def grouped_input(device: str, k: int = 128, counts=COUNTS) -> torch.Tensor:
    """bf16 rows whose groups differ in magnitude by up to 2^30 (per-group global scales that
    a single scale could not serve) and a zero row."""
    g = torch.Generator().manual_seed(5)
    parts = [
        torch.randn(n, k, generator=g) * 2.0 ** (10 * (i % 4) - 15) for i, n in enumerate(counts)
    ]
    x = torch.cat(parts)
    x[40] = 0
    return x.to(torch.bfloat16).to(device)


def offsets_for(copies) -> list[tuple[int, ...]]:
    return [tuple(o + 8 * i for i in range(len(copies))) for o in OFFSETS]


@pytest.fixture(autouse=True)
def grouped_quantize_on(monkeypatch: pytest.MonkeyPatch) -> None:
    """The grouped quantize and its tile switch on (their defaults) for each test, whatever an
    earlier test in the worker set; a test turns the tile switch off where it needs."""
    monkeypatch.setattr(grouped, "_grouped_quantize", [True])
    monkeypatch.setattr(grouped, "_grouped_tile_quantize", [True])


# ---------------------------------------------------------------------------------------------
# The CTA table and the padding
# ---------------------------------------------------------------------------------------------


def test_the_cta_table() -> None:
    """Per tile of a group's padded rows x column tile: (group, tile index in the group, first
    input row, real rows, padded rows, first padded row); empty groups have none, the input rows
    count real rows and the output rows padded ones."""
    assert tile_table([3, 0, 20], [16, 0, 32], tile_m=16, tiles_k=2) == [
        (0, 0, 0, 3, 16, 0),
        (0, 1, 0, 3, 16, 0),
        (2, 0, 3, 20, 32, 16),
        (2, 1, 3, 20, 32, 16),
        (2, 2, 3, 20, 32, 16),
        (2, 3, 3, 20, 32, 16),
    ]
    assert tile_table([0, 0], [0, 0], tile_m=64, tiles_k=1) == []
    # a padded group of 96 rows with 64-row tiles: two tile rows, the second one half padding
    assert len(tile_table([65], [96], tile_m=64, tiles_k=3)) == 6
    with pytest.raises(fp4gen.FP4GenError, match="group 1 has 5 rows padded to 4"):
        tile_table([2, 5], [16, 4], tile_m=16, tiles_k=1)
    with pytest.raises(fp4gen.FP4GenError, match="group 0 has 0 rows padded to 16"):
        tile_table([0], [16], tile_m=16, tiles_k=1)


@pytest.mark.parametrize(
    ("counts", "pads", "tile_m", "tiles_k"),
    [
        ([3, 0, 20], [16, 0, 32], 16, 2),
        (COUNTS, padded_counts(COUNTS, 16), 64, 3),
        ([0, 0], [0, 0], 32, 4),
        ([1], [128], 32, 1),
        ([], [], 16, 1),
    ],
)
def test_the_launch_builds_the_same_table_by_torch_ops(counts, pads, tile_m, tiles_k) -> None:
    """tile_table_tensor (what a launch uploads: a few torch ops, not a Python row per CTA) is
    tile_table row for row, int32; its errors are tile_table's."""
    got = tile_table_tensor(counts, pads, tile_m, tiles_k)
    assert got.dtype == torch.int32 and got.shape == (len(tile_table(counts, pads, tile_m,
                                                                     tiles_k)), 6)  # fmt: skip
    assert [tuple(r) for r in got.tolist()] == tile_table(counts, pads, tile_m, tiles_k)
    with pytest.raises(fp4gen.FP4GenError, match="group 1 has 5 rows padded to 4"):
        tile_table_tensor([2, 5], [16, 4], tile_m=16, tiles_k=1)


def test_launches_of_the_same_groups_share_one_table() -> None:
    """cached_tile_table (what a launch reads): tile_table's rows; the same groups, tile and
    device give the same tensor again (no rebuild, no upload), other groups another; the last
    32 are kept. CUDA graph captures bypass it (device_memory.pooled: False on the CPU)."""
    cpu = torch.device("cpu")
    grouped_tile._TABLES.clear()
    first = cached_tile_table([3, 0, 20], [16, 0, 32], 16, 2, cpu)
    assert [tuple(r) for r in first.tolist()] == tile_table([3, 0, 20], [16, 0, 32], 16, 2)
    assert cached_tile_table([3, 0, 20], [16, 0, 32], 16, 2, cpu) is first
    other = cached_tile_table([3, 0, 20], [16, 0, 32], 16, 3, cpu)
    assert other is not first and other.shape[0] == 9
    for n in range(32):  # 32 newer tables push the first one out
        cached_tile_table([n + 1], [32], 16, 1, cpu)
    again = cached_tile_table([3, 0, 20], [16, 0, 32], 16, 2, cpu)
    assert again is not first and torch.equal(again, first)


def test_padding_arithmetic() -> None:
    """Each expert's tokens rounded up to the wgrad GEMM's K multiple (block length and RHT
    size); an empty expert stays empty; the padded start of each group is the sum before it."""
    assert padded_counts([37, 0, 5, 60, 0, 300], 16) == [48, 0, 16, 64, 0, 304]
    assert padded_counts([1, 128, 129], 128) == [128, 128, 256]
    table = tile_table([37, 5], padded_counts([37, 5], 16), tile_m=32, tiles_k=1)
    assert [row[5] for row in table] == [0, 0, 48]  # group 1's copies start after 48 rows


OFFSET_CASES = [(4, 16, False), (8, 32, False), (4, 16, True)]  # NVFP4, MXFP8, NVFP4 16x16


@pytest.mark.parametrize(("bits", "block", "two_d"), OFFSET_CASES)
def test_each_group_owns_its_padded_copy(bits: int, block: int, two_d: bool) -> None:
    """group_offsets (the kernel's and the host's one formula): group g's codes and scales
    start where the groups before it end, and span exactly its padded copy as the tile body
    addresses it (rowwise [pad, K] codes and [pad, K/B] scales, columnwise [K, pad] and
    [K, pad/B]; 2D tile scales [pad/B, K/B]), so the groups' copies tile the outputs."""
    pytest.importorskip("cutlass")
    from fp4gen.kernels.grouped_tile import group_offsets

    k = 96
    pads = padded_counts([37, 0, 5, 60, 300], block)
    start = 0
    for pad in pads:
        codes0, scales0 = group_offsets(start, k, bits, block, two_d)
        codes1, scales1 = group_offsets(start + pad, k, bits, block, two_d)
        assert codes1 - codes0 == pad * k * bits // 8  # [pad, K] or [K, pad] codes
        scales = (pad // block) * (k // block) if two_d else pad * k // block
        assert scales1 - scales0 == scales
        start += pad
    total = group_offsets(start, k, bits, block, two_d)
    assert total == (start * k * bits // 8, (start // block if two_d else start) * (k // block))


def test_bad_groups_are_one_line_errors() -> None:
    x = torch.randn(10, 32)
    fmt = BUILTIN_FORMATS["nvfp4"]
    col = [("columnwise", "nearest", None)]
    with pytest.raises(fp4gen.errors.TensorError, match=r"groups of \[4, 4\] rows"):
        quantize_groups_tile(x, [4, 4], [16, 16], fmt, col, seeds=[0, 0], offsets=[(0,), (0,)])
    with pytest.raises(fp4gen.FP4GenError, match="group 0 has 4 rows padded to 2"):
        quantize_groups_tile(x, [4, 6], [2, 16], fmt, col, seeds=[0, 0], offsets=[(0,), (0,)])
    with pytest.raises(fp4gen.FP4GenError, match="copies \\('columnwise', 'rowwise'\\)"):
        quantize_groups_tile(
            x, [4, 6], [16, 16], fmt, col + [("rowwise", "nearest", None)], seeds=[0, 0],
            offsets=[(0, 0), (0, 0)],
        )  # fmt: skip
    with pytest.raises(fp4gen.FP4GenError, match="backend='cute'.*a CPU tensor"):
        quantize_groups_tile(
            x, [4, 6], [16, 16], fmt, col, seeds=[0, 0], offsets=[(0,), (0,)], backend="cute"
        )


def test_the_definition_pads_each_group_and_transposes() -> None:
    """The definition the kernels are held to: group g's rows zero-padded to its padded count,
    the columnwise copy the quantization of the padded rows' transpose ([K, padded rows]), with
    the group's seed and offset; the 2D columnwise copy the transpose of the 2D rowwise one."""
    fmt = BUILTIN_FORMATS["nvfp4"]
    x = grouped_input("cpu")
    copies = copies_of(CASES["nvfp4_gradient_pair"][1])
    pads = pads_for(fmt, CASES["nvfp4_gradient_pair"][1])
    got = reference_groups_tile(x, COUNTS, pads, fmt, copies, SEEDS, offsets_for(copies))
    assert [g is None for g in got] == [c == 0 for c in COUNTS]
    start = 0
    for g, count in enumerate(COUNTS):
        if count == 0:
            continue
        rows = x[start : start + count].float()
        start += count
        padded = torch.zeros(pads[g], 128)
        padded[:count] = rows
        row, col = got[g]
        assert row.shape == (pads[g], 128) and col.shape == (128, pads[g])
        want = reference_quantize(
            padded.t().contiguous(), fmt, rounding="stochastic8", hadamard=rht(16),
            seed=SEEDS[g], offset=OFFSETS[g] + 8,
        )  # fmt: skip
        assert torch.equal(col.codes, want.codes) and torch.equal(col.scales, want.scales), g
        assert torch.equal(col.global_scale, want.global_scale), g
        assert torch.equal(row.codes[count:], torch.zeros_like(row.codes[count:]))  # padding
    # per group global scales (a single scale would be the largest group's)
    assert len({float(q[1].global_scale) for q in got if q is not None}) > 2
    w = torch.randn(4 * 32, 64)
    two_d = reference_groups_tile(
        w, [32] * 4, [32] * 4, nvfp4_2d(),
        [("rowwise", "nearest", None), ("columnwise", "nearest", None)], [1] * 4, [(0, 0)] * 4,
    )  # fmt: skip
    for e, (row, col) in enumerate(two_d):
        assert torch.equal(col.codes, row.codes.t()) and torch.equal(col.scales, row.scales.t())
        alone = reference_quantize(w[32 * e : 32 * (e + 1)], nvfp4_2d())
        assert torch.equal(row.codes, alone.codes) and torch.equal(row.scales, alone.scales)


def test_grouped_params_take_no_launch_wide_preparation(tmp_path: Path) -> None:
    """The grouped form keeps the spec's variant and drops only what one launch prepares for
    all its CTAs (a group has its own global scale): the prepared tables, the 2-D grid, the
    staged layout and its fold."""
    pytest.importorskip("cutlass")
    from fp4gen.kernels.grouped_tile import grouped_params, grouped_tile_reason

    module = _tile_module(tmp_path, "nvfp4", CASES["nvfp4_gradient_pair"][1])
    params = module.QUANT_PARAMS
    assert params.prep and params.staged and params.strip.grid_2d  # the dense launch's layout
    got = grouped_params(params)
    assert not (got.prep or got.staged or got.fold or got.strip.grid_2d or got.strip.whole_strips)
    assert (got.copies, got.block, got.elem, got.scale) == (
        params.copies,
        params.block,
        params.elem,
        params.scale,
    )
    assert grouped_tile_reason(got) is None
    swizzled = dataclasses.replace(
        got, copies=tuple(dataclasses.replace(c, swizzled=True) for c in got.copies)
    )
    assert "compact scales" in grouped_tile_reason(swizzled)


def _tile_module(tmp_path: Path, fmt: str, copies):
    from fp4gen.codegen.quantize import render
    from fp4gen.compiler.jit import import_source
    from fp4gen.compiler.spec import QuantOutput
    from fp4gen.runtime.cute_backend import _spec

    outputs = tuple(QuantOutput(d, r, h) for d, r, h in copies_of(copies))
    spec = _spec(fmt_of(fmt), torch.bfloat16, outputs)
    source = tmp_path / f"{spec.name}.py"
    source.write_text(render(spec))
    return import_source(source)


COMPILE_CASES = {
    **CASES,
    "nvfp4_2d_weight": ("nvfp4_2d", (("rowwise", "nearest", None),)),
    "nvfp4_2d_dgrad_weight": ("nvfp4_2d", (("columnwise", "nearest", None),)),
    "fp8_block_2d_dgrad_weight": ("fp8_block_2d", (("columnwise", "nearest", None),)),
}


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
@pytest.mark.parametrize("case", sorted(COMPILE_CASES))
def test_the_grouped_tile_kernels_cross_compile(tmp_path: Path, arch: str, case: str) -> None:
    """The grouped amax (with a global scale) and quantize kernels compile for both arches
    from the tile spec's parameters; the amax kernel issues one atomic max per amax slot (into
    its group's)."""
    pytest.importorskip("cutlass")
    from fp4gen.kernels.grouped_tile import grouped_params

    fmt, copies = COMPILE_CASES[case]
    module = _tile_module(tmp_path, fmt, copies)
    params = grouped_params(module.QUANT_PARAMS)
    fns = compile_grouped_tile(params, arch, module.K_MULTIPLE, dump_dir=str(tmp_path / "ptx"))
    global_scale = fmt_of(fmt).global_scale
    assert sorted(fns) == (["amax", "quantize"] if global_scale else ["quantize"])
    ptx = {p.name: p.read_text() for p in (tmp_path / "ptx").glob("*.ptx")}
    assert len(ptx) == len(fns)
    if params.copy("col") is not None and not params.two_d:
        # the columnwise copy side by side (the experts' wgrad operands) compiles too
        side = compile_grouped_tile(params, arch, module.K_MULTIPLE, side_by_side=True)
        assert sorted(side) == sorted(fns)
    if global_scale:
        (amax,) = [text for name, text in ptx.items() if "Amax" in name]
        assert amax.count("atom.global.max") == params.slots


# ---------------------------------------------------------------------------------------------
# The grouped experts with the definition standing in for the kernels
# ---------------------------------------------------------------------------------------------

# the NVFP4 method with every expert GEMM's operands in NVFP4 (16x16 weights; the gradients'
# pair, stochastic, the wgrad copies with RHT 16), per expert and per tensor; MXFP8
PER_TENSOR = 'extends "nvfp4_no_bf16"\noperands {\n    * : global per tensor\n}\n'
RECIPES = {
    "nvfp4_no_bf16": "nvfp4_no_bf16",
    "per_tensor": PER_TENSOR,
    "mxfp8": "operands {\n * : mxfp8_e4m3\n}\n",
}
# tile launches per step, by copies: per projection (two) the wgrad activation (columnwise)
# and the gradient pair, and with 16x16 weights the fprop (rowwise) and dgrad (columnwise)
# weight copies
WITH_2D = {("columnwise",): 4, ("rowwise", "columnwise"): 2, ("rowwise",): 2}
TILE_CALLS = {
    "nvfp4_no_bf16": WITH_2D,
    "per_tensor": WITH_2D,
    "mxfp8": {("columnwise",): 2, ("rowwise", "columnwise"): 2},
}


def definition_standing_in(real_reference):
    """quantize_groups_tile by the definition, with the rowwise copies' ``wholes`` (every group
    as one tensor) and, asked for side by side, the 1D columnwise copies' ``sides`` (every
    group's [K, padded rows] side by side) as the kernels give them; records each call's
    copies."""
    calls: list[tuple[str, ...]] = []

    def side(parts, fmt):
        if fmt.is_2d:
            return None
        return dataclasses.replace(
            parts[0],
            codes=torch.cat([q.codes for q in parts], dim=1),
            scales=torch.cat([q.scales for q in parts], dim=1),
            scale_codes=None,
            packed=None,
            shape=torch.Size((parts[0].shape[0], sum(q.shape[1] for q in parts))),
        )

    def stand_in(rows, counts, pads, fmt, copies, **kw):
        calls.append(tuple(d for d, _, _ in copies))
        kw = {**kw, "backend": "reference"}
        out = real_reference(rows, counts, pads, fmt, copies, kw["seeds"], kw["offsets"],
                             "reference", kw["scope"])  # fmt: skip
        side_by_side = kw.get("side_by_side", False)
        out.sides = tuple(
            side([g[i] for g in out if g is not None], fmt)
            if d == "columnwise" and side_by_side
            else None
            for i, (d, _, _) in enumerate(copies)
        )
        wholes = []
        for i, (direction, _, _) in enumerate(copies):
            parts = [g[i] for g in out if g is not None]
            if direction != "rowwise" and (None in out or len(set(pads)) != 1 or side_by_side):
                wholes.append(None)  # a columnwise copy is one tensor for groups of one size
                continue
            wholes.append(
                dataclasses.replace(
                    parts[0],
                    codes=torch.cat([q.codes for q in parts]),
                    scales=torch.cat([q.scales for q in parts]),
                    scale_codes=None,
                    packed=None,
                    shape=torch.Size((sum(q.shape[0] for q in parts), parts[0].shape[1])),
                )
            )
        out.wholes = tuple(wholes)
        return out

    return stand_in, calls


@pytest.mark.parametrize("every", [False, True], ids=["one_empty", "every_routed"])
@pytest.mark.parametrize("arch", ["mixtral", "gpt_oss"])
@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_grouped_tile_operands_are_the_loops_bits(
    monkeypatch,
    dequant_loop,  # noqa: F811
    arch,
    recipe,
    every,
) -> None:
    """The grouped path with its grouped tile quantize (the definition standing in for the
    kernels, so this runs on the CPU): every expert's wgrad activation, gradient pair and 2D
    weight copies with its seed, Philox offsets, padding, scope and (gpt-oss) transposed
    weight layout as its own layer's, so the results equal the loop's bit for bit over two
    steps (the call counts move the offsets), from one grouped launch per operand."""
    from test_moe import routing, run
    from test_moe_grouped import pair

    import fp4gen.runtime.grouped_quantize as gq
    import fp4gen.runtime.grouped_tile as gt
    from fp4gen.dsl import parse_recipe

    stand_in, calls = definition_standing_in(gt.reference_groups_tile)
    real_rows = gq.quantize_groups
    monkeypatch.setattr(grouped, "_serves", lambda t: True)
    monkeypatch.setattr(grouped, "_grouped_tile_quantize", [True])
    monkeypatch.setattr(gt, "quantize_groups_tile", stand_in)
    monkeypatch.setattr(
        gq, "quantize_groups", lambda *a, **kw: real_rows(*a, **{**kw, "backend": "reference"})
    )
    text = RECIPES[recipe]
    spec = parse_recipe(text) if "\n" in text else text
    loop, group = pair(arch, torch.bfloat16, spec)
    index, weights = routing(40, empty=None if every else 1)
    for step in range(2):
        hidden = torch.randn(40, 64, generator=torch.Generator().manual_seed(step))
        hidden = hidden.to(torch.bfloat16)
        want = run(loop, hidden, index, weights.to(torch.bfloat16))
        got = run(group, hidden, index, weights.to(torch.bfloat16))
        assert all(torch.equal(a, b) for a, b in zip(got[:3], want[:3], strict=True)), step
        assert all(torch.equal(got[3][n], want[3][n]) for n in want[3]), step
    assert {c: calls.count(c) for c in set(calls)} == {
        c: 2 * n for c, n in TILE_CALLS[recipe].items()
    }


def test_the_gradient_pairs_carry_every_dgrad_copy_as_one(monkeypatch) -> None:
    """grouped_gradients: per expert its (dgrad rowwise, wgrad columnwise) pair of its padded
    gradient [padded tokens, out] and its transpose, and ``whole``, every expert's dgrad copy
    as one tensor in the experts' order (one decode for the dgrad GEMM)."""
    from test_moe import build, experts_of

    import fp4gen.runtime.grouped_tile as gt

    stand_in, calls = definition_standing_in(gt.reference_groups_tile)
    monkeypatch.setattr(gt, "quantize_groups_tile", stand_in)
    monkeypatch.setattr(grouped, "_serves", lambda t: True)
    monkeypatch.setattr(grouped, "_grouped_tile_quantize", [True])
    module = experts_of(fp4gen.convert(build("mixtral"), "nvfp4_no_bf16"))
    groups = grouped.Groups([0, 2], [3, 20], [module.gemms[0][0], module.gemms[2][0]], False,
                            torch.float32, "up")  # fmt: skip
    dy = torch.randn(23, 64)
    pairs = grouped.grouped_gradients(dy, groups, 64)
    assert calls == [("rowwise", "columnwise")]
    assert [tuple(q.shape) for pair in pairs for q in pair] == [
        (16, 64), (64, 16), (32, 64), (64, 32),
    ]  # fmt: skip
    assert torch.equal(pairs.whole.codes, torch.cat([pairs[0][0].codes, pairs[1][0].codes]))
    assert torch.equal(pairs[0][0].codes[3:], torch.zeros(13, 64, dtype=torch.uint8))


def test_the_switches_of_the_grouped_tile_quantize(monkeypatch) -> None:
    """The grouped tile quantize is on by default (set_grouped_tile_quantize: its GPU tests
    passed); on, it serves CUDA tensors only; set_grouped_quantize(False) turns it off too.
    None: each expert's layer quantizes its own."""
    from test_moe import build, experts_of

    module = experts_of(fp4gen.convert(build("mixtral"), "nvfp4_no_bf16"))
    groups = grouped.Groups([0, 1], [3, 4], [module.gemms[0][0], module.gemms[1][0]], False,
                            torch.float32, "up")  # fmt: skip
    seen: list[int] = []
    monkeypatch.setattr(grouped, "grouped_tile_operands", lambda *a, **kw: seen.append(1))
    monkeypatch.setattr(grouped, "_serves", lambda t: grouped._grouped_quantize[0])
    x, dy = torch.randn(7, 64), torch.randn(7, 32)
    assert grouped.set_grouped_tile_quantize(True) is True  # the default
    try:
        assert grouped.grouped_wgrad_activations(x, groups) is None
        assert grouped.grouped_gradients(dy, groups, 32) is None
        assert len(seen) == 2  # on: both went to the grouped tile quantize
        assert grouped.set_grouped_quantize(False) is True
        try:
            assert grouped.grouped_wgrad_activations(x, groups) is None
            assert grouped.grouped_gradients(dy, groups, 32) is None
        finally:
            grouped.set_grouped_quantize(True)
        assert len(seen) == 2  # off: neither did
    finally:
        grouped.set_grouped_tile_quantize(False)
    try:
        assert grouped.grouped_wgrad_activations(x, groups) is None
        assert len(seen) == 2  # turned off: not asked
    finally:
        grouped.set_grouped_tile_quantize(True)
    monkeypatch.undo()
    # on the CPU the tile kernels never run (each expert's layer quantizes)
    assert grouped.grouped_wgrad_activations(x, groups) is None


def test_a_refused_grouped_tile_launch_is_logged_once(monkeypatch, caplog) -> None:
    """Where the grouped tile kernels refuse (here: CPU tensors reaching them), each expert's
    layer quantizes its own (None) and the reason is logged once, at INFO, logger
    fp4gen.runtime.grouped."""
    import logging

    from log_records import fresh_log_records
    from test_moe import build, experts_of

    fresh_log_records(monkeypatch)
    module = experts_of(fp4gen.convert(build("mixtral"), "nvfp4_no_bf16"))
    groups = grouped.Groups([0, 1], [3, 4], [module.gemms[0][0], module.gemms[1][0]], False,
                            torch.float32, "up")  # fmt: skip
    monkeypatch.setattr(grouped, "_serves", lambda t: True)
    monkeypatch.setattr(grouped, "_grouped_tile_quantize", [True])
    with caplog.at_level(logging.INFO, logger="fp4gen.runtime.grouped"):
        for _ in range(3):
            assert grouped.grouped_wgrad_activations(torch.randn(7, 64), groups) is None
    lines = [r.getMessage() for r in caplog.records if r.name == "fp4gen.runtime.grouped"]
    assert lines == [
        "the experts' wgrad.activation operands are quantized per expert: "
        "quantize_groups_tile(backend='cute'): a CPU tensor"
    ]


# ---------------------------------------------------------------------------------------------
# On a GPU
# ---------------------------------------------------------------------------------------------


def _differences(got, want, what: str) -> list[str]:
    from test_recipe_fuzz_gpu import differences

    return differences(got, want, what)


def case_inputs(case: str, scope: str) -> tuple:
    """A GPU case's (format, copies, padded counts, CUDA input, Philox offsets); skipped per
    tensor for a format without a global scale."""
    fmt_name, raw = CASES[case]
    fmt = fmt_of(fmt_name)
    if scope == "tensor" and not fmt.global_scale:
        pytest.skip(f"{fmt_name} has no global scale")
    copies = copies_of(raw)
    return fmt, copies, pads_for(fmt, raw), grouped_input("cuda"), offsets_for(copies)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("scope", ["expert", "tensor"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_cuda_grouped_tile_quantize_is_the_reference_per_group(case: str, scope: str) -> None:
    """One launch (two with a global scale) for six groups, two of them empty, from 5 to 300
    rows (several CTAs, partial tiles, padding rows inside a tile), magnitudes 2^30 apart:
    each group's copies (codes, scales, S_dec) are the definition's bit for bit, per expert and
    per tensor; a NaN in one group makes only its S_decs NaN."""
    fmt, copies, pads, x, offsets = case_inputs(case, scope)
    got = quantize_groups_tile(
        x, COUNTS, pads, fmt, copies, seeds=SEEDS, offsets=offsets, backend="cute", scope=scope
    )
    want = reference_groups_tile(x.cpu(), COUNTS, pads, fmt, copies, SEEDS, offsets,
                                 "reference", scope)  # fmt: skip
    assert [g is None for g in got] == [c == 0 for c in COUNTS]
    bad = [
        d
        for g, (a, b) in enumerate(zip(got, want, strict=True))
        if b is not None
        for i in range(len(copies))
        for d in _differences(a[i], b[i], f"group {g} copy {i}")
    ]
    assert not bad, "\n".join(bad)
    if scope == "expert":
        x[COUNTS[0] + 2, 3] = float("nan")  # group 2's third row
        with fp4gen.runtime.finite.propagating():
            got = quantize_groups_tile(
                x, COUNTS, pads, fmt, copies, seeds=SEEDS, offsets=offsets, backend="cute"
            )
        nan = [g is not None and all(bool(torch.isnan(q.global_scale)) for q in g) for g in got]
        assert nan == [False, False, True, False, False, False]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("scope", ["expert", "tensor"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_cuda_side_by_side_columns_are_the_reference_per_group(case: str, scope: str) -> None:
    """The columnwise copy laid out side by side (the experts' wgrad operands): the one [K,
    sum of padded rows] copy holds every group's definition codes and scales in its columns,
    group after group (empty groups none), bit for bit; each group read on its own is the
    definition's too, and a rowwise copy of the same launch keeps its layout."""
    fmt, copies, pads, x, offsets = case_inputs(case, scope)
    got = quantize_groups_tile(
        x, COUNTS, pads, fmt, copies, seeds=SEEDS, offsets=offsets, backend="cute",
        scope=scope, side_by_side=True,
    )  # fmt: skip
    want = reference_groups_tile(x.cpu(), COUNTS, pads, fmt, copies, SEEDS, offsets,
                                 "reference", scope)  # fmt: skip
    col = [d for d, _, _ in copies].index("columnwise")
    side = got.sides[col]
    assert side is not None and tuple(side.shape) == (x.shape[1], sum(pads))
    parts = [w[col] for w in want if w is not None]
    want_side = dataclasses.replace(
        parts[0],
        codes=torch.cat([q.codes for q in parts], dim=1),
        scales=torch.cat([q.scales for q in parts], dim=1),
        scale_codes=None,
        packed=None,
        shape=torch.Size((x.shape[1], sum(pads))),
    )
    bad = _differences(side, want_side, "side by side")
    bad += [
        d
        for g, (a, b) in enumerate(zip(got, want, strict=True))
        if b is not None
        for i in range(len(copies))
        for d in _differences(a[i], b[i], f"group {g} copy {i}")
    ]
    assert not bad, "\n".join(bad)
    assert got.wholes[col] is None  # unequal groups: no [groups x K, rows] copy


def test_k_past_whole_blocks_is_refused() -> None:
    """The grouped layout holds K / B scales per row (and K x rows / B for a columnwise copy):
    a K that is not a multiple of the block length B is refused with its numbers (the kernel
    would write a partial block's scales past its buffers; an experts model with hidden 64 and
    fp8_blockwise's 1x128 blocks once did, an illegal address on the H200)."""
    assert k_reason(64, fp8_block()) == "K = 64 is not a multiple of the block length 128"
    assert k_reason(192, fp8_block(128)) == "K = 192 is not a multiple of the block length 128"
    assert k_reason(24, BUILTIN_FORMATS["nvfp4"]) == (
        "K = 24 is not a multiple of the block length 16"
    )
    assert k_reason(256, fp8_block()) is None
    assert k_reason(48, BUILTIN_FORMATS["nvfp4"]) is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("k", [64, 192])
def test_cuda_k_past_whole_blocks_is_the_reference_per_group(k: int) -> None:
    """fp8_blockwise's wgrad-activation copy (columnwise 1x128) of rows with K = 64 or 192:
    "cute" refuses naming K, "auto" quantizes the groups one by one, each group's copy the
    definition's bit for bit (before the refusal the kernel wrote past its scale buffer)."""
    fmt = fp8_block()
    copies = copies_of((("columnwise", "nearest", None),))
    pads = pads_for(fmt, (("columnwise", "nearest", None),))
    x = grouped_input("cuda", k=k)
    offsets = offsets_for(copies)
    with pytest.raises(fp4gen.FP4GenError, match=f"K = {k} is not a multiple"):
        quantize_groups_tile(x, COUNTS, pads, fmt, copies, seeds=SEEDS, offsets=offsets,
                             backend="cute")  # fmt: skip
    got = quantize_groups_tile(x, COUNTS, pads, fmt, copies, seeds=SEEDS, offsets=offsets)
    want = reference_groups_tile(x.cpu(), COUNTS, pads, fmt, copies, SEEDS, offsets,
                                 "reference", "expert")  # fmt: skip
    bad = [
        d
        for g, (a, b) in enumerate(zip(got, want, strict=True))
        if b is not None
        for d in _differences(a[0], b[0], f"group {g}")
    ]
    assert not bad, "\n".join(bad)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("scope", ["expert", "tensor"])
@pytest.mark.parametrize("direction", ["rowwise", "columnwise"])
@pytest.mark.parametrize("fmt_name", ["nvfp4_2d", "fp8_block_2d"])
def test_cuda_grouped_2d_weights_are_the_reference_per_expert(
    fmt_name: str, direction: str, scope: str
) -> None:
    """The batched expert weights [E x N, K] with 16x16 (NVFP4) or 128x128 (fp8_blockwise)
    tiles in one launch: each expert's rowwise copy (fprop) or columnwise copy (dgrad: the
    transposed codes and tile scales) is the definition's bit for bit, per expert and per
    tensor; weights of very unequal magnitudes."""
    fmt = fmt_of(fmt_name)
    if scope == "tensor" and not fmt.global_scale:
        pytest.skip(f"{fmt_name} has no global scale")
    experts, n, k = (5, 48, 96) if fmt.block[0] == 16 else (3, 256, 384)
    g = torch.Generator().manual_seed(7)
    w = torch.cat([torch.randn(n, k, generator=g) * 2.0 ** (8 * e - 16) for e in range(experts)])
    w = w.to(torch.bfloat16)
    copies = [(direction, "nearest", None)]
    counts = [n] * experts
    offsets = [(0,)] * experts
    got = quantize_groups_tile(
        w.cuda(), counts, counts, fmt, copies, seeds=[1] * experts, offsets=offsets,
        backend="cute", scope=scope,
    )  # fmt: skip
    want = reference_groups_tile(w, counts, counts, fmt, copies, [1] * experts, offsets,
                                 "reference", scope)  # fmt: skip
    bad = [d for e in range(experts) for d in _differences(got[e][0], want[e][0], f"expert {e}")]
    assert not bad, "\n".join(bad)
    if direction == "rowwise":  # every expert as one tensor: the groups' codes and scales
        whole = got.wholes[0]
        assert torch.equal(whole.codes.cpu(), torch.cat([q[0].codes for q in want]))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss"])
@pytest.mark.parametrize("recipe", ["nvfp4_no_bf16", "per_tensor"])
def test_cuda_grouped_tile_quantize_in_the_experts_is_the_loops(monkeypatch, arch, recipe) -> None:
    """On CUDA with the grouped tile kernels: every expert's wgrad activation, gradient pair and
    16x16 weight copies in one launch per operand (eight per step: none fell back), and every
    expert GEMM's operands the per-expert loop's bit for bit (tests/moe_harness.py), with the
    products handed on the results too, very unequal groups with an empty expert."""
    from moe_harness import harnessed_run, operand_differences, result_differences
    from test_moe_grouped import pair, unequal_routing

    import fp4gen.runtime.grouped_tile as gt
    from fp4gen.dsl import parse_recipe

    calls: list[str] = []
    real = gt.quantize_groups_tile
    monkeypatch.setattr(grouped, "_grouped_tile_quantize", [True])

    def counted(*args, **kw):
        got = real(*args, **kw)  # a refusal raises: only launches that served are counted
        calls.append(kw["backend"])
        return got

    monkeypatch.setattr(gt, "quantize_groups_tile", counted)
    text = RECIPES[recipe]
    spec = parse_recipe(text) if "\n" in text else text
    loop, group = pair(arch, torch.bfloat16, spec, "cuda")
    index, weights = unequal_routing()
    hidden = torch.randn(70, 64).to(torch.bfloat16).cuda()
    args = (hidden, index.cuda(), weights.to(torch.bfloat16).cuda())
    want = harnessed_run(loop, *args, check=True)
    got = harnessed_run(group, *args, check=True)
    assert calls == ["cute"] * sum(TILE_CALLS[recipe].values())
    problems = want.harness.problems + got.harness.problems
    problems += operand_differences(got.harness, want.harness)
    problems += result_differences(got, want)
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("equal", [False, True], ids=["unequal", "equal"])
@pytest.mark.parametrize("direction", ["rowwise", "columnwise"])
@pytest.mark.parametrize(
    ("bits", "block", "two_d"), [(4, 16, False), (4, 16, True), (8, 32, False)]
)
def test_group_pieces_are_where_the_kernels_write_each_group(
    direction, bits, block, two_d, equal
) -> None:
    """The views the host hands out per group (two splits per copy; groups of one size, the
    weights': one view and unbind per buffer) hold the bytes and scales at the kernels' offsets
    (``group_offsets``), in each group's shape and strides; empty groups none."""
    from fp4gen.kernels.grouped_tile import group_offsets
    from fp4gen.runtime.grouped_tile import group_pieces

    # whole blocks of rows (the kernels' rule)
    k, pads = 64, [2 * block] * 3 if equal else [2 * block, 0, block, 4 * block]
    total = sum(pads)
    codes = torch.arange(total * k * bits // 8, dtype=torch.int64).to(torch.uint8)
    scale_rows = total // block if two_d else total
    scales = torch.arange(scale_rows * (k // block), dtype=torch.float32)
    got = group_pieces(codes, scales, pads, k, bits, block, two_d, direction)
    start = 0
    for pad, piece in zip(pads, got, strict=True):
        if pad == 0:
            assert piece is None
            continue
        at, s_at = group_offsets(start, k, bits, block, two_d)
        end, s_end = group_offsets(start + pad, k, bits, block, two_d)
        want_codes, want_scales = codes[at:end], scales[s_at:s_end]
        c, s = piece  # type: ignore[misc]
        rows = pad if direction == "rowwise" else k
        scale_rows_g = (pad if direction == "rowwise" else k) // (block if two_d else 1)
        assert c.shape == (rows, want_codes.numel() // rows)
        assert s.shape == (scale_rows_g, want_scales.numel() // scale_rows_g)
        assert torch.equal(c.reshape(-1), want_codes) and torch.equal(s.reshape(-1), want_scales)
        assert c.data_ptr() == want_codes.data_ptr() and s.data_ptr() == want_scales.data_ptr()
        assert c.is_contiguous() and s.is_contiguous()
        start += pad


@pytest.mark.parametrize(("bits", "block"), [(4, 16), (8, 32), (8, 128)])
def test_side_by_side_pieces_are_each_groups_columns(bits: int, block: int) -> None:
    """Side by side, group g's columnwise codes and scales are the columns of the one [K, sum
    of padded rows] copy from its first padded row on (bytes from row x bits / 8, scales from
    row / B), as the kernel writes them; views of that copy, none for an empty group."""
    from fp4gen.runtime.grouped_tile import group_pieces

    k, pads = 256, [2 * block, 0, block, 4 * block]  # K: whole blocks (the kernels' rule)
    total = sum(pads)
    codes = torch.arange(total * k * bits // 8, dtype=torch.int64).to(torch.uint8)
    scales = torch.arange(total * (k // block), dtype=torch.float32)
    whole_codes, whole_scales = codes.view(k, -1), scales.view(k, -1)
    got = group_pieces(codes, scales, pads, k, bits, block, False, "columnwise", True)
    start = 0
    for pad, piece in zip(pads, got, strict=True):
        if pad == 0:
            assert piece is None
            continue
        c, s = piece  # type: ignore[misc]
        byte0, byte1 = start * bits // 8, (start + pad) * bits // 8
        assert torch.equal(c, whole_codes[:, byte0:byte1])
        assert torch.equal(s, whole_scales[:, start // block : (start + pad) // block])
        assert c.stride() == (total * bits // 8, 1) and s.stride() == (total // block, 1)
        assert c.data_ptr() == whole_codes[:, byte0:].data_ptr()
        start += pad
    # the rowwise copy of the same launch keeps its layout
    rows = group_pieces(codes, scales, pads, k, bits, block, False, "rowwise", True)
    assert rows[0][0].shape == (2 * block, k * bits // 8) and rows[0][0].is_contiguous()
