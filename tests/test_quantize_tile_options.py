"""The tile quantize kernel with block targets (Four Over Six) and stochastic block scales on 2D
tiles (docs/numerics.md 11.1-11.2), without a GPU: the render context, cross-compilation for
sm_90a and sm_100a (the error tree's explicit roundings counted in the PTX, the Philox calls
present exactly where the kernel draws), the host's Philox arguments, the refusals, and the
switch that routes these operands to the kernel (off by default:
``cute_backend.set_tile_option_kernels``). Their bits against the reference are checked on a
GPU (tests/test_quantize_tile_options_gpu.py)."""

from __future__ import annotations

import dataclasses
import os
import struct
from pathlib import Path

import pytest
from option_kernels import tile_options_on  # noqa: F401  (a fixture)

from fp4gen.codegen import import_source
from fp4gen.codegen.quantize import render, tile_context, tile_options_refusal
from fp4gen.compiler.plan import (
    kernel_spec,
    plan_recipe,
    rowwise_only_reason,
    tile_options,
    tile_reason,
)
from fp4gen.dsl import load_recipe
from fp4gen.dsl.model import Operand
from fp4gen.formats import BUILTIN_FORMATS, E4M3, UE8M0, BlockFormat, ScaleSpec
from fp4gen.spec import QuantKernelSpec, QuantOutput

ROOT = Path(__file__).resolve().parent.parent
NVFP4 = BUILTIN_FORMATS["nvfp4"]
MXFP4 = BUILTIN_FORMATS["mxfp4"]
MXFP8 = BUILTIN_FORMATS["mxfp8_e4m3"]


def fmt(base: BlockFormat, block: int, **options) -> BlockFormat:
    return dataclasses.replace(base, name="t", **options).with_block((block, block))


FOUR_OVER_SIX = fmt(NVFP4, 16, targets=(6.0, 4.0), global_bound=256.0)
SR_E4M3 = ScaleSpec(E4M3, "stochastic")
PAIR = (QuantOutput("rowwise", "nearest", None), QuantOutput("columnwise", "nearest", None))
ROW = (QuantOutput("rowwise", "nearest", None),)
# (format, input dtype, outputs)
CASES: dict[str, tuple[BlockFormat, str, tuple[QuantOutput, ...]]] = {
    # nvfp4_4over6's weight: bf16, both copies (the columnwise codes the transposed words)
    "4over6_16x16": (FOUR_OVER_SIX, "bf16", PAIR),
    # fp32 input: the columnwise codes encoded per column; MAE
    "4over6_mae_16x16_fp32": (
        fmt(NVFP4, 16, targets=(6.0, 4.0), target_error="mae"),
        "fp32",
        PAIR,
    ),
    "sr_scales_16x16_row": (fmt(NVFP4, 16, scale=SR_E4M3), "bf16", ROW),
    "4over6_sr_scales_sr8_16x16": (
        fmt(NVFP4, 16, targets=(6.0, 4.0), global_bound=256.0, scale=SR_E4M3),
        "bf16",
        (
            QuantOutput("rowwise", "stochastic8", None),
            QuantOutput("columnwise", "stochastic8", None),
        ),
    ),
    # 32x32 tiles over 8 lanes, no global scale, UE8M0 scales
    "mxfp4_targets_32x32": (fmt(MXFP4, 32, targets=(6.0, 4.0)), "bf16", PAIR),
    "mxfp4_sr_scales_32x32_fp32": (
        fmt(MXFP4, 32, scale=ScaleSpec(UE8M0, "stochastic")),
        "fp32",
        PAIR,
    ),
    "mxfp8_targets_mae_32x32": (
        fmt(MXFP8, 32, targets=(448.0, 256.0), target_error="mae"),
        "bf16",
        PAIR,
    ),
}


def spec_of(case: str) -> QuantKernelSpec:
    f, dtype, outputs = CASES[case]
    return kernel_spec(f, dtype, outputs)  # type: ignore[arg-type]


def test_render_context_of_four_over_six_tiles() -> None:
    """The spec's options reach the tile parameters: fp32(1 / T) per target, the error, the
    stochastic scales, and a Philox offset per copy where the scales draw."""
    c = tile_context(spec_of("4over6_16x16"))
    inv6 = struct.unpack("f", struct.pack("f", 1 / 6))[0]  # fp32(1 / 6)
    assert c.two_d and c.target_invs == (inv6, 0.25) and not c.target_mae
    assert not c.scale_sr and not c.sr and c.sr_args == ()
    mae = tile_context(spec_of("4over6_mae_16x16_fp32"))
    assert mae.target_mae and not mae.transpose  # fp32: the columnwise codes per column
    srs = tile_context(spec_of("sr_scales_16x16_row"))
    assert srs.scale_sr and srs.sr and srs.target_invs == ()
    assert srs.sr_args == (
        "seed_lo",
        "seed_hi",
        "offset0_lo",
        "offset0_hi",
        "ctr_lo",
        "ctr_hi",
        "stride_lo",
        "stride_hi",
    )
    both = tile_context(spec_of("4over6_sr_scales_sr8_16x16"))
    assert [o.sr_index for o in both.outputs] == [0, 1]
    module = render(spec_of("4over6_16x16"))
    assert "target_invs=(" in module and "scale_sr" not in module
    plain = render(kernel_spec(NVFP4.with_block((16, 16)), "bf16", PAIR))
    assert "target_invs" not in plain and "scale_sr" not in plain


def test_what_the_tile_kernel_refuses() -> None:
    """1xB blocks keep the rowwise kernel; tiles across strips or warps (128x128) are refused
    with the reason; a 1D tile spec with targets still raises."""
    assert tile_options_refusal((16, 16), 2) is None
    assert tile_options_refusal((32, 32), 4) is None
    assert "rowwise kernel" in (tile_options_refusal((1, 16), 2) or "")
    assert "32x32" in (tile_options_refusal((128, 128), 2) or "")
    one_d = dataclasses.replace(NVFP4, name="o", targets=(6.0, 4.0))
    with pytest.raises(NotImplementedError, match="rowwise kernel only"):
        render(kernel_spec(one_d, "bf16", PAIR))  # type: ignore[arg-type]
    wide = fmt(MXFP8, 128, targets=(448.0, 256.0))
    with pytest.raises(NotImplementedError, match="32x32"):
        render(kernel_spec(wide, "bf16", PAIR))  # type: ignore[arg-type]


@pytest.mark.parametrize("case", sorted(CASES))
def test_tile_option_kernels_cross_compile(case: str, tmp_path: Path) -> None:
    """The quantize kernel of each variant compiles for sm_90a and sm_100a; Philox4x32-10's
    multiplier is in the PTX exactly where the kernel draws (element SR or scale SR); with
    targets the error's products and sums are explicit mul.rn / add.rn (never contracted into
    an fma): per target 2 products (or 1 for mae) per value and, per tile, the rows' trees, the
    butterflies across the tile's lanes and the tree over the rows."""
    spec = spec_of(case)
    f, dtype, outputs = CASES[case]
    os.environ.setdefault("CUTE_DSL_NO_CACHE", "1")
    module = import_source(render(spec), tmp_path / "src")
    p = module.QUANT_PARAMS
    for arch in ("sm_90a", "sm_100a"):
        keep = tmp_path / "ptx" / arch
        module.compile_kernel("quantize", arch, dump_dir=str(keep))
        (ptx,) = keep.glob(f"*.{arch}.ptx")
        text = ptx.read_text()
        draws = any(o.rounding != "nearest" for o in outputs) or f.scale.rounding == "stochastic"
        assert ("-766435501" in text or "3528531795" in text) == draws, case
        ops = [line.split()[0] for line in text.splitlines() if line.strip()]
        if f.targets:
            values = p.strip.rows * p.strip.vec
            per_value = 1 if p.target_mae else 2
            assert ops.count("mul.rn.f32") == len(f.targets) * per_value * values
            row_tree = p.strip.vec - 1 + len(p.strip.row_offsets)
            adds = p.strip.rows * row_tree + p.strip.rows - 1
            assert ops.count("add.rn.f32") == len(f.targets) * adds
            assert ops.count("sub.rn.f32") == len(f.targets) * values


def test_the_kernel_takes_a_philox_offset_per_copy_for_stochastic_scales(tmp_path: Path) -> None:
    """Stochastic tile scales with round-to-nearest codes: the kernel still takes the seed, one
    offset per copy and the counter words (the tiles draw from the first copy's stream); the
    entries spell them."""
    spec = spec_of("mxfp4_sr_scales_32x32_fp32")
    source = render(spec)
    module = import_source(source, tmp_path / "src")
    p = module.QUANT_PARAMS
    assert p.scale_sr and p.sr and p.n_sr == 2 and p.philox_args == 2 * (3 + 2)
    assert all(p.draws(c) and not c.sr_bits for c in p.copies)
    assert source.count("offset1_hi: Int32,") == 2  # __call__ and kernel


def test_the_switch_routes_when_on(tile_options_on: None) -> None:  # noqa: F811
    """With the switch on (the default), a 16x16 Four Over Six weight gets a tile kernel from the
    planner and the runtime takes the tile launch; 128x128 tiles and 1D blocks are as before."""
    assert tile_options(FOUR_OVER_SIX)
    assert rowwise_only_reason(FOUR_OVER_SIX) is None and tile_reason(FOUR_OVER_SIX) is None
    assert rowwise_only_reason(fmt(MXFP8, 128, targets=(448.0, 256.0))) is not None
    one_d = dataclasses.replace(NVFP4, name="o", targets=(6.0, 4.0))
    assert tile_reason(one_d) is not None
    plan = plan_recipe(load_recipe(ROOT / "fp4gen" / "recipes" / "nvfp4_4over6.fp4r"))
    weight = plan.kernel_for(Operand.FPROP_WEIGHT)
    assert weight is not None and weight.spec.block == (16, 16)
    assert weight.spec.targets == (6.0, 4.0)


def test_the_switch_off_keeps_the_reference() -> None:
    """Off (``set_tile_option_kernels(False)``; on is the default since the kernel's GPU tests
    passed), the planner sends 2D operands with targets to the reference with the reason, as
    before the tile kernel implemented them."""
    from fp4gen.runtime import cute_backend

    previous = cute_backend.set_tile_option_kernels(False)
    try:
        assert previous is True  # the default
        assert not tile_options(FOUR_OVER_SIX)
        assert "16x16 blocks" in (rowwise_only_reason(FOUR_OVER_SIX) or "")
        plan = plan_recipe(load_recipe(ROOT / "fp4gen" / "recipes" / "nvfp4_4over6.fp4r"))
        assert plan.kernel_for(Operand.FPROP_WEIGHT) is None
    finally:
        cute_backend.set_tile_option_kernels(previous)


def test_grouped_tile_kernels_refuse_the_options() -> None:
    """The grouped tile kernels (experts) do not take block targets or stochastic tile scales:
    their params are refused with the reason, so each expert's copy is quantized on its own."""
    import importlib

    grouped = importlib.import_module("fp4gen.kernels.grouped_tile")
    module = import_source(
        render(spec_of("4over6_16x16")),
        Path(os.environ.get("TMPDIR", "/tmp")) / "tile_opts_grouped",
    )
    assert "dense tile kernel" in (grouped.grouped_tile_reason(module.QUANT_PARAMS) or "")


@pytest.mark.parametrize(("block", "vec"), [(16, 8), (16, 4), (32, 4)])
@pytest.mark.parametrize("rows", [16, 32, 5, 24])
def test_the_kernels_error_order_is_the_references_tree(block: int, vec: int, rows: int) -> None:
    """The tile kernel sums a tile's errors as: the tree of each thread's vec values of a row,
    the tree across the tile's row_lanes lanes (xor butterflies), then the tree over the tile's
    rows, rows past M counting 0. That is the reference's tree_sum over the tile's elements in
    row-major order (``numerics.quantize._block_error``), bit for bit, also where M is not a
    multiple of the tile (the reference's tile of min(B, M) rows or zero-padded rows): checked
    here on fp32 values spread over 2^-30 .. 2^30, where another order rounds differently."""
    import torch

    from fp4gen.numerics.quantize import _per_block, tree_sum

    g = torch.Generator().manual_seed(block * 1000 + vec * 10 + rows)
    k = 4 * block
    mags = torch.exp2(torch.randint(-30, 31, (rows, k), generator=g).float())
    errs = torch.rand(rows, k, generator=g) * mags
    br = min(block, rows)  # the reference's tile rows (numerics.quantize: min(B, M))
    nbr = -(-rows // br)
    padded = torch.nn.functional.pad(errs, (0, 0, 0, nbr * br - rows))
    want = tree_sum(_per_block(padded, br, block))
    # the kernel's order: a tile row of B rows, those past M zero
    tiles_m = -(-rows // block)
    zeroed = torch.nn.functional.pad(errs, (0, 0, 0, tiles_m * block - rows))
    per_thread = tree_sum(zeroed.reshape(tiles_m * block, k // vec, vec))  # [rows, chunks]
    lanes = block // vec
    per_row = tree_sum(per_thread.reshape(tiles_m * block, k // block, lanes))  # butterflies
    got = tree_sum(per_row.reshape(tiles_m, block, k // block).transpose(1, 2))  # over rows
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))
    # and a column-major order (x.t()'s tree) differs somewhere: the order matters
    if rows % block == 0:
        other = tree_sum(_per_block(padded.t().contiguous(), block, br)).t()
        assert not torch.equal(other, want)


def test_fp32_scales_with_targets_on_tiles_go_to_the_reference() -> None:
    """Block targets with fp32 block scales on 2D tiles: the tile kernel's choice of target keeps
    coded scales (compiled, the fp32 choice failed on a type error, met by the GPU fuzzer), so
    the plan gives such operands to the reference, saying why, and the kernel spec is refused
    by name rather than compiled."""
    from fp4gen.compiler.plan import rowwise_only_reason, tile_options

    fp32_scale = ScaleSpec(None, "nearest")
    f = fmt(NVFP4, 16, targets=(6.0, 4.0), scale=fp32_scale, global_scale=False)
    assert not tile_options(f)
    assert "reference quantizes these operands" in (rowwise_only_reason(f) or "")
    with pytest.raises(NotImplementedError, match="fp32 block scales on 2D tiles"):
        render(kernel_spec(f, "bf16", PAIR))  # type: ignore[arg-type]
    # coded scales with targets stay the tile kernel's
    assert tile_options(FOUR_OVER_SIX)
