"""Quantize codegen: render every kernel the shipped recipes plan (rowwise + columnwise copies in
one launch, a columnwise copy alone, 2D tiles), the rowwise stand-ins and hand-made specs, check
the source, and cross-compile it for sm_90a and sm_100a on the CPU (PTX read back)."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

import fp4gen
from fp4gen.codegen import import_source
from fp4gen.codegen.quantize import (
    ARCHS,
    choose_mapping,
    choose_tile_mapping,
    is_rowwise,
    render,
)
from fp4gen.compiler.plan import plan_recipe
from fp4gen.compiler.spec import QuantKernelSpec, QuantOutput
from fp4gen.dsl.model import RHTSpec
from fp4gen.dsl.parser import load_recipe
from fp4gen.errors import TensorError
from fp4gen.formats import (
    E2M1,
    E2M3,
    E3M2,
    E4M3,
    E5M2,
    UE8M0,
    BlockFormat,
    ElementFormat,
    ScaleSpec,
)
from fp4gen.numerics.minifloat import max_finite

RECIPES = Path(fp4gen.__file__).parent / "recipes"


def rowwise_specs_of_recipes() -> dict[QuantKernelSpec, list[str]]:
    """Every distinct rowwise kernel the shipped recipes need, with the operands using it.

    A stand-in for the planner: each quantized operand with 1D blocks becomes a rowwise bf16
    kernel (a columnwise copy is the rowwise quantization of the transpose, so its rounding and
    RHT count too); 2D-block operands are left to a later step.
    """
    specs: dict[QuantKernelSpec, list[str]] = {}
    for path in sorted(RECIPES.glob("*.fp4r")):
        recipe = load_recipe(path)
        for operand, op in recipe.operands.items():
            fmt = op.format
            if not isinstance(fmt, BlockFormat) or fmt.is_2d or not fmt.is_plain:
                continue  # 2D: the tile kernels; not plain: the reference (no kernel yet)
            out = QuantOutput("rowwise", op.rounding, op.rht)
            spec = QuantKernelSpec(
                fmt.element, fmt.block, fmt.scale, fmt.global_scale, "bf16", (out,)
            )
            specs.setdefault(spec, []).append(f"{recipe.name}:{operand.selector}")
    return specs


def spec(
    element: ElementFormat,
    block: int,
    scale: ScaleSpec,
    global_scale: bool,
    dtype: str = "bf16",
    rounding: str = "nearest",
    rht: RHTSpec | None = None,
    layout: str = "compact",
) -> QuantKernelSpec:
    out = QuantOutput("rowwise", rounding, rht, layout)  # type: ignore[arg-type]
    block_shape = (1, block)
    return QuantKernelSpec(element, block_shape, scale, global_scale, dtype, (out,))  # type: ignore[arg-type]


E3M3FN = ElementFormat(3, 3, special="fn")
UE5M0 = ElementFormat(5, 0, signed=False)
E3M0 = ElementFormat(3, 0)

SR = "stochastic"
HAND_SPECS = {
    "e3m3fn_ue5m0_fp32in": spec(E3M3FN, 16, ScaleSpec(UE5M0, "up"), False, "fp32"),
    "e3m3fn_ue8m0rn_sr_fp16in": spec(E3M3FN, 16, ScaleSpec(UE8M0), True, "fp16", SR),
    "e4m3_b8_fp32scales": spec(E4M3, 8, ScaleSpec(None), False, "fp32"),
    "e5m2_b128_fp32scales_global_sr": spec(E5M2, 128, ScaleSpec(None), True, "bf16", SR),
    "nvfp4_swizzled": spec(E2M1, 16, ScaleSpec(E4M3), True, layout="swizzled"),
    "mxfp4_ocp_swizzled": spec(E2M1, 32, ScaleSpec(UE8M0, "ocp"), False, layout="swizzled"),
    "mxfp6_e2m3": spec(E2M3, 32, ScaleSpec(UE8M0, "up"), False),
    "e2m0_b24_e4m3up": spec(ElementFormat(2, 0), 24, ScaleSpec(E4M3, "up"), False),
    "e3m0_rz_e3m0_scales": spec(E3M0, 16, ScaleSpec(E3M0), True, rounding="zero"),
    "nvfp4_b128_rht32_seeded_sr": spec(
        E2M1, 128, ScaleSpec(E4M3, "down"), True, "bf16", SR, RHTSpec(32, "seeded", None, 5)
    ),
}

RECIPE_SPECS = rowwise_specs_of_recipes()
ALL_SPECS = {s.name: s for s in RECIPE_SPECS} | HAND_SPECS


def planned_specs() -> dict[str, QuantKernelSpec]:
    """Every kernel the planner gives the shipped recipes (deduplicated across recipes)."""
    specs: dict[str, QuantKernelSpec] = {}
    for path in sorted(RECIPES.glob("*.fp4r")):
        for kernel in plan_recipe(load_recipe(path)).kernels:
            if isinstance(kernel.spec, QuantKernelSpec):  # MoR kernels: test_codegen_mor.py
                specs.setdefault(kernel.spec.name, kernel.spec)
    return specs


def tile(element, block, scale, global_scale, outs, dtype="bf16") -> QuantKernelSpec:
    outputs = tuple(
        QuantOutput(d, r, h, layout)  # type: ignore[arg-type]
        for d, r, h, layout in outs
    )
    return QuantKernelSpec(element, block, scale, global_scale, dtype, outputs)  # type: ignore[arg-type]


NV = ScaleSpec(E4M3)
MX = ScaleSpec(UE8M0, "up")
TE16 = RHTSpec(16)
SEEDED32 = RHTSpec(32, "seeded", None, 0)
ROW_SR, COL_SR_RHT = ("rowwise", SR, None, "compact"), ("columnwise", SR, TE16, "compact")
PLANNED_SPECS = planned_specs()
# beyond the shipped recipes: other input dtypes, swizzled scales, partial code words, SR with 2D
# tiles, fp32 scales with a global scale across warps, 6-bit codes, every scale rounding path
TILE_HAND_SPECS = {
    "nvfp4_gradient_fp32in": tile(E2M1, (1, 16), NV, True, [ROW_SR, COL_SR_RHT], "fp32"),
    "nvfp4_fused_swizzled_fp16in": tile(
        E2M1,
        (1, 16),
        NV,
        True,
        [("rowwise", "nearest", None, "swizzled"), ("columnwise", "nearest", TE16, "swizzled")],
        "fp16",
    ),
    "nvfp4_2d_sr_swizzled": tile(
        E2M1,
        (16, 16),
        NV,
        True,
        [("rowwise", SR, None, "swizzled"), ("columnwise", SR, None, "swizzled")],
    ),
    "nvfp4_2d_rowwise_only_fp32in": tile(
        E2M1, (16, 16), NV, True, [("rowwise", "nearest", None, "compact")], "fp32"
    ),
    "mxfp8_2d_32_fp32in": tile(
        E4M3,
        (32, 32),
        MX,
        False,
        [("rowwise", "nearest", None, "compact"), ("columnwise", "nearest", None, "compact")],
        "fp32",
    ),
    "e3m2_2d_16_e4m3up": tile(
        E3M2,
        (16, 16),
        ScaleSpec(E4M3, "up"),
        True,
        [("rowwise", "nearest", None, "compact"), ("columnwise", "nearest", None, "compact")],
    ),
    "mxfp4_colwise_rht32_sr_ocp": tile(
        E2M1, (1, 32), ScaleSpec(UE8M0, "ocp"), False, [("columnwise", SR, SEEDED32, "swizzled")]
    ),
    "e5m2_1x128_fp32scales_global_sr": tile(
        E5M2,
        (1, 128),
        ScaleSpec(None),
        True,
        [("rowwise", SR, None, "compact"), ("columnwise", "zero", None, "compact")],
    ),
    "e2m3_1x32_e5m2scales_rne_sr": tile(
        E2M3,
        (1, 32),
        ScaleSpec(E5M2),
        False,
        [("rowwise", "nearest", None, "compact"), ("columnwise", SR, None, "compact")],
        "fp16",
    ),
}
# the planned specs the tile template renders (a recipe may plan a lone rowwise copy too; block
# targets and stochastic block scales are the rowwise kernel's: the build takes the stand-ins)
PLANNED_TILE = {
    n: s
    for n, s in PLANNED_SPECS.items()
    if not is_rowwise(s) and not s.targets and s.scale.rounding != "stochastic"
}
TILE_SPECS = PLANNED_TILE | TILE_HAND_SPECS


def test_recipes_give_the_expected_rowwise_specs() -> None:
    names = {s.name for s in RECIPE_SPECS}
    assert {
        "quant_e2m1_1x16_e4m3rn_g_bf16_row_rne",
        "quant_e2m1_1x16_e4m3rn_g_bf16_row_sr8",
        "quant_e2m1_1x16_e4m3rn_g_bf16_row_sr8_rht16",
        "quant_e2m1_1x32_ue8m0ru_nog_bf16_row_sr_rht32",
        "quant_e4m3_1x32_ue8m0ru_nog_bf16_row_rne",
        "quant_e3m2_1x8_e4m3rn_g_bf16_row_sr",
        "quant_e4m3_1x128_fp32_nog_bf16_row_rne",
    } <= names


# ----------------------------------------------------------------------------------------------
# Source checks
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(ALL_SPECS))
def test_render_is_valid_deterministic_python(name: str) -> None:
    s = ALL_SPECS[name]
    src = render(s)
    compile(src, f"<{s.name}>", "exec")
    assert render(s) == src
    # the formats are baked in as named constants
    assert f'SPEC_NAME = "{s.name}"' in src
    assert f'ELEM_NAME = "{s.element.name}"' in src
    assert f"ELEM_BITS = {s.element.bits}\n" in src
    assert f"ELEM_MAX = {max_finite(s.element)!r}" in src
    assert f"BLOCK = {s.block[1]}" in src
    assert f'SCALE_NAME = "{s.scale.name}"' in src
    assert f"GLOBAL_SCALE = {s.global_scale}" in src
    kernels = '("amax", "quantize")' if s.global_scale else '("quantize",)'
    assert f"KERNELS: tuple[str, ...] = {kernels}" in src
    assert ("SR_BITS = " in src) == s.outputs[0].rounding.startswith("stochastic")
    # the device code is the kernel class's: the module binds its constants
    assert "class QuantizeKernel(quantize.RowwiseQuantizeKernel):" in src
    assert "PARAMS = quantize.RowwiseParams(" in src and "def quantize_unit" not in src
    assert ("RHT_SIZE =" in src) == (s.outputs[0].rht is not None)
    assert s.name in src.split('"""')[1]  # the docstring names the kernel


@pytest.mark.skipif(shutil.which("ruff") is None, reason="ruff is not installed")
def test_generated_sources_are_ruff_clean(tmp_path: Path) -> None:
    for s in [*ALL_SPECS.values(), *TILE_SPECS.values()]:
        (tmp_path / f"{s.name}.py").write_text(render(s))
    for args in (["check", "--select", "E,F,W,I,UP,B,SIM"], ["format", "--check"]):
        proc = subprocess.run(
            ["ruff", *args, "--line-length", "100", "--no-cache", str(tmp_path)],
            capture_output=True,
            text=True,
            check=False,
        )
        assert proc.returncode == 0, proc.stdout + proc.stderr


def test_unsupported_specs_are_rejected_clearly() -> None:
    rowwise = QuantOutput("rowwise", "nearest", None)
    columnwise = QuantOutput("columnwise", "nearest", None)
    nv = (E2M1, (1, 16), ScaleSpec(E4M3, "nearest"), True, "bf16")
    with pytest.raises(NotImplementedError, match="rowwise RHT"):
        render(QuantKernelSpec(*nv, (QuantOutput("rowwise", "nearest", TE16), columnwise)))
    with pytest.raises(NotImplementedError, match="RHT of size 64"):
        col64 = QuantOutput("columnwise", "nearest", RHTSpec(64, "none", None))
        render(QuantKernelSpec(*nv, (col64,)))
    nv2d = (E2M1, (16, 16), ScaleSpec(E4M3), True, "bf16")
    with pytest.raises(NotImplementedError, match="round alike"):
        render(QuantKernelSpec(*nv2d, (rowwise, QuantOutput("columnwise", SR, None))))
    with pytest.raises(NotImplementedError, match="RHT with 2D"):
        render(QuantKernelSpec(*nv2d, (QuantOutput("columnwise", "nearest", TE16),)))
    with pytest.raises(NotImplementedError, match="square"):
        render(QuantKernelSpec(E2M1, (16, 32), ScaleSpec(E4M3), True, "bf16", (rowwise,)))
    with pytest.raises(NotImplementedError, match="power of two"):
        render(QuantKernelSpec(E2M1, (1, 24), ScaleSpec(E4M3), True, "bf16", (columnwise,)))
    swizzled_col = QuantOutput("columnwise", "nearest", None, "swizzled")
    with pytest.raises(ValueError, match="swizzled"):
        render(QuantKernelSpec(E4M3, (1, 32), ScaleSpec(None), False, "bf16", (swizzled_col,)))
    with pytest.raises(NotImplementedError, match="multiple of 8"):
        render(QuantKernelSpec(E2M1, (1, 12), ScaleSpec(E4M3), True, "bf16", (rowwise,)))
    with pytest.raises(ValueError, match="swizzled"):
        render(spec(E4M3, 32, ScaleSpec(None), False, layout="swizzled"))
    with pytest.raises(NotImplementedError, match="RHT"):  # lanes share blocks of 64
        render(spec(E2M1, 64, ScaleSpec(E4M3), True, rht=RHTSpec(128, "none", None)))


def test_thread_mapping() -> None:
    # an RHT wider than a thread's 64 values: units of 32 values, a chunk over d / 32 lanes
    m = choose_mapping(16, 128, 2)
    assert (m.unit, m.blocks_per_unit, m.k_multiple, m.rht_lanes) == (32, 2, 128, 4)
    assert choose_mapping(32, 256, 4).rht_lanes == 8
    assert choose_mapping(16, 32, 2).rht_lanes == 1
    m = choose_mapping(16, None, 2)
    assert (m.unit, m.blocks_per_unit, m.threads_per_block, m.k_multiple) == (16, 1, 1, 16)
    m = choose_mapping(16, 32, 2)  # an RHT chunk spans two blocks: a thread owns both
    assert (m.unit, m.blocks_per_unit, m.threads_per_block, m.k_multiple) == (32, 2, 1, 32)
    m = choose_mapping(8, None, 2)
    assert (m.unit, m.quant_units) == (8, 2)  # at least 32 input bytes per thread
    m = choose_mapping(128, None, 2)  # four lanes cooperate on one block
    assert (m.unit, m.blocks_per_unit, m.threads_per_block, m.k_multiple) == (32, 1, 4, 128)
    m = choose_mapping(128, 32, 4)
    assert (m.unit, m.threads_per_block) == (32, 4)
    m = choose_mapping(48, None, 2)  # no power-of-two split: one thread holds the block
    assert (m.unit, m.threads_per_block) == (48, 1)


def test_tile_mapping() -> None:
    # NVFP4 gradient: 16 rows x 8 columns per thread, a row block over two lanes, the column
    # RHT chunk and block inside the strip
    m = choose_tile_mapping((1, 16), 2, rowwise=True, columnwise=True, col_rht=16)
    assert (m.rows, m.vec, m.row_lanes, m.col_lanes, m.col_warps) == (16, 8, 2, 1, 1)
    assert (m.k_multiple, m.m_multiple, m.tile_m, m.tile_k, m.threads) == (16, 16, 128, 128, 128)
    m = choose_tile_mapping((1, 32), 2, rowwise=True, columnwise=True, col_rht=32)
    assert (m.rows, m.vec, m.row_lanes, m.m_multiple) == (32, 4, 8, 32)  # 128 values a thread
    m = choose_tile_mapping((1, 8), 2, rowwise=True, columnwise=True)
    assert (m.rows, m.col_blocks, m.row_lanes, m.m_multiple) == (16, 2, 1, 8)
    # MX's 1x32 without a column RHT, from 16-bit inputs: 16 x 8 strips (whole 16-byte loads), a
    # column block over 2 lanes; from fp32 32 x 4 (already 16-byte loads)
    m = choose_tile_mapping((1, 32), 2, rowwise=True, columnwise=True)
    assert (m.rows, m.vec, m.row_lanes, m.col_lanes, m.col_warps) == (16, 8, 4, 2, 1)
    m = choose_tile_mapping((1, 32), 2, rowwise=False, columnwise=True)
    assert (m.rows, m.vec, m.col_lanes, m.col_warps) == (16, 8, 2, 1)
    m = choose_tile_mapping((1, 32), 4, rowwise=True, columnwise=True)
    assert (m.rows, m.vec, m.col_lanes) == (32, 4, 1)
    # FP8's 1x128 from bf16: whole 16-byte loads (16 rows x 8 columns), a column block over 2
    # lanes x 4 warps along M; from fp32 the strip stays 32 x 4 (4 values are 16 bytes)
    m = choose_tile_mapping((1, 128), 2, rowwise=True, columnwise=True)
    assert (m.rows, m.vec, m.lanes_k, m.row_lanes, m.col_lanes, m.col_warps) == (
        16,
        8,
        16,
        16,
        2,
        4,
    )
    assert (m.tile_m, m.tile_k, m.threads, m.m_multiple) == (128, 128, 128, 8)
    m = choose_tile_mapping((1, 128), 2, rowwise=False, columnwise=True)
    assert (m.rows, m.vec, m.col_lanes, m.col_warps) == (16, 8, 4, 2)
    m = choose_tile_mapping((1, 128), 4, rowwise=True, columnwise=True)
    assert (m.rows, m.lanes_k, m.row_lanes, m.col_lanes, m.col_warps) == (32, 32, 32, 1, 4)
    m = choose_tile_mapping((16, 16), 2, rowwise=True, columnwise=True)
    assert (m.rows, m.vec, m.row_lanes, m.col_lanes, m.m_multiple) == (16, 8, 2, 1, 8)
    m = choose_tile_mapping((16, 16), 2, rowwise=True, columnwise=False)
    assert m.m_multiple == 1  # no columnwise copy: any M
    m = choose_tile_mapping((128, 128), 4, rowwise=True, columnwise=True)
    assert (m.rows, m.vec, m.row_lanes, m.col_warps, m.warps_m) == (32, 4, 32, 4, 4)
    with pytest.raises(NotImplementedError, match="RHT of size 64"):
        choose_tile_mapping((1, 16), 2, rowwise=False, columnwise=True, col_rht=64)


def test_every_planned_kernel_is_generated() -> None:
    """No shipped recipe needs a stand-in any more: every planned spec renders, but for the
    fused 1D specs of formats with block targets or stochastic block scales (the rowwise
    kernel's alone: the build renders their single-output stand-ins,
    test_quantize_options_kernels); their 2D tiles (nvfp4_4over6's 16x16 weights) render as the
    tile kernel's option variants (test_quantize_tile_options)."""
    names = set(PLANNED_SPECS)
    assert {
        "quant_e2m1_1x16_e4m3rn_g_bf16_row_sr8_col_sr8_rht16",  # dy
        "quant_e2m1_1x16_e4m3rn_g_bf16_row_rne_col_rne_rht16",  # x
        "quant_e2m1_16x16_e4m3rn_g_bf16_row_rne_col_rne",  # W
        "quant_e2m1_16x16_e4m3rn_g_bf16_col_rne",
        "quant_e2m1_1x16_e4m3rn_g_bf16_col_rne_rht16",
        "quant_e4m3_128x128_fp32_nog_bf16_row_rne_col_rne",
        "quant_e2m1_1x32_ue8m0ru_nog_bf16_row_sr_col_sr_rht32",
    } <= names
    for s in PLANNED_SPECS.values():
        if s.name not in PLANNED_TILE and not is_rowwise(s) and s.block[0] == 1:
            with pytest.raises(NotImplementedError, match="rowwise kernel only"):
                render(s)
            continue
        src = render(s)
        assert f'SPEC_NAME = "{s.name}"' in src
        # a copy of a recipe whose other copy the reference quantizes may be a rowwise one
        assert ("OUTPUTS: tuple[str, ...] = " in src) != is_rowwise(s)


@pytest.mark.parametrize("name", sorted(TILE_SPECS))
def test_tile_render_is_valid_deterministic_python(name: str) -> None:
    s = TILE_SPECS[name]
    src = render(s)
    compile(src, f"<{s.name}>", "exec")
    assert render(s) == src
    assert f'ELEM_NAME = "{s.element.name}"' in src
    assert f"BLOCK = {s.block[1]}" in src
    assert f"BLOCK_2D = {s.block[0] != 1}" in src
    kernels = '("amax", "quantize")' if s.global_scale else '("quantize",)'
    assert f"KERNELS: tuple[str, ...] = {kernels}" in src
    sr = any(o.rounding.startswith("stochastic") for o in s.outputs)
    assert ("seed_lo: Int32" in src) == sr  # the kernel takes the Philox seed
    # the kernel body is fp4gen.kernels.quantize_tile's: the module spells params and the entry
    assert "class QuantizeKernel(quantize_tile.TileQuantizeKernel):" in src
    assert "def body" not in src and "philox.philox_keys(" not in src
    rht = any(o.rht is not None for o in s.outputs)
    assert ("RHT_SIZE =" in src) == rht
    for out in s.outputs:
        tag = "row" if out.direction == "rowwise" else "col"
        assert f'tag="{tag}",\n            rounding="{out.rounding}",' in src


# ----------------------------------------------------------------------------------------------
# Cross-compilation (CPU only) and PTX
# ----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def modules(tmp_path_factory: pytest.TempPathFactory):
    directory = tmp_path_factory.mktemp("generated")
    cache: dict[str, object] = {}

    def get(name: str):
        if name not in cache:
            cache[name] = import_source(render((ALL_SPECS | TILE_SPECS)[name]), directory)
        return cache[name]

    return get


def _ptx(fn) -> str:
    ptx = fn.__ptx__
    assert isinstance(ptx, str) and ".entry" in ptx, "PTX not kept"
    return "\n".join(line for line in ptx.splitlines() if not line.lstrip().startswith("//"))


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("name", sorted(ALL_SPECS))
def test_cross_compile(name: str, arch: str, modules, tmp_path: Path) -> None:
    mod = modules(name)
    s = ALL_SPECS[name]
    for kernel in mod.KERNELS:
        fn = mod.compile_kernel(kernel, arch, dump_dir=str(tmp_path / kernel))
        ptx = _ptx(fn)
        assert list((tmp_path / kernel).glob(f"*.{arch}.ptx")), "PTX not written to dump_dir"
        assert f".target {arch}" in ptx
        assert not re.search(r"\.local\b", ptx), f"{kernel} uses local memory (spills)"
        assert not re.search(r"\.approx|\.ftz", ptx), "approximate or flush-to-zero math"
        if kernel == "quantize":
            # the element scaling: fma.rn with +0.0 (the sign bit of the result is x < 0)
            assert re.search(r"fma\.rn\.f32 [^;]*, 0f00000000;", ptx)
            hw_e2m1 = "cvt.rn.satfinite.e2m1x2.f32" in ptx
            wants = arch == "sm_100a" and s.element == E2M1 and s.outputs[0].rounding == "nearest"
            assert hw_e2m1 == wants
            if s.outputs[0].rounding.startswith("stochastic"):
                assert "mul.wide.u32" in ptx  # Philox
            if s.global_scale:
                assert "div.rn.f32" in ptx


def test_nvfp4_rne_sm100a_uses_the_hardware_e2m1_convert(modules, tmp_path: Path) -> None:
    mod = modules("quant_e2m1_1x16_e4m3rn_g_bf16_row_rne")
    ptx = _ptx(mod.compile_kernel("quantize", "sm_100a", dump_dir=str(tmp_path)))
    assert ptx.count("cvt.rn.satfinite.e2m1x2.f32") == 8  # 16 values per thread
    assert "cvt.rn.satfinite.e4m3x2.f32" in ptx  # the block scale
    assert "ld.global.v4" in ptx and "st.global.v2" in ptx  # 128-bit loads, one 64-bit store


def test_compile_kernel_rejects_unknown_names(modules) -> None:
    mod = modules("quant_e4m3_1x32_ue8m0ru_nog_bf16_row_rne")
    assert mod.KERNELS == ("quantize",)
    with pytest.raises(ValueError, match="no kernel"):
        mod.compile_kernel("amax", "sm_90a")
    with pytest.raises(ValueError, match="arch"):
        mod.compile_kernel("quantize", "sm_80")


def test_run_validates_the_input(modules) -> None:
    mod = modules("quant_e2m1_1x16_e4m3rn_g_bf16_row_rne")
    fns: dict = {}
    good = torch.zeros(4, 32, dtype=torch.bfloat16)
    cases = [
        (torch.zeros(32, dtype=torch.bfloat16), "2-D"),
        (torch.zeros(4, 32, dtype=torch.float32), "bfloat16"),
        (torch.zeros(4, 24, dtype=torch.bfloat16), "multiple of 16"),
        (torch.zeros(0, 32, dtype=torch.bfloat16), "empty"),
        (torch.zeros(32, 4, dtype=torch.bfloat16).t(), "multiple of 16|contiguous"),
        (torch.zeros(8, 64, dtype=torch.bfloat16)[:, :32], "contiguous"),
        (good, "CUDA"),
    ]
    for x, rule in cases:
        with pytest.raises(TensorError, match=rule) as err:
            mod.run(fns, x)
        assert str(tuple(x.shape)) in str(err.value) and str(x.dtype) in str(err.value)
    with pytest.raises(TensorError, match="Tensor"):
        mod.run(fns, [[1.0]])


# ----------------------------------------------------------------------------------------------
# Tile kernels: cross-compilation and PTX
# ----------------------------------------------------------------------------------------------
def _tile_arch_cases() -> list[tuple[str, str]]:
    """Every planned spec on both archs; each hand-made spec on one (alternating), to keep the
    suite short."""
    cases = [(name, arch) for name in sorted(PLANNED_TILE) for arch in ARCHS]
    cases += [(name, ARCHS[i % 2]) for i, name in enumerate(sorted(TILE_HAND_SPECS))]
    return cases


@pytest.mark.parametrize(("name", "arch"), _tile_arch_cases())
def test_tile_cross_compile(name: str, arch: str, modules, tmp_path: Path) -> None:
    mod = modules(name)
    s = TILE_SPECS[name]
    for kernel in mod.KERNELS:
        fn = mod.compile_kernel(kernel, arch, dump_dir=str(tmp_path / kernel))
        ptx = _ptx(fn)
        assert f".target {arch}" in ptx
        assert not re.search(r"\.local\b", ptx), f"{kernel} uses local memory (spills)"
        assert not re.search(r"\.approx|\.ftz", ptx), "approximate or flush-to-zero math"
        prepared = hasattr(mod, "CONST_LEN")  # the amax kernel prepares the global scales
        if kernel != "quantize":
            assert "atom.global" in ptx or "red.global" in ptx  # one atomic max per CTA
            assert ("div.rn.f32" in ptx) == prepared
            continue
        roundings = {o.rounding for o in s.outputs}
        assert re.search(r"fma\.rn\.f32 [^;]*, 0f00000000;", ptx)  # the element scaling
        hw_e2m1 = "cvt.rn.satfinite.e2m1x2.f32" in ptx
        assert hw_e2m1 == (arch == "sm_100a" and s.element == E2M1 and "nearest" in roundings)
        if "stochastic" in roundings:
            assert "mul.wide.u32" in ptx  # Philox
            assert "add.cc.u32" in ptx and "cvt.rzi.u64.f32" in ptx  # the exact SR step
        if any(o.rht is not None for o in s.outputs):
            assert "cvt.rn.bf16x2.f32" in ptx  # the RHT output, rounded to bf16
        if s.global_scale:
            assert ("div.rn.f32" in ptx) != prepared
        assert "st.global" in ptx


def test_nvfp4_gradient_kernel_shape(modules, tmp_path: Path) -> None:
    """The fused gradient kernel (the staged layout, docs/quantize-kernels.md): one 16-byte load
    per strip row, the strip also stored to shared memory; the folded path quantizes the 8
    columns from the registers (unrolled) and the rows in a rolled loop reading 4 rows per
    iteration from shared memory; the unfolded path (S_dec past FOLD_SDEC_MAX) runs both copies
    in rolled loops from shared memory. e_b from a shared-memory table, 8 random bits per value
    (one Philox call per 16 values: the two lanes of a call's row segments compute one row's
    call each and trade halves by shuffles, a column strip of 16 takes one), the fp16-image SR
    encode (two values per convert and min), predicated stores (no branch around them)."""
    mod = modules("quant_e2m1_1x16_e4m3rn_g_bf16_row_sr8_col_sr8_rht16")
    ptx = _ptx(mod.compile_kernel("quantize", "sm_90a", dump_dir=str(tmp_path)))
    # 16 rows x 8 bf16, and (k_enc, S_dec) of both copies from the prepared constants
    assert ptx.count("ld.global.v4") == 16 + 1
    assert ptx.count("st.shared.v4") == 16  # the strip staged for the row loops
    assert ptx.count("ld.shared.v4") == 2 * 4  # 4 rows per row-loop iteration, both paths
    # the folded path's row loop, the unfolded path's column and row loops
    assert ptx.count('.pragma "nounroll"') == 3
    # Philox calls: folded 8 columns + 2 per row-loop body; unfolded 2 per column-loop body
    # + 2 per row-loop body (LLVM shares the products of counter words equal in all calls)
    calls = 8 + 2 + 2 + 2
    assert 2 * 10 * calls - 24 <= ptx.count("mul.wide.u32") <= 2 * 10 * calls
    # per row-loop body: 4 row amax butterflies + 2 row-call halves per 2 rows; two row loops
    assert ptx.count("shfl.sync.bfly") == 2 * (4 + 2 * 2)
    # every pair of elements: folded 8 columns x 8 + 4 rows x 4, unfolded 2 x 8 + 4 x 4
    pairs = 8 * 8 + 4 * 4 + 2 * 8 + 4 * 4
    assert ptx.count("cvt.rz.f16x2.f32") == ptx.count("min.xorsign.abs.f16x2") == pairs
    # each value scaled by one fma.rn with +0.0 (the sign bit x < 0, no extra instruction)
    assert len(re.findall(r"fma\.rn\.f32 [^;]*, 0f00000000;", ptx)) == 2 * pairs
    assert "mul.rz.f32" not in ptx and "cvt.rzi" not in ptx  # no per-element rescale or convert
    # code words: folded 8 columns x 2 + 4 rows, unfolded 2 columns x 2 + 4 rows
    assert ptx.count("@p st.global.u32") == 8 * 2 + 4 + 2 * 2 + 4
    assert "ld.shared.f32" in ptx or "ld.shared.b32" in ptx  # the encode-factor table
    assert "ld.local" not in ptx and "st.local" not in ptx  # no spills


@pytest.mark.parametrize(
    "name",
    [
        "quant_e2m1_1x16_e4m3rn_g_bf16_row_sr8_col_sr8_rht16",
        "quant_e2m1_1x16_e4m3rn_g_bf16_row_rne_col_rne_rht16",
        "quant_e3m2_1x8_e4m3rn_g_bf16_row_sr_col_sr",
    ],
)
def test_amax_kernel_prepares_the_encode_constants(name: str, modules, tmp_path: Path) -> None:
    """1D tile kernels with a global scale and e4m3 scales: the amax kernel's last CTA (one
    acq_rel counter atomic per CTA, acquire loads of the final amaxes) computes S_enc, S_dec
    (div.rn, rcp.rn) and the encode-factor tables; the quantize kernel copies them and divides
    nothing. Both take a (tiles along K, tiles along M) grid: no integer division outside the
    1-D fallback."""
    mod = modules(name)
    amax = _ptx(mod.compile_kernel("amax", "sm_90a", dump_dir=str(tmp_path / "amax")))
    quant = _ptx(mod.compile_kernel("quantize", "sm_90a", dump_dir=str(tmp_path / "quantize")))
    assert len(mod.OUTPUTS) * (256 + 2) == mod.CONST_LEN
    assert amax.count("atom.acq_rel.gpu.global.add.u32") == 1
    assert amax.count("ld.acquire.gpu.global.f32") == mod.AMAX_SLOTS
    assert "div.rn.f32" in amax and "rcp.rn.f32" in amax
    assert "div.rn" not in quant and "rcp.rn" not in quant
    for ptx in (amax, quant):
        assert "%ctaid.y" in ptx and "%nctaid.y" in ptx
        assert ptx.count("div.s32") + ptx.count("div.u32") <= 1  # the 1-D fallback's


def test_mxfp4_gradient_kernel_draws_a_word_per_value(modules, tmp_path: Path) -> None:
    """ "round stochastic" (32 random bits per value): one Philox call per 4 values and the
    64-bit truncating convert per element (a 32 x 4 strip: a rolled row loop of 4 rows per
    iteration; the 4 columns, two per word, unrolled)."""
    mod = modules("quant_e2m1_1x32_ue8m0ru_nog_bf16_row_sr_col_sr_rht32")
    ptx = _ptx(mod.compile_kernel("quantize", "sm_90a", dump_dir=str(tmp_path)))
    calls = 4 + 4 * 32 // 4  # LLVM may share the products of counter words equal in all calls
    assert 2 * 10 * calls - 2 * calls <= ptx.count("mul.wide.u32") <= 2 * 10 * calls
    assert ptx.count("cvt.rzi.u64.f32") == 4 * 4 + 4 * 32


def test_2d_columnwise_codes_are_a_transpose(modules, tmp_path: Path) -> None:
    """16x16 NVFP4 weights: the columnwise codes are permuted from the rowwise ones (PRMT and
    masks), not encoded twice: as many converts as elements on sm_100a."""
    mod = modules("quant_e2m1_16x16_e4m3rn_g_bf16_row_rne_col_rne")
    ptx = _ptx(mod.compile_kernel("quantize", "sm_100a", dump_dir=str(tmp_path)))
    assert ptx.count("cvt.rn.satfinite.e2m1x2.f32") == 16 * 8 // 2
    assert "prmt.b32" in ptx


def test_tile_run_validates_the_input(modules) -> None:
    mod = modules("quant_e2m1_1x16_e4m3rn_g_bf16_row_sr8_col_sr8_rht16")
    assert mod.OUTPUTS == ("rowwise", "columnwise")
    cases = [
        (torch.zeros(24, 32, dtype=torch.bfloat16), "M must be a multiple of 16"),
        (torch.zeros(32, 24, dtype=torch.bfloat16), "K must be a multiple of 16"),
        (torch.zeros(32, 32, dtype=torch.float32), "bfloat16"),
        (torch.zeros(32, 32, dtype=torch.bfloat16), "CUDA"),
    ]
    for x, rule in cases:
        with pytest.raises(TensorError, match=rule):
            mod.run({}, x)
    with pytest.raises(ValueError, match="one offset per output"):
        mod._offsets((1, 2, 3))
    assert mod._offsets(5) == (5, 5) and mod._offsets((1, 2)) == (1, 2)
    weights = modules("quant_e2m1_16x16_e4m3rn_g_bf16_row_rne_col_rne")
    assert weights.M_MULTIPLE == 8 and weights.K_MULTIPLE == 16


@pytest.mark.parametrize(
    ("element", "rounding", "whole_words", "expected"),
    [
        (E2M1, "stochastic8", True, "srhalf"),  # 1 + 8 bits below fp16's 10 mantissa bits
        (ElementFormat(1, 2), "stochastic8", True, "srhalf"),  # m = 2: the bits just fit
        (ElementFormat(3, 0), "stochastic8", True, "srhalf"),
        (E2M1, "stochastic8", False, "srshift"),  # a word with fewer than 8 codes
        (E2M1, "stochastic16", True, "srshift"),  # 16 random bits do not fit fp16
        (E3M2, "stochastic8", True, "srshift"),  # 6-bit codes: not 8 per word
        (E2M1, "stochastic", True, "sr64"),
        (E2M1, "nearest", True, "rne"),
    ],
)
def test_software_encode_choice(element, rounding, whole_words, expected) -> None:
    """The fp16-image encode serves 4-bit formats with 8 random bits and m <= 2, called on whole
    code words; the rest keep the fp32 bit encode."""
    from fp4gen.codegen.quantize import _sw_encode

    assert _sw_encode(element, rounding, tile=True, whole_words=whole_words) == expected


def test_fp16_image_constants() -> None:
    """E2M1's image: z = y * 2^-14 puts 1.0 on fp16's smallest normal; 6.0 maps to 0x0E00
    (exponent field 3, mantissa 0x200) in both halves; the code starts at bit 9, its 8 random
    bits at bit 1."""
    from fp4gen.codegen.quantize import _element_context

    half = _element_context(E2M1).half
    assert half is not None
    assert float(half.scale) == 2.0**-14
    assert half.max2 == "0x0E000E00"
    assert (half.code_shift, half.rand_shift) == (9, 1)
    assert _element_context(E3M2).half is None  # 6-bit codes


@pytest.mark.parametrize(
    ("element", "block", "rounding", "share"),
    [
        (E2M1, (1, 16), "stochastic8", 2),  # a call covers 16 values: two 8-value segments
        (E2M1, (1, 16), "stochastic16", 1),  # a call covers 8: one segment
        (E2M1, (1, 16), "stochastic", 1),
        (E3M2, (1, 8), "stochastic8", 1),  # K % 8 only: a call may span two rows
    ],
)
def test_row_philox_sharing(element, block, rounding, share) -> None:
    """Lanes share a row call only when it covers several of their segments and never spans a
    row (K a multiple of the call's values)."""
    from fp4gen.codegen.quantize import tile_context

    outs = (("rowwise", rounding, None, "compact"), ("columnwise", rounding, None, "compact"))
    assert tile_context(tile(element, block, NV, True, outs)).row_share == share


def test_folded_encode_factors_stay_normal_up_to_the_bound() -> None:
    """The staged gradient layout folds ELEM_TO_F16 = 2^-14 into the e4m3 encode-factor table
    only while S_dec <= FOLD_SDEC_MAX: at the bound every entry e_b * 2^-14 (e_b = min(1 /
    (s_b * S_dec), FLT_MAX) in fp32, docs/numerics.md 2.5) is still a normal fp32, so x * t
    equals the unfolded (x * e_b) * 2^-14. Other inputs keep the rotated layout and no fold."""
    from dataclasses import replace

    from fp4gen.codegen.quantize import tile_context

    spec = QuantKernelSpec(
        E2M1,
        (1, 16),
        ScaleSpec(E4M3, "nearest"),
        True,
        "bf16",
        (
            QuantOutput("rowwise", "stochastic8", None),
            QuantOutput("columnwise", "stochastic8", RHTSpec(16)),
        ),
    )
    ctx = tile_context(spec)
    assert ctx.staged and ctx.fold == ("row", "col")
    assert ctx.fold_sdec_max is not None
    bound = float(ctx.fold_sdec_max)
    assert bound == 2.0**102
    codes = torch.arange(256, dtype=torch.int32)
    s_b = torch.tensor([E4M3.value(int(c)) for c in codes], dtype=torch.float32)
    s_b = s_b[torch.isfinite(s_b) & (s_b > 0)]
    e_b = torch.reciprocal(s_b * torch.tensor(bound, dtype=torch.float32))
    t = e_b * torch.tensor(2.0**-14, dtype=torch.float32)
    assert float(t.min()) >= 2.0**-126  # normal: the fold is exact
    assert torch.equal(t * 2.0**14, e_b)
    for dtype in ("fp32", "fp16"):
        other = tile_context(replace(spec, input_dtype=dtype))
        assert not other.staged and other.fold == ()
