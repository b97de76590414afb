"""The rowwise quantize kernels with the block-scale options of docs/numerics.md 11.1-11.2
(block targets, a global bound, stochastic block scales), without a GPU: the specs, the render
context, cross-compilation for sm_90a and sm_100a, the planner's and the runtime's routing.
Their bits against the reference are checked on a GPU (tests/test_quantize_options_gpu.py)."""

from __future__ import annotations

import ast
import dataclasses
import json
import os
from pathlib import Path

import pytest
import torch
from option_kernels import option_kernels_on, tile_options_off  # noqa: F401  (fixtures)

from fp4gen.codegen import import_source
from fp4gen.codegen.quantize import context, is_rowwise, render
from fp4gen.compiler.aot import quantize_uses
from fp4gen.compiler.build import render_plan
from fp4gen.compiler.plan import (
    kernel_spec,
    plan_recipe,
    rowwise_only_reason,
    tile_reason,
)
from fp4gen.dsl import load_recipe
from fp4gen.dsl.model import Operand, RHTSpec
from fp4gen.formats import BUILTIN_FORMATS, E4M3, UE8M0, ScaleSpec
from fp4gen.spec import QuantKernelSpec, QuantOutput

ROOT = Path(__file__).resolve().parent.parent
NVFP4 = BUILTIN_FORMATS["nvfp4"]
MXFP4 = BUILTIN_FORMATS["mxfp4"]
FOUR_OVER_SIX = dataclasses.replace(NVFP4, name="f46", targets=(6.0, 4.0), global_bound=256.0)
SR_SCALES = dataclasses.replace(NVFP4, name="srs", scale=ScaleSpec(E4M3, "stochastic"))


def row(rounding: str = "nearest", rht: RHTSpec | None = None) -> tuple[QuantOutput, ...]:
    return (QuantOutput("rowwise", rounding, rht),)  # type: ignore[arg-type]


def test_a_spec_without_options_keeps_its_repr_digest_and_name() -> None:
    """The options appear in the repr (so in the digest, the kernel cache's key) only where set:
    the shipped recipes' kernels keep the digests their generated sources were written with."""
    spec = kernel_spec(NVFP4, "bf16", row())
    assert "targets" not in repr(spec) and "global_bound" not in repr(spec)
    assert spec.name == "quant_e2m1_1x16_e4m3rn_g_bf16_row_rne"
    manifest = json.loads((ROOT / "generated" / "nvfp4_no_rht" / "manifest.json").read_text())
    digests = {k["name"]: k["spec"].get("digest") for k in manifest["kernels"] if "spec" in k}
    assert digests[spec.name] == spec.digest
    assert spec == QuantKernelSpec(NVFP4.element, (1, 16), NVFP4.scale, True, "bf16", row())


def test_option_specs_are_named_and_digested_apart() -> None:
    f46 = kernel_spec(FOUR_OVER_SIX, "bf16", row("stochastic8", RHTSpec(16)))
    assert f46.name == "quant_e2m1_1x16t6x4_e4m3rn_g256_bf16_row_sr8_rht16"
    mae = kernel_spec(dataclasses.replace(FOUR_OVER_SIX, target_error="mae"), "bf16", row())
    assert mae.name == "quant_e2m1_1x16t6x4mae_e4m3rn_g256_bf16_row_rne"
    assert kernel_spec(SR_SCALES, "bf16", row()).name == "quant_e2m1_1x16_e4m3rs_g_bf16_row_rne"
    specs = [f46, mae, kernel_spec(NVFP4, "bf16", row("stochastic8", RHTSpec(16)))]
    assert len({s.digest for s in specs}) == 3
    assert "targets=(6.0, 4.0), target_error='mse', global_bound=256.0" in repr(f46)


def test_render_context_of_four_over_six() -> None:
    ctx = context(kernel_spec(FOUR_OVER_SIX, "bf16", row()))
    # fp32(1 / 6) and 1 / 4; S_enc's numerator fp32(256 * 6)
    assert ctx.target_invs == (float(torch.tensor(1 / 6, dtype=torch.float32)), 0.25)
    assert not ctx.target_mae and not ctx.scale_sr and not ctx.philox
    assert float(ctx.common.global_num) == 1536.0
    assert ctx.global_bound == "256.0"
    sr = context(kernel_spec(SR_SCALES, "bf16", row()))
    assert sr.scale_sr and sr.philox and not sr.sr and sr.target_invs == ()
    source = render(kernel_spec(FOUR_OVER_SIX, "bf16", row()))
    assert "BLOCK_TARGET_INVS: tuple[float, ...] = (0.1666666716337204, 0.25)" in source
    assert "GLOBAL_NUM = 1536.0  # fp32(GLOBAL_BOUND * ELEM_MAX)" in source


# (format, rounding, rht, input dtype): every path of the kernel's choice of targets
COMPILED = {
    "4over6_rht16_sr8": (FOUR_OVER_SIX, "stochastic8", RHTSpec(16), "bf16"),
    "4over6_mae_sr_fp32in": (
        dataclasses.replace(FOUR_OVER_SIX, target_error="mae"),
        "stochastic",
        None,
        "fp32",
    ),
    "4over6_sr_scales": (
        dataclasses.replace(FOUR_OVER_SIX, scale=ScaleSpec(E4M3, "stochastic")),
        "nearest",
        None,
        "bf16",
    ),
    "sr_scales_sr16_fp16in": (SR_SCALES, "stochastic16", None, "fp16"),
    "mxfp4_targets_643": (
        dataclasses.replace(MXFP4, name="m", targets=(6.0, 4.0, 3.0)),
        "nearest",
        None,
        "bf16",
    ),
    "mxfp4_sr_scales_rht32": (
        dataclasses.replace(MXFP4, name="m", scale=ScaleSpec(UE8M0, "stochastic")),
        "nearest",
        RHTSpec(32, "none", None),
        "bf16",
    ),
    "b64_lanes_targets_sr8": (
        dataclasses.replace(FOUR_OVER_SIX, block=(1, 64), scale=ScaleSpec(E4M3, "stochastic")),
        "stochastic8",
        None,
        "bf16",
    ),
    "b48_targets": (dataclasses.replace(FOUR_OVER_SIX, block=(1, 48)), "nearest", None, "bf16"),
    "mxfp6_targets": (
        dataclasses.replace(BUILTIN_FORMATS["mxfp6_e2m3"], name="m", targets=(7.5, 6.0)),
        "nearest",
        None,
        "bf16",
    ),
    # one global scale per row (docs/numerics.md 11.4), with the other options
    "rows": (dataclasses.replace(NVFP4, name="r", global_rows=True), "nearest", None, "bf16"),
    "rows_4over6_b64_sr_step_signs": (
        dataclasses.replace(FOUR_OVER_SIX, block=(1, 64), global_rows=True),
        "stochastic",
        RHTSpec(16, "step", None, 1),
        "fp32",
    ),
    # the MS-EDEN correction (docs/numerics.md 11.3): within a thread, across lanes, with
    # stochastic scales (the codes with the nearest scale) and block targets
    "eden32_sr8": (
        dataclasses.replace(NVFP4, name="e", eden_group=32),
        "stochastic8",
        None,
        "bf16",
    ),
    "eden128_sr_scales_step_signs": (
        dataclasses.replace(
            NVFP4, name="e", scale=ScaleSpec(E4M3, "stochastic"), global_bound=384.0, eden_group=128
        ),
        "nearest",
        RHTSpec(16, "step", None, 1),
        "bf16",
    ),
    "eden256_b64_lanes": (
        dataclasses.replace(
            NVFP4, name="e", block=(1, 64), scale=ScaleSpec(E4M3, "stochastic"), eden_group=256
        ),
        "nearest",
        None,
        "fp32",
    ),
    "mxfp4_eden64_targets_sr_scales": (
        dataclasses.replace(
            MXFP4, name="m", scale=ScaleSpec(UE8M0, "stochastic"), targets=(6.0, 4.0), eden_group=64
        ),
        "stochastic",
        RHTSpec(32, "none", None),
        "bf16",
    ),
    # an RHT wider than a thread's values, across lanes; Quartet II's backward operands
    "rht128_seeded_sr8": (NVFP4, "stochastic8", RHTSpec(128, "seeded", None, 3), "bf16"),
    "quartet2_backward": (
        dataclasses.replace(
            NVFP4, name="q", scale=ScaleSpec(E4M3, "stochastic"), global_bound=384.0, eden_group=128
        ),
        "nearest",
        RHTSpec(128, "step", None, 1),
        "bf16",
    ),
    # RHT signs drawn per layer or step: the kernels' arguments (docs/numerics.md 12)
    "step_signs_rht16_sr8": (NVFP4, "stochastic8", RHTSpec(16, "step", None, 1), "bf16"),
    "4over6_layer_signs_rht32_nog": (
        dataclasses.replace(MXFP4, name="m", targets=(6.0, 4.0)),
        "nearest",
        RHTSpec(32, "layer", None, 5),
        "fp32",
    ),
}


@pytest.mark.parametrize("case", sorted(COMPILED))
def test_option_kernels_cross_compile(case: str, tmp_path: Path) -> None:
    """Every kernel of each variant compiles for sm_90a and sm_100a (no GPU needed); the
    Philox arguments are there exactly where the kernel draws (element SR or scale SR)."""
    fmt, rounding, rht, dtype = COMPILED[case]
    spec = kernel_spec(fmt, dtype, row(rounding, rht))  # type: ignore[arg-type]
    assert is_rowwise(spec)
    os.environ.setdefault("CUTE_DSL_NO_CACHE", "1")
    module = import_source(render(spec), tmp_path / "src")
    for kernel in module.KERNELS:
        for arch in ("sm_90a", "sm_100a"):
            keep = tmp_path / "ptx" / f"{kernel}.{arch}"
            module.compile_kernel(kernel, arch, dump_dir=str(keep))
            (ptx,) = keep.glob(f"*.{arch}.ptx")
            text = ptx.read_text()
            if kernel == "quantize":
                draws = rounding != "nearest" or fmt.scale.rounding == "stochastic"
                # Philox4x32-10's multiplier, in every call
                assert ("-766435501" in text or "3528531795" in text) == draws, case


def test_planner_gives_four_over_six_rowwise_kernels(tile_options_off: None) -> None:  # noqa: F811
    """nvfp4_4over6_rht: the 1D operands of x and dy get fused specs with the targets, which
    the tile template refuses; the build renders their single-output rowwise stand-ins (a
    columnwise copy quantized from the transpose); with the tile option kernels off the 16x16
    weight goes to the reference (on: tests/test_quantize_tile_options.py)."""
    plan = plan_recipe(load_recipe(ROOT / "fp4gen" / "recipes" / "nvfp4_4over6_rht.fp4r"))
    fused = plan.kernel_for(Operand.WGRAD_GRADIENT)
    assert fused is not None and fused.spec.targets == (6.0, 4.0)
    assert {o.direction for o in fused.spec.outputs} == {"rowwise", "columnwise"}
    assert plan.kernel_for(Operand.FPROP_WEIGHT) is None
    skipped = [s for s in plan.skipped if Operand.FPROP_WEIGHT in s.operands]
    assert "16x16 blocks" in skipped[0].reason and "reference" in skipped[0].reason
    rendered = render_plan(plan)
    unsupported = [r for r in rendered if r.unsupported]
    assert unsupported and all("rowwise kernel only" in r.unsupported for r in unsupported)
    made = {r.planned.spec.name for r in rendered if r.source is not None}
    assert made == {
        "quant_e2m1_1x16t6x4_e4m3rn_g256_bf16_row_rne",
        "quant_e2m1_1x16t6x4_e4m3rn_g256_bf16_row_rne_rht16",
        "quant_e2m1_1x16t6x4_e4m3rn_g256_bf16_row_sr8",
        "quant_e2m1_1x16t6x4_e4m3rn_g256_bf16_row_sr8_rht16",
    }


def test_planner_keeps_the_reference_for_what_no_kernel_implements(
    tile_options_off: None,  # noqa: F811
) -> None:
    """Every option is the rowwise kernel's (a tile launch is refused with the tile reason);
    with the tile option kernels off the reference keeps 2D blocks with those options.
    nvfp4_quartet2's four backward operands (MS-EDEN, stochastic scales, a 128-point RHT drawn
    per step) are one rowwise kernel."""
    quartet = plan_recipe(load_recipe(ROOT / "fp4gen" / "recipes" / "nvfp4_quartet2.fp4r"))
    planned = quartet.kernel_for(Operand.DGRAD_GRADIENT)
    assert planned is not None and planned.spec.eden_group == 128
    rendered = render_plan(quartet)
    fused = next(r for r in rendered if r.planned.spec == planned.spec)
    assert "rowwise kernel only" in (fused.unsupported or "")
    made = {r.planned.spec.name for r in rendered if r.source is not None}
    assert "quant_e2m1_1x16_e4m3rs_eden128_g384_bf16_row_rne_rht128drawn" in made
    rows = dataclasses.replace(NVFP4, name="rows", global_rows=True)
    assert "per-row global scales" in (tile_reason(rows) or "")
    eden = dataclasses.replace(
        NVFP4, name="eden", eden_group=128, scale=ScaleSpec(E4M3, "stochastic")
    )
    why = tile_reason(eden) or ""
    assert "MS-EDEN" in why and "stochastic block scales" in why
    two_d = FOUR_OVER_SIX.with_block((16, 16))
    assert "16x16 blocks" in (rowwise_only_reason(two_d) or "")
    assert rowwise_only_reason(FOUR_OVER_SIX) is None
    assert "transpose" in (tile_reason(FOUR_OVER_SIX) or "")
    bound = dataclasses.replace(NVFP4, name="b", global_bound=256.0)
    assert tile_reason(bound) is None and rowwise_only_reason(bound) is None


def test_linear_asks_for_the_rowwise_kernels_only(tile_options_off: None) -> None:  # noqa: F811
    """aot.quantize_uses (the kernels fp4gen.nn.Linear can load) gives no tile spec for a format
    with block targets and 1D blocks: each copy is the rowwise kernel's, the columnwise one on
    x^T (with the tile option kernels on, the 16x16 weights are the tile kernel's too)."""
    recipe = load_recipe(ROOT / "fp4gen" / "recipes" / "nvfp4_4over6_rht.fp4r")
    dtypes = {"activation": "bf16", "weight": "bf16", "gradient": "bf16"}
    uses = list(quantize_uses(recipe.operands, dtypes))
    assert uses and all(is_rowwise(spec) and spec.targets == (6.0, 4.0) for spec, _, _ in uses)
    slots = {op for _, op, _ in uses}
    assert Operand.WGRAD_ACTIVATION in slots and Operand.WGRAD_GRADIENT in slots
    assert Operand.FPROP_WEIGHT not in slots  # 16x16 blocks: the reference


def test_cute_backend_routes_by_copy(
    option_kernels_on: None,  # noqa: F811
    tile_options_off: None,  # noqa: F811
) -> None:
    """The runtime refuses a tile launch (a columnwise copy, two copies, 2D blocks with the
    tile option kernels off) of a format with block targets with the tile reason; the callers
    then quantize each copy on its own."""
    from fp4gen.runtime import cute_backend
    from fp4gen.runtime.loader import Unsupported

    x = torch.zeros(16, 32)
    col = cute_backend._launch(FOUR_OVER_SIX, (("columnwise", "nearest", None),), x)
    assert isinstance(col.kernels, Unsupported) and "transpose" in col.kernels.reason
    two_d = FOUR_OVER_SIX.with_block((16, 16))
    tiles = cute_backend._launch(two_d, (("rowwise", "nearest", None),), x)
    assert isinstance(tiles.kernels, Unsupported) and "16x16" in tiles.kernels.reason
    assert cute_backend.spec_for(FOUR_OVER_SIX, "nearest", None, torch.bfloat16).targets == (
        6.0,
        4.0,
    )


def test_shipped_four_over_six_sources_are_current() -> None:
    """generated/nvfp4_4over6*/ hold the rowwise Four Over Six modules of the 1D operands and
    the tile kernel's option variants of the 16x16 weights (test_generated checks their bytes;
    here: they exist and carry the targets)."""
    for name in ("nvfp4_4over6", "nvfp4_4over6_rht"):
        sources = sorted((ROOT / "generated" / name).glob("quant_*.py"))
        assert sources
        tiles = [p for p in sources if "_16x16t6x4_" in p.name]
        assert len(tiles) == 2  # the weight's rowwise copy, and its pair with the transpose
        for path in sources:
            text = path.read_text()
            if path in tiles:
                assert "target_invs=(0.1666666716337204, 0.25)" in text
            else:
                assert "BLOCK_TARGET_INVS" in text


def test_drawn_signs_are_one_kernel_per_size() -> None:
    """Every layer, step and seed of a transform drawn per layer or step shares one kernel
    spec: the signs are arguments."""
    specs = {
        kernel_spec(NVFP4, "bf16", row("nearest", RHTSpec(16, source, None, seed).at(layer, 3)))
        for source in ("layer", "step")
        for seed in (0, 9)
        for layer in (1, 2)
    }
    assert len(specs) == 1
    (spec,) = specs
    assert spec.name == "quant_e2m1_1x16_e4m3rn_g_bf16_row_rne_rht16drawn"
    fixed = kernel_spec(NVFP4, "bf16", row("nearest", RHTSpec(16)))
    assert fixed.name == "quant_e2m1_1x16_e4m3rn_g_bf16_row_rne_rht16" and fixed != spec


def test_sign_words_are_the_reference_draw() -> None:
    """The host's sign words (bit i % 32 of word i // 32 for a -1 at position i, as Int32)
    are the reference's signs of the transform at its layer and step."""
    from fp4gen.kernels.quantize_host import rht_sign_words
    from fp4gen.numerics.hadamard import rht_signs

    for size in (8, 16, 32, 64, 256):
        for layer, step in ((0, 0), (5, 7), ((1 << 24) - 1, (1 << 40) - 1)):
            at = RHTSpec(size, "step", None, 3).at(layer, step)
            words = rht_sign_words(at)
            assert len(words) == 8 and all(-(1 << 31) <= w < 1 << 31 for w in words)
            bits = [((words[i // 32] & 0xFFFFFFFF) >> (i % 32)) & 1 for i in range(256)]
            want = (rht_signs(at) < 0).int().tolist()
            assert bits[:size] == want and not any(bits[size:])


def test_sign_masks_are_the_reference_draw() -> None:
    """The host's pair masks (bit 15 of mask k for a -1 at position 2k, bit 31 for 2k + 1, as
    Int32) are the reference's signs; an RHT with more pairs than the arguments is refused."""
    from fp4gen.kernels.quantize_host import rht_sign_masks
    from fp4gen.numerics.hadamard import rht_signs

    for size in (8, 16):
        for layer, step in ((0, 0), (5, 7), ((1 << 24) - 1, (1 << 40) - 1)):
            at = RHTSpec(size, "step", None, 3).at(layer, step)
            masks = [m & 0xFFFFFFFF for m in rht_sign_masks(at)]
            assert len(masks) == 8 and all(m & ~0x80008000 == 0 for m in masks)
            bits = [(masks[i // 2] >> (15 + 16 * (i % 2))) & 1 for i in range(16)]
            want = (rht_signs(at) < 0).int().tolist()
            assert bits[:size] == want and not any(bits[size:])
    with pytest.raises(ValueError, match="pair masks"):
        rht_sign_masks(RHTSpec(32, "step", None, 3).at(1, 1))


@pytest.mark.parametrize(
    "dtype, size, masks",
    [("bf16", 16, True), ("fp16", 16, True), ("fp32", 16, False), ("bf16", 32, False)],
)
def test_which_kernels_take_sign_masks(dtype: str, size: int, masks: bool, tmp_path: Path) -> None:
    """16-bit inputs with an RHT of at most 16 points take pair masks (one xor per two values
    before they are widened); fp32 inputs and larger RHTs take the sign words."""
    from fp4gen.kernels.quantize_host import rht_sign_masks, rht_sign_words

    rht = RHTSpec(size, "step", None, 1)
    module = import_source(render(kernel_spec(NVFP4, dtype, row("nearest", rht))), tmp_path)
    assert module.PARAMS.sign_masks is masks
    at = rht.at(2, 9)
    assert module.HOST.sign_args(at) == list((rht_sign_masks if masks else rht_sign_words)(at))


def test_the_host_asks_for_the_signs(tmp_path: Path) -> None:
    """A module with runtime signs needs the transform at its layer and step; one with
    compiled-in signs refuses them (no GPU: the checks run before any launch)."""
    drawn = kernel_spec(NVFP4, "bf16", row("nearest", RHTSpec(16, "step", None, 1)))
    host = import_source(render(drawn), tmp_path / "a").HOST
    with pytest.raises(ValueError, match="per layer or step"):
        host.sign_args(None)
    with pytest.raises(ValueError, match="per layer or step"):
        host.sign_args(RHTSpec(32, "step", None, 1).at(1, 1))  # another size
    assert len(host.sign_args(RHTSpec(16, "step", None, 1).at(1, 1))) == 8
    fixed = import_source(render(kernel_spec(NVFP4, "bf16", row())), tmp_path / "b").HOST
    assert fixed.sign_args(None) == []
    with pytest.raises(ValueError, match="compiled in"):
        fixed.sign_args(RHTSpec(16, "step", None, 1).at(1, 1))


def test_per_row_scales_plan_the_rowwise_kernel() -> None:
    """nvfp4_rowscaled: fprop.activation (one global scale per token) gets the rowwise kernel
    with [M] amax and S_dec; its module leaves the finite check to the runtime (a row's S_dec
    alone would turn NaN)."""
    plan = plan_recipe(load_recipe(ROOT / "fp4gen" / "recipes" / "nvfp4_rowscaled.fp4r"))
    kernel = plan.kernel_for(Operand.FPROP_ACTIVATION)
    assert kernel is not None and kernel.spec.global_rows and is_rowwise(kernel.spec)
    assert kernel.spec.name == "quant_e2m1_1x16_e4m3rn_grow_bf16_row_rne"
    source = render(kernel.spec)
    assert "GLOBAL_ROWS = True" in source and "NONFINITE_TO_NAN_SCALE = False" in source
    assert "global_rows=True" in repr(kernel.spec)


def test_the_error_tree_is_not_contracted(tmp_path: Path) -> None:
    """The block error's products (and the MS-EDEN sums') are rounded on their own, as the
    reference rounds them: the PTX spells them mul.rn / add.rn / sub.rn, which neither NVVM nor
    ptxas fuses into an fma (a plain product feeding an add was: fma(d0, d0, d1 * d1)). The
    4over6 RNE kernel (16 values per thread, two targets) has no plain fp32 add or subtract
    left, and 2 x 15 tree adds."""
    os.environ.setdefault("CUTE_DSL_NO_CACHE", "1")
    spec = kernel_spec(FOUR_OVER_SIX, "bf16", row())
    module = import_source(render(spec), tmp_path / "src")
    module.compile_kernel("quantize", "sm_90a", dump_dir=str(tmp_path / "ptx"))
    (ptx,) = (tmp_path / "ptx").glob("*.sm_90a.ptx")
    ops = [line.split()[0] for line in ptx.read_text().splitlines() if line.strip()]
    assert "add.f32" not in ops and "sub.f32" not in ops
    assert ops.count("add.rn.f32") == 30 and ops.count("sub.rn.f32") == 32
    assert ops.count("mul.rn.f32") == 64  # v * s_b and d * d, 16 values x 2 targets


def _method(tree: ast.Module, cls: str, name: str) -> ast.FunctionDef:
    (node,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls]
    (method,) = [f for f in node.body if isinstance(f, ast.FunctionDef) and f.name == name]
    return method


def _forwarded(method: ast.FunctionDef, target: str) -> tuple[list[str], list[str]]:
    """The positional arguments (names, "None" for None) and keywords of ``self.target(...)``."""
    (call,) = [
        n
        for n in ast.walk(method)
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == target
    ]
    return [ast.unparse(a) for a in call.args], [k.arg or "" for k in call.keywords]


@pytest.mark.parametrize("swizzled", [False, True])
@pytest.mark.parametrize("case", sorted(COMPILED))
def test_rowwise_entries_spell_the_specs_arguments(case: str, swizzled: bool) -> None:
    """The quantize kernel's two entries, written from the codegen's data (RowwiseEntry) by one
    template macro: ``__call__`` names exactly the spec's arguments (tvm_ffi's keyword wrapper
    is built from these names), hands ``launch`` its 8 positional arguments (None for what the
    spec lacks), and ``kernel`` takes exactly what ``launch`` passes and hands ``body`` its 10."""
    fmt, rounding, rht, dtype = COMPILED[case]
    spec = kernel_spec(fmt, dtype, row(rounding, rht))  # type: ignore[arg-type]
    layout = "swizzled" if swizzled else "compact"
    spec = dataclasses.replace(
        spec, outputs=(dataclasses.replace(spec.outputs[0], scale_layout=layout),)
    )
    tree = ast.parse(render(spec))
    philox = rounding != "nearest" or fmt.scale.rounding == "stochastic"
    signs = rht is not None and rht.redrawn
    seeds = ["seed_lo", "seed_hi", "offset_lo", "offset_hi", "ctr_lo", "ctr_hi"]
    scalars = [*seeds, "stride_lo", "stride_hi"] * philox + [f"s{i}" for i in range(8)] * signs
    amax = ["mAmax"] if spec.global_scale else []
    call = _method(tree, "QuantizeKernel", "__call__")
    assert [a.arg for a in call.args.args] == [
        "self", "mX", "mQ", "mS", *["mSwz"] * swizzled, *amax, "mSdec", *scalars, "stream"
    ]  # fmt: skip
    args, keywords = _forwarded(call, "launch")
    amax_arg = amax[0] if amax else "None"
    philox_arg = "philox" if philox else "None"
    swz_arg = "mSwz" if swizzled else "None"
    assert args == ["mX", "mQ", "mS", swz_arg, amax_arg, "mSdec", philox_arg, "stream"]
    assert keywords == ["signs"] * signs
    kernel = _method(tree, "QuantizeKernel", "kernel")
    swizzle = ["gSwz", "nbk", "c4"] if swizzled else []
    assert [a.arg for a in kernel.args.args] == [
        "self", "gX", "gQ", "gS", *swizzle, *amax, "mSdec", *scalars, "num_units"
    ]  # fmt: skip
    args, keywords = _forwarded(kernel, "body")
    swizzle = swizzle or ["None"] * 3
    tail = [amax_arg, "mSdec", philox_arg, "num_units"]
    assert args == ["gX", "gQ", "gS", *swizzle, *tail]
    assert keywords == ["signs"] * signs
    # the codegen's data is what the template wrote
    ctx = context(spec)
    assert [p[0] for p in ctx.entry.call_params] == [a.arg for a in call.args.args[1:]]
    assert [p[0] for p in ctx.entry.kernel_params] == [a.arg for a in kernel.args.args[1:]]
    # the thread mapping's words in the docstring, from the codegen (Mapping)
    docstring = " ".join((ast.get_docstring(tree) or "").split())
    assert f"units of {ctx.map.unit} contiguous elements" in docstring


HALF_CASES = {
    # the "srhalf" encode (8 random bits) with e4m3 scales, nearest or stochastic: fp16 images
    "4over6_sr8": (FOUR_OVER_SIX, "stochastic8", True),
    "4over6_sr_scales_sr8": (
        dataclasses.replace(FOUR_OVER_SIX, scale=ScaleSpec(E4M3, "stochastic")),
        "stochastic8",
        True,
    ),
    # RNE and 32-bit SR take other encodes; ue8m0 scales do not fit fp16
    "4over6_rne": (FOUR_OVER_SIX, "nearest", False),
    "4over6_sr32": (FOUR_OVER_SIX, "stochastic", False),
    "mxfp4_4over6_sr8": (
        dataclasses.replace(MXFP4, name="m", targets=(6.0, 4.0)),
        "stochastic8",
        False,
    ),
    # no targets: no error to compute
    "nvfp4_sr8": (NVFP4, "stochastic8", False),
}


@pytest.mark.parametrize("case", sorted(HALF_CASES))
def test_which_kernels_take_the_errors_from_the_fp16_images(case: str, tmp_path: Path) -> None:
    fmt, rounding, expected = HALF_CASES[case]
    spec = kernel_spec(fmt, "bf16", row(rounding))  # type: ignore[arg-type]
    module = import_source(render(spec), tmp_path / "src")
    assert module.PARAMS.half_products is expected


def _values(exp_bits: int, man_bits: int, bias: int, top: float) -> list[float]:
    """Every non-negative finite value of a minifloat up to ``top``."""
    out = {0.0}
    for e in range(1 << exp_bits):
        for m in range(1 << man_bits):
            v = (
                (m / (1 << man_bits)) * 2.0 ** (1 - bias)
                if e == 0
                else (1 + m / (1 << man_bits)) * 2.0 ** (e - bias)
            )
            if v <= top:
                out.add(v)
    return sorted(out)


def test_the_fp16_image_products_are_exact() -> None:
    """What ``half_products`` rests on, by enumeration: for every e2m1 magnitude and every e4m3
    scale, s_b and |value| * s_b * 2^-14 (the image's product) are fp16 values, so the fp16x2
    multiply and its fp32 convert are exact and fp32(product * 2^14) = fp32(|value| * s_b); and
    a scale format outside the rule (e5m2: products below 2^-24) fails the enumeration."""
    elems = torch.tensor(_values(2, 1, 1, 6.0), dtype=torch.float64)
    for (exp_bits, man_bits, bias, top), exact in (
        ((4, 3, 7, 448.0), True),
        ((5, 2, 15, 57344.0), False),
    ):
        scales = torch.tensor(_values(exp_bits, man_bits, bias, top), dtype=torch.float64)
        products = elems[:, None] * scales[None, :] * 2.0**-14
        fits = torch.equal(products.to(torch.float16).to(torch.float64), products)
        fits &= torch.equal(scales.to(torch.float16).to(torch.float64), scales)
        assert fits is exact, (exp_bits, man_bits)


def test_the_fp16_image_errors_replace_the_decode(tmp_path: Path) -> None:
    """The 4over6 SR8 kernel (16 values per thread, two targets) computes each error term as
    one fp16x2 product per two values and one fma.rn per value (d) and a mul.rn (d * d):
    2 x 8 mul.rn.f16x2, 32 fma.rn.f32 besides scale_value's (+0.0 added), 32 mul.rn.f32, no
    sub.rn.f32, and the same 2 x 15 tree adds."""
    os.environ.setdefault("CUTE_DSL_NO_CACHE", "1")
    spec = kernel_spec(FOUR_OVER_SIX, "bf16", row("stochastic8"))
    module = import_source(render(spec), tmp_path / "src")
    module.compile_kernel("quantize", "sm_90a", dump_dir=str(tmp_path / "ptx"))
    (ptx,) = (tmp_path / "ptx").glob("*.sm_90a.ptx")
    lines = [line.split() for line in ptx.read_text().splitlines() if line.strip()]
    ops = [words[0] for words in lines]
    fmas = [words for words in lines if words[0] == "fma.rn.f32"]
    assert ops.count("mul.rn.f16x2") == 16
    assert sum("0f00000000;" not in words for words in fmas) == 32
    assert ops.count("mul.rn.f32") == 32 and "sub.rn.f32" not in ops
    assert ops.count("add.rn.f32") == 30
