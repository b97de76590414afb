"""Rowwise quantize codegen: render every rowwise spec of the shipped recipes plus hand-made ones,
check the source, and cross-compile it for sm_90a and sm_100a on the CPU (PTX read back)."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

import fp4gen
from fp4gen.codegen import import_source
from fp4gen.codegen.quantize import ARCHS, choose_mapping, render
from fp4gen.compiler.spec import QuantKernelSpec, QuantOutput
from fp4gen.dsl.model import RHTSpec
from fp4gen.dsl.parser import load_recipe
from fp4gen.errors import TensorError
from fp4gen.formats import (
    E2M1,
    E2M3,
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
            if not isinstance(fmt, BlockFormat) or fmt.is_2d:
                continue
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


def test_recipes_give_the_expected_rowwise_specs() -> None:
    names = {s.name for s in RECIPE_SPECS}
    assert {
        "quant_e2m1_1x16_e4m3rn_g_bf16_row_rne",
        "quant_e2m1_1x16_e4m3rn_g_bf16_row_sr",
        "quant_e2m1_1x16_e4m3rn_g_bf16_row_sr_rht16",
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
    assert ("def philox4x32_10" in src) == (s.outputs[0].rounding == "stochastic")
    assert ("RHT_SIZE =" in src) == (s.outputs[0].rht is not None)
    assert s.name in src.split('"""')[1]  # the docstring names the kernel


@pytest.mark.skipif(shutil.which("ruff") is None, reason="ruff is not installed")
def test_generated_sources_are_ruff_clean(tmp_path: Path) -> None:
    for s in ALL_SPECS.values():
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
    with pytest.raises(NotImplementedError, match="rowwise"):
        render(QuantKernelSpec(*nv, (columnwise,)))
    with pytest.raises(NotImplementedError, match="rowwise"):
        render(QuantKernelSpec(*nv, (rowwise, columnwise)))
    with pytest.raises(NotImplementedError, match="2D"):
        render(QuantKernelSpec(E2M1, (16, 16), ScaleSpec(E4M3), True, "bf16", (rowwise,)))
    with pytest.raises(NotImplementedError, match="multiple of 8"):
        render(QuantKernelSpec(E2M1, (1, 12), ScaleSpec(E4M3), True, "bf16", (rowwise,)))
    with pytest.raises(ValueError, match="swizzled"):
        render(spec(E4M3, 32, ScaleSpec(None), False, layout="swizzled"))
    with pytest.raises(NotImplementedError, match="RHT"):
        render(spec(E2M1, 16, ScaleSpec(E4M3), True, rht=RHTSpec(128, "none", None)))


def test_thread_mapping() -> None:
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


# ----------------------------------------------------------------------------------------------
# Cross-compilation (CPU only) and PTX
# ----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def modules(tmp_path_factory: pytest.TempPathFactory):
    directory = tmp_path_factory.mktemp("generated")
    cache: dict[str, object] = {}

    def get(name: str):
        if name not in cache:
            cache[name] = import_source(render(ALL_SPECS[name]), directory)
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
            hw_e2m1 = "cvt.rn.satfinite.e2m1x2.f32" in ptx
            wants = arch == "sm_100a" and s.element == E2M1 and s.outputs[0].rounding == "nearest"
            assert hw_e2m1 == wants
            if s.outputs[0].rounding == "stochastic":
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
