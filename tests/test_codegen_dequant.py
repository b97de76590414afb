"""The generated dequantize kernel (``fp4gen.codegen.dequant``) on the CPU: rendering, the decode
rule against the reference for every code, cross-compilation for sm_90a and sm_100a of every
shipped recipe's GEMM operand formats (PTX: vector loads and stores, no local memory, no
flush-to-zero; ptxas: no spills), and the dequant GEMM's epilogue."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from fp4gen.codegen import import_source
from fp4gen.codegen.dequant import (
    THREADS,
    UNIT,
    render_dequant,
    spec_for,
    unsupported_reason,
)
from fp4gen.dsl import load_recipe
from fp4gen.dsl.model import Operand
from fp4gen.formats import (
    BUILTIN_FORMATS,
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
from fp4gen.numerics.minifloat import decode
from fp4gen.spec import DequantKernelSpec

ROOT = Path(__file__).resolve().parent.parent
RECIPES = sorted((ROOT / "fp4gen" / "recipes").glob("*.fp4r"))
UE5M0 = ElementFormat(5, 0, signed=False)
E2M5 = ElementFormat(2, 5)


def recipe_formats() -> set[BlockFormat]:
    """Every block format a shipped recipe feeds to a GEMM."""
    out: set[BlockFormat] = set()
    for path in RECIPES:
        ops = load_recipe(path).operands
        for op in Operand:
            fmt = ops[op].format
            if isinstance(fmt, BlockFormat):
                out.add(fmt)
    return out


def kernel_specs() -> dict[str, DequantKernelSpec]:
    """Every shipped recipe format the kernel serves, plus packed 4-bit codes and exotic pairs."""
    specs: dict[str, DequantKernelSpec] = {}
    for fmt in recipe_formats():
        spec = spec_for(fmt)
        if isinstance(spec, str):
            assert "fp32 block scales" in spec, spec  # fp8_blockwise: no exact bf16 path
            continue
        specs[spec.name] = spec
        if fmt.element.bits == 4:
            packed = spec_for(fmt, "packed")
            assert not isinstance(packed, str)
            specs[packed.name] = packed
    for extra in (
        DequantKernelSpec(E2M3, (1, 32), UE8M0),
        DequantKernelSpec(E5M2, (1, 32), UE8M0),
        DequantKernelSpec(E3M2, (1, 24), E4M3),  # three units per block
        DequantKernelSpec(E3M2, (1, 12), E4M3),  # blocks straddle the 8-value units
        DequantKernelSpec(E2M1, (32, 32), UE5M0),
    ):
        specs[extra.name] = extra
    return specs


SPECS = kernel_specs()


def test_shipped_recipes_are_covered() -> None:
    names = set(SPECS)
    for name in (
        "dequant_e2m1_1x16_e4m3_bytes",  # NVFP4 activations and gradients
        "dequant_e2m1_16x16_e4m3_bytes",  # NVFP4 2D weights
        "dequant_e2m1_1x16_e4m3_packed",
        "dequant_e2m1_1x32_ue8m0_bytes",  # MXFP4
        "dequant_e4m3_1x32_ue8m0_bytes",  # MXFP8
        "dequant_e3m2_1x8_e4m3_bytes",  # the exotic recipe
    ):
        assert name in names


@pytest.mark.parametrize("name", sorted(SPECS))
def test_render_is_valid_deterministic_python(name: str) -> None:
    spec = SPECS[name]
    src = render_dequant(spec)
    compile(src, f"<{name}>", "exec")
    assert render_dequant(spec) == src
    assert f'SPEC_NAME = "{name}"' in src and 'KERNELS: tuple[str, ...] = ("dequant",)' in src
    assert f"PACKED = {spec.codes == 'packed'}" in src
    assert ("scale_exponent=True" in src) == spec.scale.exponent_only
    assert "from fp4gen.kernels import dequant" in src  # the kernel is the shared class


@pytest.mark.skipif(shutil.which("ruff") is None, reason="ruff is not installed")
def test_generated_sources_are_ruff_clean(tmp_path: Path) -> None:
    for spec in SPECS.values():
        (tmp_path / f"{spec.name}.py").write_text(render_dequant(spec))
    for args in (["check", "--select", "E,F,W,I,UP,B,SIM"], ["format", "--check"]):
        proc = subprocess.run(
            ["ruff", *args, "--line-length", "100", "--no-cache", str(tmp_path)],
            capture_output=True,
            text=True,
            check=False,
        )
        assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        (DequantKernelSpec(E2M5, (1, 32), E4M3), "more than bf16's 8 significant bits"),
        (DequantKernelSpec(E4M3, (1, 32), E4M3, "packed"), "packed codes"),
        (DequantKernelSpec(E2M1, (16, 32), E4M3), "16x32 blocks"),
        (DequantKernelSpec(UE8M0, (1, 32), E4M3), "signed formats"),
    ],
)
def test_unsupported_specs_are_rejected_clearly(spec: DequantKernelSpec, match: str) -> None:
    assert match in (unsupported_reason(spec) or "")
    with pytest.raises(NotImplementedError, match=match):
        render_dequant(spec)


def test_fp32_scales_have_no_kernel() -> None:
    fmt = BlockFormat("fp8_block", E4M3, (1, 128), ScaleSpec(None))
    assert "fp32 block scales" in str(spec_for(fmt))
    assert isinstance(spec_for(BUILTIN_FORMATS["nvfp4"]), DequantKernelSpec)


# ----------------------------------------------------------------------------------------------
# The decode rule, emulated with the module's own constants on the CPU (fp32 ops are correctly
# rounded and keep subnormals), against the reference decode for every element and scale code
# ----------------------------------------------------------------------------------------------
def _f32(bits: torch.Tensor) -> torch.Tensor:
    return bits.to(torch.int64).to(torch.int32).view(torch.float32)


def _consts(src: str) -> dict[str, float]:
    """The numeric fields of the module's ``PARAMS`` (literals and powers of two such as
    ``2.0**126``), by their names in upper case (``elem_shift``: ``ELEM_SHIFT``)."""
    out: dict[str, float] = {}
    for name, value in re.findall(r"^    ([a-z_]+)=(\d[0-9.xXA-Fa-f*+-]*),", src, re.M):
        base, _, exp = value.partition("**")
        number = float(int(base, 16)) if base.lower().startswith("0x") else float(base)
        out[name.upper()] = number ** int(exp) if exp else number
    return out


def _finite_codes(fmt: ElementFormat) -> torch.Tensor:
    codes = torch.arange(1 << fmt.bits, dtype=torch.int64)
    values = torch.tensor([fmt.value(int(c)) for c in codes], dtype=torch.float64)
    return codes[torch.isfinite(values)]


@pytest.mark.parametrize("name", sorted(SPECS))
def test_decode_rule_matches_the_reference_for_every_code(name: str) -> None:
    spec = SPECS[name]
    c = _consts(render_dequant(spec))
    codes = _finite_codes(spec.element)
    mag = (codes & int(c["ELEM_MAG_MASK"])) << int(c["ELEM_SHIFT"])
    sign = (codes << (32 - int(c["ELEM_BITS"]))) & 0x80000000
    elem = _f32(mag | sign) * torch.tensor(c["ELEM_FACTOR"], dtype=torch.float32)
    scodes = _finite_codes(spec.scale)
    if spec.scale.signed:  # block scales are never negative: the kernel ignores the sign bit
        scodes = scodes[scodes < (1 << (spec.scale.bits - 1))]
    if spec.scale.exponent_only:
        bits = (scodes + int(c["SCALE_OFFSET"])) << 23
        bits = torch.where(bits == 0, torch.full_like(bits, 0x00400000), bits)
        scale = _f32(bits)
    else:
        bits = (scodes & int(c["SCALE_MAG_MASK"])) << int(c["SCALE_SHIFT"])
        scale = _f32(bits) * torch.tensor(c["SCALE_FACTOR"], dtype=torch.float32)
    want_e = decode(codes.to(torch.uint8), spec.element)
    want_s = decode(scodes.to(torch.uint8), spec.scale)
    assert torch.equal(elem.view(torch.int32), want_e.view(torch.int32))  # -0 included
    assert torch.equal(scale, want_s)
    got = (elem[:, None] * scale[None, :]).to(torch.bfloat16)
    want = (want_e[:, None] * want_s[None, :]).to(torch.bfloat16)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    # exact: the bf16 value is the float64 product in bf16's normal range (below 2^-126 the
    # subnormals hold fewer bits; past fp32's range no finite input quantizes to such a pair)
    exact = want_e.double()[:, None] * want_s.double()[None, :]
    big = (exact.abs() >= 2.0**-126) & (exact.abs() <= torch.finfo(torch.float32).max)
    assert torch.equal(got.double()[big], exact[big])


# ----------------------------------------------------------------------------------------------
# Cross-compilation (CPU only)
# ----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def modules(tmp_path_factory: pytest.TempPathFactory):
    directory = tmp_path_factory.mktemp("generated_dequant")
    cache: dict[str, object] = {}

    def get(name: str):
        if name not in cache:
            cache[name] = import_source(render_dequant(SPECS[name]), directory)
        return cache[name]

    return get


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
@pytest.mark.parametrize("name", sorted(SPECS))
def test_cross_compile(name: str, arch: str, modules, tmp_path: Path) -> None:
    mod = modules(name)
    spec = SPECS[name]
    fn = mod.compile_kernel("dequant", arch, dump_dir=str(tmp_path))
    ptx = "\n".join(ln for ln in fn.__ptx__.splitlines() if not ln.lstrip().startswith("//"))
    assert f".target {arch}" in ptx
    units = mod.PARAMS.units_per_thread
    # one load of codes per unit (8 bytes, or 4 packed), one 16-byte store of bf16
    load = r"ld\.global\.(b|u)32\s" if spec.codes == "packed" else r"ld\.global\.v2\.(b|u)32\s"
    assert len(re.findall(load, ptx)) == units
    assert ptx.count("st.global.v4.b32") == units
    assert ptx.count("cvt.rn.bf16x2.f32") == UNIT // 2 * units
    assert not re.search(r"\.local\b", ptx), "local memory (spills or indexed arrays)"
    assert not re.search(r"\.approx|\.ftz", ptx), "approximate or flush-to-zero math"
    assert f".maxntid {THREADS}" in ptx or "reqntid" in ptx or mod.PARAMS.threads == THREADS
    ptxas = shutil.which("ptxas")
    files = list(tmp_path.glob(f"*.{arch}.ptx"))
    if ptxas and files:
        proc = subprocess.run(
            [ptxas, f"-arch={arch}", "-v", str(files[0]), "-o", os.devnull],
            capture_output=True,
            text=True,
            check=False,
        )
        if proc.returncode == 0:  # an older ptxas may not know this PTX version
            assert "bytes spill" not in proc.stderr.replace("0 bytes spill", "")
            regs = int(re.search(r"Used (\d+) registers", proc.stderr).group(1))
            assert regs * THREADS <= 65536 // 2  # two CTAs per SM at least


def test_compile_kernel_rejects_unknown_names_and_archs(modules) -> None:
    mod = modules("dequant_e2m1_1x16_e4m3_bytes")
    assert mod.KERNELS == ("dequant",) and mod.ARCHS == ("sm_90a", "sm_100a")
    with pytest.raises(ValueError, match="no kernel"):
        mod.compile_kernel("gemm", "sm_90a")
    with pytest.raises(ValueError, match="arch"):
        mod.compile_kernel("dequant", "sm_80")


def test_launch_args_validate_the_operand(modules) -> None:
    from fp4gen.errors import TensorError

    mod = modules("dequant_e2m1_1x16_e4m3_bytes")
    codes = torch.zeros(4, 40, dtype=torch.uint8)
    with pytest.raises(TensorError, match="CUDA"):
        mod.launch_args(codes, torch.zeros(4, 3, dtype=torch.uint8), cols=40)
    with pytest.raises(TensorError, match="2-D uint8"):
        mod.launch_args(codes.float(), torch.zeros(4, 3, dtype=torch.uint8), cols=40)
    assert mod.padded_cols(40) == 40 and mod.padded_cols(12) == 16 and UNIT == 8


def test_kernels_for_renders_dequant_specs() -> None:
    from fp4gen.compiler.jit import kernel_names, render_source

    spec = SPECS["dequant_e2m1_1x16_e4m3_bytes"]
    src = render_source(spec)
    assert src == render_dequant(spec) and kernel_names(src) == ("dequant",)


# ----------------------------------------------------------------------------------------------
# The dequant GEMM's epilogue (one elementwise pass): fp32(c * alpha) (+ bias) (+ C), one cast
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("bias", "acc"), [(False, False), (True, False), (False, True), (True, True)]
)
def test_epilogue(out_dtype: torch.dtype, bias: bool, acc: bool) -> None:
    from fp4gen.runtime.dequant import epilogue

    g = torch.Generator().manual_seed(3)
    c = torch.randn(7, 5, generator=g) * 1e3
    alpha = torch.tensor(0.37, dtype=torch.float32)
    b = torch.randn(5, generator=g) if bias else None
    a = torch.randn(7, 5, generator=g) if acc else None
    a_copy = None if a is None else a.clone()
    want = c * alpha
    if b is not None:
        want = want + b
    if a is not None:
        want = want + a
    got = epilogue(c.clone(), alpha, b, a, out_dtype)
    assert got.dtype == out_dtype and got.shape == (7, 5)
    assert a is None or torch.equal(a, a_copy)
    if b is not None and a is None:
        # addcmul may fuse c * alpha + bias into one rounding (an FMA): either result is right
        fused = (c.double() * float(alpha) + b.double()).float()
        ok = (got == want.to(out_dtype)) | (got == fused.to(out_dtype))
        assert bool(ok.all())
    else:
        assert torch.equal(got, want.to(out_dtype))
