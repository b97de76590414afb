"""The native Blackwell GEMM (``fp4gen.gemm(backend="blackwell")``, sm_100a).

CPU (CI) checks:
  * which tcgen05 block-scaled MMA serves which pair of operand formats (and the reason for the
    rest), consistent with nvidia-cutlass-operators' own rule;
  * the operand layouts bit for bit: packed codes against an independent bit formula, scale codes
    against an independent indexing of the 128x4 tensor-core layout (cuBLAS "1D block scaling
    factors layout"; PTX ISA "tcgen05 scale factor layout") and against the kernel's own layout
    function (``tile_atom_to_shape_SF``) evaluated while tracing;
  * the dispatch rule of ``backend="auto"`` on sm_100a and what ``gemm_path`` reports;
  * cross-compilation for sm_100a of every supported pair and of every shipped recipe's GEMMs,
    with the PTX read back: the ``tcgen05.mma`` kind, ``block_scale`` with the scale-vector size,
    the instruction descriptor's element formats and scale type (bit 23: ue4m3 0, ue8m0 1), the
    fused alpha, no local memory, no ptxas spills.

GPU (sm_100 only, skipped elsewhere): the native kernel against ``gemm_reference`` (exact and
within a derived bound; see ``test_native_gemm_matches_reference``).
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import subprocess
from functools import cache
from pathlib import Path

import pytest
import torch

import fp4gen
from fp4gen.codegen.gemm_configs import (
    TILES,
    GemmConfig,
    MmaPlan,
    gemm_config,
    mma_plan,
    pick_tile,
    render_module,
    shape_reason,
)
from fp4gen.dsl import load_recipe
from fp4gen.dsl.model import Operand
from fp4gen.errors import FP4GenError, TensorError
from fp4gen.formats import BUILTIN_FORMATS, BlockFormat, HighPrecision, ScaleSpec
from fp4gen.gemm_dispatch import GemmChoice, choose_backend, gemm_path
from fp4gen.numerics import QuantizedTensor, gemm_reference, quantize
from fp4gen.numerics.layout import pack
from fp4gen.numerics.minifloat import decode, encode
from fp4gen.runtime.blackwell_gemm import kernel_args, native_gemm, pack_codes, scale_buffer

ROOT = Path(__file__).resolve().parent.parent
RECIPES = sorted((ROOT / "fp4gen" / "recipes").glob("*.fp4r"))
F = BUILTIN_FORMATS
NVFP4, MXFP4 = F["nvfp4"], F["mxfp4"]
NVFP4_2D = NVFP4.with_block((16, 16))
E4M3, E5M2 = F["mxfp8_e4m3"], F["mxfp8_e5m2"]
E2M3, E3M2 = F["mxfp6_e2m3"], F["mxfp6_e3m2"]
# the package's kernel uses DSL helpers that announce their move to the CUTLASS examples
pytestmark = [
    pytest.mark.filterwarnings("ignore:Migrated to examples:DeprecationWarning"),
    pytest.mark.filterwarnings("ignore:FastDivmodDivisor is deprecated:DeprecationWarning"),
]


# ----------------------------------------------------------------------------------------------
# Which MMA for which pair
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("a", "b", "kind", "types", "scale", "vec", "k_multiple"),
    [
        (NVFP4, NVFP4, "mxf4nvf4", ("Float4E2M1FN", "Float4E2M1FN"), "ue4m3", 16, 32),
        (NVFP4, NVFP4_2D, "mxf4nvf4", ("Float4E2M1FN", "Float4E2M1FN"), "ue4m3", 16, 32),
        (NVFP4_2D.with_block((1, 16)), NVFP4_2D, "mxf4nvf4", None, "ue4m3", 16, 32),
        (MXFP4, MXFP4, "mxf4nvf4", ("Float4E2M1FN", "Float4E2M1FN"), "ue8m0", 32, 32),
        (MXFP4, MXFP4.with_block((32, 32)), "mxf4nvf4", None, "ue8m0", 32, 32),
        (MXFP4.with_block((1, 16)), MXFP4.with_block((1, 16)), "mxf4nvf4", None, "ue8m0", 16, 32),
        (E4M3, E4M3, "mxf8f6f4", ("Float8E4M3FN", "Float8E4M3FN"), "ue8m0", 32, 16),
        (E5M2, E5M2, "mxf8f6f4", ("Float8E5M2", "Float8E5M2"), "ue8m0", 32, 16),
        (E4M3, E5M2, "mxf8f6f4", ("Float8E4M3FN", "Float8E5M2"), "ue8m0", 32, 16),
        (E4M3, E2M3, "mxf8f6f4", ("Float8E4M3FN", "Float6E2M3FN"), "ue8m0", 32, 128),
        (E3M2, E4M3, "mxf8f6f4", ("Float6E3M2FN", "Float8E4M3FN"), "ue8m0", 32, 128),
        (MXFP4, E4M3, "mxf8f6f4", ("Float4E2M1FN", "Float8E4M3FN"), "ue8m0", 32, 128),
    ],
)
def test_mma_plan_of_hardware_pairs(a, b, kind, types, scale, vec, k_multiple) -> None:
    plan = mma_plan(a, b)
    assert isinstance(plan, MmaPlan), plan
    assert (plan.kind, plan.scale, plan.sf_vec, plan.k_multiple) == (kind, scale, vec, k_multiple)
    if types is not None:
        assert (plan.a_dtype, plan.b_dtype) == types
    assert plan.describe() == f"tcgen05.mma kind::{kind}.block_scale.block{vec}, {scale} scales"


E3M3 = dataclasses.replace(E2M3, name="e3m3", element=dataclasses.replace(E2M3.element, exp_bits=3))


@pytest.mark.parametrize(
    ("a", "b", "why"),
    [
        (HighPrecision("bf16"), NVFP4, "not block-scaled"),
        (F["nvfp4"].with_block((1, 8)), NVFP4, "A has 1x8 blocks"),
        (NVFP4, NVFP4.with_block((128, 128)), "B has 128x128 blocks"),
        (NVFP4, MXFP4, "different scale formats (e4m3 and ue8m0)"),
        (MXFP4, MXFP4.with_block((1, 16)), "different block lengths along K (32 and 16)"),
        (E4M3.with_block((1, 16)), E4M3.with_block((1, 16)), "16-value blocks are an e2m1"),
        (NVFP4.with_block((1, 32)), NVFP4.with_block((1, 32)), "32-value blocks need ue8m0"),
        (E2M3, E2M3, "6-bit operands pair with e4m3 only"),
        (E2M3, E5M2, "6-bit operands pair with e4m3 only"),
        (MXFP4, E3M2, "6-bit operands pair with e4m3 only"),
        (E3M3, E3M3, "A has e3m3 elements"),
        (
            BlockFormat("fp8_block", E4M3.element, (1, 128), ScaleSpec(None)),
            E4M3,
            "A has fp32 block scales",
        ),
        (
            BlockFormat("e5m2_scaled", E4M3.element, (1, 32), ScaleSpec(E5M2.element)),
            E4M3,
            "A has e5m2 block scales",
        ),
    ],
)
def test_mma_plan_says_why_not(a, b, why: str) -> None:
    reason = mma_plan(a, b)
    assert isinstance(reason, str) and why in reason


def test_mma_plan_agrees_with_the_packages_rule() -> None:
    """Every element x element x scale x vector-size combination: a plan exactly where the
    package's kernel accepts the types (its own validity check)."""
    import cutlass
    from cutlass.operators.providers.cutedsl.gemm.implementations import (
        sm100_dense_blockscaled_static_persistent_impl as impl,
    )

    elements = {
        "e2m1": (NVFP4.element, cutlass.Float4E2M1FN),
        "e2m3": (E2M3.element, cutlass.Float6E2M3FN),
        "e3m2": (E3M2.element, cutlass.Float6E3M2FN),
        "e4m3": (E4M3.element, cutlass.Float8E4M3FN),
        "e5m2": (E5M2.element, cutlass.Float8E5M2),
    }
    scales = {
        "e4m3": (NVFP4.scale, cutlass.Float8E4M3FN),
        "ue8m0": (MXFP4.scale, cutlass.Float8E8M0FNU),
    }
    valid = impl.PersistentDenseBlockScaledGemmKernel.is_valid_dtypes_and_scale_factor_vec_size
    checked = 0
    for a_name, (a_el, a_dt) in elements.items():
        for b_name, (b_el, b_dt) in elements.items():
            for s_name, (spec, s_dt) in scales.items():
                for vec in (16, 32):
                    a = BlockFormat(a_name, a_el, (1, vec), spec)
                    b = BlockFormat(b_name, b_el, (1, vec), spec)
                    ours = isinstance(mma_plan(a, b), MmaPlan)
                    theirs = valid(a_dt, b_dt, s_dt, vec, cutlass.Float32)
                    assert ours == theirs, (a_name, b_name, s_name, vec)
                    checked += 1
    assert checked == 5 * 5 * 2 * 2


@pytest.mark.parametrize(
    ("a", "b", "mnk", "why"),
    [
        (NVFP4, NVFP4, (16, 64, 48), "K = 48 is not a multiple of 32 (16-byte TMA rows)"),
        (E4M3, E2M3, (16, 64, 64), "K = 64 is not a multiple of 128 (the unpacking TMA)"),
        (NVFP4, NVFP4, (16, 66, 64), "N = 66 is not a multiple of 4"),
        (E4M3, E4M3, (2**16, 2**15, 64), "32-bit"),
        (NVFP4, NVFP4, (0, 64, 64), "empty GEMM"),
    ],
)
def test_shape_reason(a, b, mnk, why: str) -> None:
    plan = mma_plan(a, b)
    assert isinstance(plan, MmaPlan)
    assert why in (shape_reason(plan, *mnk) or "")


def test_shape_reason_accepts_any_m_and_n_multiple_of_4() -> None:
    plan = mma_plan(NVFP4, NVFP4_2D)
    assert isinstance(plan, MmaPlan)
    for m, n, k in [(1, 4, 32), (17, 100, 96), (300, 8, 1024), (8192, 8192, 8192)]:
        assert shape_reason(plan, m, n, k) is None


# ----------------------------------------------------------------------------------------------
# Operand layouts, bit for bit
# ----------------------------------------------------------------------------------------------
def reference_pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Element j of a row in bits [j * bits, (j + 1) * bits) of the row's little-endian bit
    stream (byte i holds bits [8 i, 8 i + 8)), written out with Python integers."""
    rows = []
    for row in codes.tolist():
        value = sum(int(c) << (j * bits) for j, c in enumerate(row))
        nbytes = len(row) * bits // 8
        rows.append(list(value.to_bytes(nbytes, "little")))
    return torch.tensor(rows, dtype=torch.uint8)


@pytest.mark.parametrize("bits", [4, 6, 8])
def test_pack_codes_is_the_little_endian_bit_stream(bits: int) -> None:
    g = torch.Generator().manual_seed(bits)
    codes = torch.randint(0, 1 << bits, (7, 256), generator=g, dtype=torch.uint8)
    packed = pack_codes(codes, bits)
    assert packed.shape == (7, 256 * bits // 8)
    assert torch.equal(packed, reference_pack(codes, bits))
    assert torch.equal(packed, pack(codes, bits))  # fp4gen's packed ``data`` layout
    if bits == 4:  # torch's float4_e2m1fn_x2: element 0 in the low nibble
        assert packed[0, 0] == (codes[0, 0] | (codes[0, 1] << 4))


def test_pack_codes_rejects_partial_bytes() -> None:
    with pytest.raises(TensorError, match="whole bytes"):
        pack_codes(torch.zeros(2, 6, dtype=torch.uint8), 6)
    with pytest.raises(TensorError, match="uint8"):
        pack_codes(torch.zeros(2, 8), 4)


def reference_scale_offset(r: int, c: int, cols: int) -> int:
    """Byte offset of scale (r, c) of an [R, cols] scale matrix in the tensor-core layout, as the
    cuBLAS documentation describes it: the matrix is padded to 128-row x 4-column tiles, stored
    tile by tile (row-major over tiles, 512 bytes each); inside a tile, row r sits in 32-row
    group r // 32 of four, and the tile is stored as 32 lines of 16 bytes, line i holding rows
    i, i + 32, i + 64, i + 96 with their 4 scales each."""
    tiles_per_row = -(-cols // 4)
    tile = (r // 128) * tiles_per_row + c // 4
    line, group = r % 32, (r % 128) // 32
    return tile * 512 + line * 16 + group * 4 + c % 4


def expected_buffer(q: QuantizedTensor) -> torch.Tensor:
    rows, cols = q.rows, q.scale_codes.shape[1]
    br = q.format.block[0]
    buf = torch.zeros(-(-rows // 128) * 128 * (-(-cols // 4) * 4), dtype=torch.uint8)
    sc = q.scale_codes.tolist()
    for r in range(rows):
        for c in range(cols):
            buf[reference_scale_offset(r, c, cols)] = sc[r // br][c]  # 2D: the tile's scale
    return buf


OPERANDS = {  # (format, block, rows, K)
    "nvfp4_1d": (NVFP4, None, 300, 160),
    "nvfp4_2d": (NVFP4, (16, 16), 200, 96),
    "mxfp4": (MXFP4, None, 130, 96),
    "mxfp8": (E4M3, None, 257, 64),
}


def random_operand(name: str, seed: int = 0) -> QuantizedTensor:
    fmt, block, rows, k = OPERANDS[name]
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g) * torch.exp2(torch.randint(-6, 7, (rows, 1), generator=g))
    return quantize(x, fmt, block=block)


@pytest.mark.parametrize("name", sorted(OPERANDS))
def test_scale_buffer_is_the_tensor_core_layout(name: str) -> None:
    q = random_operand(name)
    buf = scale_buffer(q)
    assert buf.dtype == torch.uint8 and buf.dim() == 1
    assert torch.equal(buf, expected_buffer(q))
    assert len(set(q.scale_codes.flatten().tolist())) > 4  # not a degenerate pattern
    assert scale_buffer(q) is buf  # remembered per tensor


@pytest.fixture(scope="module")
def kernel_sf_offsets() -> dict[tuple[int, int, int], list[int]]:
    """The kernel's scale-factor layout (``blockscaled_layout.tile_atom_to_shape_SF``, what the
    package's kernel builds its SFA/SFB tensors from) evaluated for static shapes while tracing:
    offset of the scale of element (m, k)."""
    import cutlass.cute as cute
    import cutlass.utils.blockscaled_layout as blockscaled

    shapes = [(300, 160, 16), (200, 96, 16), (130, 96, 32), (257, 64, 32)]
    out: dict[tuple[int, int, int], list[int]] = {}

    def offsets(layout, m: int, k: int, vec: int) -> list[int]:
        # plain Python (not preprocessed by the DSL): static shapes give static offsets
        cols = -(-k // vec)
        return [int(cute.crd2idx((r, c * vec, 0), layout)) for r in range(m) for c in range(cols)]

    @cute.jit
    def probe():
        for m, k, vec in shapes:
            layout = blockscaled.tile_atom_to_shape_SF((m, k, 1), vec)
            out[(m, k, vec)] = offsets(layout, m, k, vec)

    cute.compile(probe)
    return out


@pytest.mark.parametrize("name", sorted(OPERANDS))
def test_scale_buffer_matches_the_kernels_layout_function(name: str, kernel_sf_offsets) -> None:
    q = random_operand(name)
    vec = q.format.block[1]
    offsets = torch.tensor(kernel_sf_offsets[(q.rows, q.cols, vec)])
    per_row = q.scale_codes.repeat_interleave(q.format.block[0], 0)[: q.rows]
    assert torch.equal(scale_buffer(q)[offsets], per_row.reshape(-1))
    assert offsets.unique().numel() == offsets.numel()


@pytest.mark.parametrize(
    ("a_fmt", "a_block", "b_fmt", "b_block", "k"),
    [
        (NVFP4, None, NVFP4, (16, 16), 96),
        (MXFP4, None, E4M3, None, 256),
        (E3M2, None, E4M3, None, 128),
    ],
)
def test_kernel_args_match_the_compiled_signature(a_fmt, a_block, b_fmt, b_block, k) -> None:
    """What the compiled function takes (``blackwell_kernel.compile_gemm``): uint8 codes
    [M, K * bits / 8] and [N, K * bits / 8] with 16-byte rows, uint8 scale buffers of whole
    512-byte atoms, C [M, N], alpha fp32 [1]; 16- / 32-byte aligned."""
    g = torch.Generator().manual_seed(k)
    a = quantize(torch.randn(37, k, generator=g), a_fmt, block=a_block)
    b = quantize(torch.randn(20, k, generator=g), b_fmt, block=b_block)
    plan = mma_plan(a.format, b.format)
    assert isinstance(plan, MmaPlan) and shape_reason(plan, 37, 20, k) is None
    out = torch.empty(37, 20)
    a_codes, b_codes, sfa, sfb, c, alpha = kernel_args(a, b, plan, out)
    assert c is out
    for codes, q, bits in ((a_codes, a, plan.a_bits), (b_codes, b, plan.b_bits)):
        assert codes.dtype == torch.uint8 and codes.is_contiguous()
        assert codes.shape == (q.rows, k * bits // 8) and codes.shape[1] * 8 // bits == k
        assert codes.shape[1] % 16 == 0 and codes.data_ptr() % 16 == 0
        assert torch.equal(codes, reference_pack(q.codes, bits))
    for buf, q in ((sfa, a), (sfb, b)):
        assert buf.dtype == torch.uint8 and buf.numel() % 512 == 0 and buf.data_ptr() % 32 == 0
        assert torch.equal(buf, expected_buffer(q))
    assert alpha.shape == (1,) and alpha.dtype == torch.float32
    assert torch.equal(alpha, (a.global_scale.float() * b.global_scale.float()).reshape(1))
    assert (float(alpha) != 1.0) == a.format.global_scale  # NVFP4's two decode scales


# ----------------------------------------------------------------------------------------------
# Dispatch
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("a", "b", "mnk", "backend", "why"),
    [
        (NVFP4, NVFP4_2D, (16, 4096, 4096), "blackwell", "kind::mxf4nvf4.block_scale.block16"),
        (NVFP4, NVFP4, (8192, 8192, 8192), "blackwell", "ue4m3 scales"),
        (MXFP4, MXFP4, (1, 64, 64), "blackwell", "kind::mxf4nvf4.block_scale.block32, ue8m0"),
        (E4M3, E4M3, (100, 200, 48), "blackwell", "kind::mxf8f6f4.block_scale.block32"),
        (E5M2, E4M3, (100, 200, 64), "blackwell", "kind::mxf8f6f4"),
        (E3M2, E4M3, (100, 200, 256), "blackwell", "kind::mxf8f6f4"),
        (E2M3, E2M3, (100, 200, 256), "dequant", "6-bit operands pair with e4m3 only"),
        (NVFP4, MXFP4, (16, 64, 64), "dequant", "different scale formats"),
        (NVFP4, NVFP4, (16, 64, 48), "dequant", "K = 48"),
        (HighPrecision("bf16"), NVFP4, (16, 64, 64), "dequant", "not block-scaled"),
    ],
)
def test_auto_on_sm100(a, b, mnk, backend: str, why: str) -> None:
    choice = choose_backend(a, b, *mnk, device="cuda", arch="sm_100a")
    assert choice.backend == backend and choice.fallback == (backend == "dequant")
    assert why in choice.why
    if backend == "dequant":
        assert choice.why.startswith("no native MMA on sm_100a: ")
    # the other arches keep their rule: Hopper's fused kernel, else dequant
    hopper = choose_backend(a, b, *mnk, device="cuda", arch="sm_90a")
    assert hopper.backend in ("cute", "dequant")
    assert choose_backend(a, b, *mnk, device="cpu", arch=None).backend == "reference"


def test_gemm_path_reports_the_native_mma() -> None:
    path, why = gemm_path(NVFP4, NVFP4_2D)
    assert path.startswith("dequantize to bf16 + cuBLAS")  # unchanged head (Hopper, others)
    native = "tcgen05.mma kind::mxf4nvf4.block_scale.block16, ue4m3 scales on sm_100a"
    assert path.endswith(f"; the native {native}")
    assert "on sm_100a the tensor cores read the codes and scales directly" in why
    path, why = gemm_path(E4M3, E4M3)
    assert "kind::mxf8f6f4.block_scale.block32, ue8m0 scales on sm_100a" in path
    fp8_block = BlockFormat("fp8_block", E4M3.element, (1, 128), ScaleSpec(None))
    path, why = gemm_path(fp8_block, fp8_block)
    # no native MMA: the path names no sm_100a kernel (Hopper's block-scaled scaled_mm aside)
    assert path.endswith(
        "elsewhere, or with set_fp8_semantics('exact'): dequantize to fp32 + fp32 GEMM (no TF32)"
    )
    assert "no native MMA on sm_100a: A has fp32 block scales" in why


def test_show_names_the_native_path_of_each_gemm() -> None:
    from fp4gen.cli import gemm_rows

    recipe = load_recipe(ROOT / "fp4gen" / "recipes" / "nvfp4.fp4r")
    rows = {g: (p, w) for g, p, w in gemm_rows(recipe)}
    for gemm in ("fprop", "dgrad", "wgrad"):
        assert "kind::mxf4nvf4.block_scale.block16, ue4m3 scales on sm_100a" in rows[gemm][0]


def test_blackwell_backend_errors() -> None:
    g = torch.Generator().manual_seed(0)
    a = quantize(torch.randn(8, 64, generator=g), "nvfp4")
    b = quantize(torch.randn(12, 64, generator=g), "nvfp4")
    with pytest.raises(FP4GenError, match="CUDA tensors"):
        fp4gen.gemm(a, b, backend="blackwell")
    kw = {"out_dtype": torch.float32, "bias": None, "accumulate": None}
    with pytest.raises(FP4GenError, match="no block-scaled tcgen05 MMA on sm_90a"):
        native_gemm(a, b, arch="sm_90a", **kw)
    m = quantize(torch.randn(12, 64, generator=g), "mxfp4")
    with pytest.raises(FP4GenError, match="no native MMA for nvfp4 x mxfp4"):
        native_gemm(a, m, arch="sm_100a", **kw)
    c = quantize(torch.randn(12, 48, generator=g), "nvfp4")
    with pytest.raises(TensorError, match="K mismatch"):
        native_gemm(a, c, arch="sm_100a", **kw)
    short = quantize(torch.randn(12, 48, generator=g), "nvfp4")
    with pytest.raises(FP4GenError, match="K = 48 is not a multiple of 32"):
        native_gemm(short, c, arch="sm_100a", **kw)
    with pytest.raises(TensorError, match="one CUDA device"):
        native_gemm(a, b, arch="sm_100a", **kw)


def test_auto_falls_back_when_the_native_kernel_is_unavailable(monkeypatch, caplog) -> None:
    import fp4gen.gemm_dispatch as gd

    g = torch.Generator().manual_seed(1)
    a = quantize(torch.randn(8, 64, generator=g), "nvfp4")
    b = quantize(torch.randn(12, 64, generator=g), "nvfp4", block=(16, 16))
    expected = fp4gen.gemm(a, b, backend="dequant")
    monkeypatch.setattr(gd, "_logged", set())
    monkeypatch.setattr(gd, "auto_backend", lambda a, b: GemmChoice("blackwell", "test"))

    def unavailable(*args):
        raise FP4GenError("the native GEMM kernel is not available: test")

    monkeypatch.setattr(gd, "_native", unavailable)
    with caplog.at_level("INFO", logger="fp4gen.gemm_dispatch"):
        for _ in range(3):
            assert torch.equal(fp4gen.gemm(a, b), expected)
    (record,) = caplog.records
    assert record.getMessage().endswith("the native GEMM kernel is not available: test")

    def bad_operands(*args):
        raise TensorError("K mismatch")  # the caller's error, not a fallback

    monkeypatch.setattr(gd, "_native", bad_operands)
    with pytest.raises(TensorError, match="K mismatch"):
        fp4gen.gemm(a, b)


# ----------------------------------------------------------------------------------------------
# Cross-compilation for sm_100a and the PTX
# ----------------------------------------------------------------------------------------------
# The block-scaled instruction descriptor (PTX ISA, tcgen05 "Instruction descriptor" for
# .kind::mxf8f6f4 / .kind::mxf4 / .kind::mxf4nvf4; CUTLASS UMMA::InstrDescriptorBlockScaled):
# bits 7-9 A format, 10-12 B format, 13/14 negate A/B, 17-22 N >> 3, 23 scale type
# (0 = ue4m3, 1 = ue8m0), 24-28 M >> 4; bits 0-6 and 29-30 carry sparsity and the scale-factor
# ids (added at run time).
FORMAT_CODES = {
    "mxf4nvf4": {"Float4E2M1FN": 1},
    "mxf8f6f4": {
        "Float8E4M3FN": 0,
        "Float8E5M2": 1,
        "Float6E2M3FN": 3,
        "Float6E3M2FN": 4,
        "Float4E2M1FN": 5,
    },
}


def descriptors(ptx: str, mma_m: int, mma_n: int) -> set[tuple[int, int, int]]:
    """(A format, B format, scale type) of the instruction-descriptor constants in the PTX: the
    32-bit literals whose M and N fields are the MMA's and whose run-time fields are zero."""
    found = set()
    for text in re.findall(r"(?<![\w.$%])(\d{7,10})(?![\w.])", ptx):
        v = int(text)
        if v >= 2**29 or v & 0x7F or (v >> 24) & 0x1F != mma_m >> 4:
            continue
        if (v >> 17) & 0x3F != mma_n >> 3:
            continue
        found.add(((v >> 7) & 7, (v >> 10) & 7, (v >> 23) & 1))
    return found


def ptx_compiler(compile_fn, root: Path):
    """config -> (PTX without comments, path of the dumped .ptx) of ``compile_fn(config,
    "sm_100a", dump_dir=...)``, each config compiled once."""

    @cache
    def get(config: GemmConfig) -> tuple[str, Path]:
        folder = root / config.name
        fn = compile_fn(config, "sm_100a", dump_dir=str(folder))
        ptx = fn.__ptx__
        assert isinstance(ptx, str) and ".entry" in ptx, "PTX not kept"
        text = "\n".join(line for line in ptx.splitlines() if not line.lstrip().startswith("//"))
        (path,) = folder.glob("*.sm_100a.ptx")
        return text, path

    return get


@pytest.fixture(scope="module")
def compiled(tmp_path_factory: pytest.TempPathFactory):
    """config -> (PTX without comments, path of the dumped .ptx), compiled once per session."""
    from fp4gen.runtime.blackwell_kernel import compile_gemm

    return ptx_compiler(compile_gemm, tmp_path_factory.mktemp("sm100_ptx"))


def check_ptx(ptx: str, plan: MmaPlan, config: GemmConfig) -> None:
    assert ".target sm_100a" in ptx
    two_cta = config.tile_mn[0] == 256
    mnemonics = set(re.findall(r"tcgen05\.mma\.\S+", ptx))
    block = f"block_scale.block{plan.sf_vec}"
    cta = f"cta_group::{2 if two_cta else 1}"
    assert mnemonics == {f"tcgen05.mma.{cta}.kind::{plan.kind}.{block}.collector::a::discard"}
    codes = FORMAT_CODES[plan.kind]
    scale_bit = 1 if plan.scale == "ue8m0" else 0
    expected = {(codes[plan.a_dtype], codes[plan.b_dtype], scale_bit)}
    assert descriptors(ptx, config.tile_mn[0], config.tile_mn[1]) == expected
    assert "tcgen05.cp.cta_group" in ptx  # scale factors copied to tensor memory
    # the epilogue alpha: one load of alpha, fp32 multiplies, exact (no .approx / .ftz)
    assert len(re.findall(r"ld\.global\.b32", ptx)) == 1
    assert re.search(r"\bmul(\.rn)?\.f32(x2)?\b", ptx)
    assert not re.search(r"\.approx|\.ftz", ptx)
    assert not re.search(r"\.local\b", ptx), "local memory (spills or indexed arrays)"


def check_ptxas(path: Path) -> None:
    ptxas = shutil.which("ptxas")
    if ptxas is None:
        return
    proc = subprocess.run(
        [ptxas, "-arch=sm_100a", "-v", str(path), "-o", os.devnull],
        capture_output=True,
        text=True,
        check=False,
    )
    if proc.returncode == 0:  # an older ptxas may not know sm_100a or this PTX version
        assert "0 bytes spill stores, 0 bytes spill loads" in proc.stderr, proc.stderr


CASES = {  # name -> (A format, B format, M (picks the tile), output dtype)
    "nvfp4_1d_x_1d": (NVFP4, NVFP4, 16, "Float32"),
    "nvfp4_1d_x_2d": (NVFP4, NVFP4_2D, 4096, "Float32"),
    "mxfp4": (MXFP4, MXFP4, 16, "BFloat16"),
    "mxfp4_2cta": (MXFP4, MXFP4, 4096, "Float32"),
    "mxfp8_e4m3": (E4M3, E4M3, 16, "Float32"),
    "mxfp8_e5m2": (E5M2, E5M2, 4096, "BFloat16"),
    "mxfp8_e4m3_x_e5m2": (E4M3, E5M2, 16, "Float32"),
    "mxfp8_x_mxfp6_e2m3": (E4M3, E2M3, 16, "Float32"),
    "mxfp6_e3m2_x_mxfp8": (E3M2, E4M3, 4096, "Float32"),
    "mxfp4_x_mxfp8": (MXFP4, E4M3, 16, "Float32"),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_cross_compile_sm100a(name: str, compiled) -> None:
    a, b, m, out = CASES[name]
    plan = mma_plan(a, b)
    assert isinstance(plan, MmaPlan)
    config = gemm_config(plan, m, out_dtype=out)
    assert config.tile_mn == TILES[pick_tile(m)][0]
    ptx, path = compiled(config)
    check_ptx(ptx, plan, config)
    check_ptxas(path)


def test_2d_weights_use_the_1d_kernel() -> None:
    """A 16x16 tile's scale is a 1x16 scale per row: the same kernel, only the scale buffer
    repeats it (checked bit for bit above)."""
    one_d, two_d = mma_plan(NVFP4, NVFP4), mma_plan(NVFP4, NVFP4_2D)
    assert one_d == two_d
    assert isinstance(one_d, MmaPlan) and isinstance(two_d, MmaPlan)
    assert gemm_config(one_d, 16) == gemm_config(two_d, 16)


def recipe_pairs() -> dict[str, set[tuple[object, object]]]:
    gemms = {
        "fprop": (Operand.FPROP_ACTIVATION, Operand.FPROP_WEIGHT),
        "dgrad": (Operand.DGRAD_GRADIENT, Operand.DGRAD_WEIGHT),
        "wgrad": (Operand.WGRAD_GRADIENT, Operand.WGRAD_ACTIVATION),
    }
    out: dict[str, set[tuple[object, object]]] = {}
    for path in RECIPES:
        ops = load_recipe(path).operands
        out[path.stem] = {(ops[a].format, ops[b].format) for a, b in gemms.values()}
    return out


NOT_HARDWARE = ("not block-scaled", "fp32 block scales", "1x8 blocks")


def test_every_shipped_recipe_gemm_cross_compiles_for_sm100a(compiled) -> None:
    """The GEMMs of every shipped recipe: a native MMA (compiled for sm_100a with both tiles, the
    PTX checked) or a stated reason (not a hardware format: the dequantizing path)."""
    native: set[str] = set()
    for recipe, pairs in recipe_pairs().items():
        for a, b in pairs:
            plan = mma_plan(a, b)
            if isinstance(plan, str):
                assert any(r in plan for r in NOT_HARDWARE), (recipe, plan)
                continue
            native.add(recipe)
            for m in (16, 4096):
                config = gemm_config(plan, m)
                ptx, _ = compiled(config)
                check_ptx(ptx, plan, config)
    assert native >= {"nvfp4", "nvfp4_1d_weights", "mxfp4", "mxfp8", "nvfp4_small", "mxfp4_small"}


def test_kernel_cache_compiles_once_then_loads(tmp_path: Path) -> None:
    """The generated module goes through fp4gen's kernel cache: the first build compiles and
    links a shared library, a second build (as a new process would) loads it."""
    from fp4gen.compiler import jit
    from fp4gen.compiler.cache import KernelCache
    from fp4gen.runtime.blackwell_gemm import gemm_kernel

    plan = mma_plan(MXFP4, MXFP4)
    assert isinstance(plan, MmaPlan)
    config = gemm_config(plan, 16)
    source = render_module(config)
    assert "nvidia-cutlass-operators" in source and config.name in source
    compile(source, "generated", "exec")
    cache = KernelCache(tmp_path)
    fn = gemm_kernel(config, "sm_100a", cache=cache)
    assert callable(fn) and gemm_kernel(config, "sm_100a", cache=cache) is fn
    path = cache.store_source(source)
    again = jit.build_kernel(cache, path, "gemm", "sm_100a")
    assert not again.built and again.entry.meta["artifact"] in ("kernel.so", "kernel.o")


def test_rendered_module_loads_its_config_and_names_the_wrapper() -> None:
    """The module ``render_module`` writes (fp4gen.codegen.gemm_configs) runs without the CuTe DSL
    until a kernel is compiled: its CONFIG is the config rendered, of the class the backend
    uses, and its docstring carries the digest of the wrapper it calls."""
    import hashlib

    from fp4gen.runtime import blackwell_gemm

    plan = mma_plan(NVFP4, NVFP4_2D)
    assert isinstance(plan, MmaPlan)
    config = gemm_config(plan, 1000, out_dtype="BFloat16")
    source = render_module(config)
    namespace: dict[str, object] = {}
    exec(compile(source, "generated", "exec"), namespace)
    assert namespace["CONFIG"] == config and blackwell_gemm.GemmConfig is GemmConfig
    wrapper = (ROOT / "fp4gen" / "runtime" / "blackwell_kernel.py").read_bytes()
    assert f"source digest {hashlib.sha256(wrapper).hexdigest()[:16]}" in source


def test_configs_name_everything_that_changes_the_binary() -> None:
    plan = mma_plan(NVFP4, NVFP4)
    assert isinstance(plan, MmaPlan)
    small, large = gemm_config(plan, 128), gemm_config(plan, 129)
    assert (
        small.name == "sm100_Float4E2M1FN_x_Float4E2M1FN_Float8E4M3FNv16_Float32_m128n64c1x1_g148"
    )
    assert large.name.endswith("_m256n128c2x1_g74")  # one persistent cluster per 2 SMs
    assert gemm_config(plan, 16, sm_count=132).max_active_clusters == 132
    names = {
        gemm_config(plan, m, out_dtype=o).name for m in (1, 999) for o in ("Float32", "BFloat16")
    }
    assert len(names) == 4


# ----------------------------------------------------------------------------------------------
# On a Blackwell GPU: the native kernel against the reference
# ----------------------------------------------------------------------------------------------
U = 2.0**-24
ON_SM100 = torch.cuda.is_available() and torch.cuda.get_device_capability() == (10, 0)
# values every native element format holds exactly; products and sums of them scaled by the
# dyadic scales below are multiples of 2^-4 below 2^20 for K <= 4096: exact in fp32
SMALL_VALUES = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]
DYADIC_SCALES = {"e4m3": [0x30, 0x38, 0x40], "ue8m0": [126, 127, 128]}  # 1/2, 1, 2


def dyadic_operand(q: QuantizedTensor, seed: int) -> QuantizedTensor:
    """``q`` with random small element values and dyadic scales, global scale 1."""
    g = torch.Generator(device=q.device).manual_seed(seed)
    pick = torch.randint(0, len(SMALL_VALUES), q.codes.shape, generator=g, device=q.device)
    values = torch.tensor(SMALL_VALUES, device=q.device)[pick]
    codes = encode(values, q.format.element)
    sc = torch.tensor(DYADIC_SCALES[q.format.scale.name], dtype=torch.uint8, device=q.device)
    pick = torch.randint(0, len(sc), q.scale_codes.shape, generator=g, device=q.device)
    scale_codes = sc[pick]
    return dataclasses.replace(
        q,
        codes=codes,
        scale_codes=scale_codes,
        scales=decode(scale_codes, q.format.scale.element),
        global_scale=torch.ones((), device=q.device),
    )


def bound(a: QuantizedTensor, b: QuantizedTensor, ref64, k, out_dtype, extra=None):
    """Per-element bound on |native - exact|, ``ref64`` the exact GEMM (float64) and ``extra``
    |bias| + |C| when they are added:
    * the products are exact: a decoded value v * s has at most 2 (e2m1), 4 (e2m3, e4m3) or 3
      (e3m2, e5m2) significant bits times 4 (e4m3 scale) or 1 (ue8m0), so a product of two has
      at most 16 and fp32 holds it (scale products stay in fp32's range for these operands);
    * fp32 accumulation of K products in any order, rounding or truncating (u' = 2u), errs by at
      most (K - 1) u' S with S = S_a S_b sum_k |a_k b_k|: 2 u K S. This assumes the MMA adds
      in fp32 (PTX ISA: the block-scaled kinds accumulate in F32); were its adder narrower,
      the exact cases below would fail first;
    * alpha = fp32(S_a * S_b) and acc * alpha round once each: 4 u (|ref| + B) (generous by 2);
    * bias and accumulate add one fp32 rounding each: 2 u (|ref| + |bias| + |C| + B);
    * bf16 output rounds once more: 2^-7 (|ref| + B) (one bf16 ulp, generous by 2).
    The same derivation as the Hopper kernel's (tests/test_gemm_kernels_gpu.py)."""
    va = a.dequantize_blockwise().double().abs()
    vb = b.dequantize_blockwise().double().abs()
    s = (va @ vb.t()) * (float(a.global_scale) * float(b.global_scale))
    err = 2 * U * k * s
    err = err + 4 * U * (ref64.abs() + err)
    if extra is not None:
        err = err + 2 * U * (ref64.abs() + extra + err)
    if out_dtype == torch.bfloat16:
        err = err + 2.0**-7 * (ref64.abs() + (0 if extra is None else extra) + err)
    return err + 1e-30


GPU_PAIRS = {  # name -> (A format, A block, B format, B block)
    "nvfp4_1d_x_2d": (NVFP4, None, NVFP4, (16, 16)),
    "nvfp4_1d_x_1d": (NVFP4, None, NVFP4, None),
    "mxfp4": (MXFP4, None, MXFP4, None),
    "mxfp8_e4m3": (E4M3, None, E4M3, None),
    "mxfp8_e5m2": (E5M2, None, E5M2, None),
    "mxfp8_x_mxfp6_e2m3": (E4M3, None, E2M3, None),
    "mxfp6_e3m2_x_mxfp8": (E3M2, None, E4M3, None),
    "mxfp4_x_mxfp8": (MXFP4, None, E4M3, None),
}
GPU_SHAPES = [(1, 64, 256), (100, 200, 512), (300, 136, 1024), (1024, 512, 4096)]


@pytest.mark.gpu
@pytest.mark.skipif(not ON_SM100, reason="needs an sm_100 (Blackwell) GPU")
@pytest.mark.parametrize("pair", sorted(GPU_PAIRS))
@pytest.mark.parametrize("mnk", GPU_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_native_gemm_matches_reference(pair: str, mnk) -> None:
    """exact: dyadic operands (any summation order gives the float64 value): bit-identical fp32,
    and bf16 rounded once. tolerance: the reference quantizer's operands (wide magnitudes,
    global scales), with bias and accumulate, within ``bound``. auto takes the same kernel."""
    a_fmt, a_block, b_fmt, b_block = GPU_PAIRS[pair]
    m, n, k = mnk
    g = torch.Generator(device="cuda").manual_seed(m + n + k)
    xa = torch.randn(m, k, generator=g, device="cuda")
    xa = xa * torch.exp2(torch.randint(-8, 9, (m, 1), generator=g, device="cuda").float())
    xb = torch.randn(n, k, generator=g, device="cuda")
    a = quantize(xa, a_fmt, block=a_block)
    b = quantize(xb, b_fmt, block=b_block)
    if b_block == (16, 16):  # dgrad: the columnwise weight is the transposed 2D quantization
        b = quantize(xb.t().contiguous(), b_fmt, block=b_block).transpose()

    ea, eb = dyadic_operand(a, 1), dyadic_operand(b, 2)
    exact = gemm_reference(ea, eb)
    got = fp4gen.gemm(ea, eb, backend="blackwell")
    assert torch.equal(got, exact)
    got16 = fp4gen.gemm(ea, eb, backend="blackwell", out_dtype=torch.bfloat16)
    assert torch.equal(got16, exact.bfloat16())
    assert torch.equal(fp4gen.gemm(ea, eb), got)  # auto on sm_100a: the same kernel

    ref64 = gemm_reference(a, b).double()
    for out_dtype in (torch.float32, torch.bfloat16):
        got = fp4gen.gemm(a, b, backend="blackwell", out_dtype=out_dtype).double()
        assert ((got - ref64).abs() <= bound(a, b, ref64, k, out_dtype)).all()
    bias = torch.randn(n, generator=g, device="cuda")
    acc = torch.randn(m, n, generator=g, device="cuda")
    got = fp4gen.gemm(a, b, backend="blackwell", bias=bias, accumulate=acc).double()
    ref = ref64 + bias.double() + acc.double()
    extra = bias.double().abs() + acc.double().abs()
    assert ((got - ref).abs() <= bound(a, b, ref64, k, torch.float32, extra)).all()
