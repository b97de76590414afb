"""The generated block-scaled FP8 GEMM without a GPU: which pairs it serves, that its kernels
cross-compile for sm_90a to FP8 wgmma (the shipped fp8 recipes' pairs, e5m2 x e4m3, 1x64 and
1x256 blocks), the dispatch around it (``backend="cute"`` for FP8 pairs, ``auto`` behind the
measured table) and the host path's cached pieces (fp4gen.runtime.fp8_gemm)."""

from __future__ import annotations

import contextlib
import importlib.util
import re
import subprocess
import sys
from pathlib import Path
from unittest import mock

import pytest
import torch

import fp4gen
import fp4gen.gemm_dispatch as gd
from fp4gen.codegen.gemm_fp8 import tile_n_for
from fp4gen.dsl import load_recipe
from fp4gen.formats import BUILTIN_FORMATS, BlockFormat, ScaleSpec
from fp4gen.runtime import fp8_gemm

E4M3 = BUILTIN_FORMATS["mxfp8_e4m3"].element
E5M2 = BUILTIN_FORMATS["mxfp8_e5m2"].element
MXFP8 = BUILTIN_FORMATS["mxfp8_e4m3"]
NVFP4 = BUILTIN_FORMATS["nvfp4"]
ROW = BlockFormat("fp8_block", E4M3, (1, 128), ScaleSpec(None))
TILE = ROW.with_block((128, 128))
ROW_E5M2 = BlockFormat("fp8_e5m2_block", E5M2, (1, 128), ScaleSpec(None))


def fp8(element, block: tuple[int, int]) -> BlockFormat:
    return BlockFormat("fp8_test", element, block, ScaleSpec(None))


# ----------------------------------------------------------------------------------------------
# Which pairs the kernel serves (pure logic)
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "a, b",
    [
        (ROW, TILE),
        (ROW, ROW),
        (ROW_E5M2, ROW),
        (ROW, ROW_E5M2),
        (fp8(E4M3, (1, 64)), fp8(E4M3, (64, 64))),
        (fp8(E4M3, (1, 256)), fp8(E4M3, (1, 256))),
        (fp8(E4M3, (1, 32)), fp8(E5M2, (1, 32))),
        (MXFP8, MXFP8),
        (MXFP8, BUILTIN_FORMATS["mxfp8_e5m2"]),
    ],
)
def test_served_pairs(a, b) -> None:
    assert fp8_gemm.cute_support(a, b) is None


@pytest.mark.parametrize(
    "a, b, words",
    [
        (NVFP4, NVFP4, "e2m1 elements"),
        (fp8(E4M3, (1, 96)), fp8(E4M3, (1, 96)), "neither divides 128"),
        (fp8(E4M3, (1, 16)), fp8(E4M3, (1, 16)), "multiple of the FP8 wgmma K"),
        (fp8(E4M3, (1, 64)), TILE, "1x64 needs 1x64 or 64x64"),
        (TILE, TILE, "takes 1xN for A"),
        (ROW, MXFP8, "differ in kind"),
        (ROW, "bf16", "high precision"),
    ],
)
def test_refused_pairs_say_why(a, b, words) -> None:
    reason = fp8_gemm.cute_support(a, b)
    assert reason is not None and words in reason, reason


def test_pair_names_of_the_measured_table() -> None:
    assert fp8_gemm.cute_pair_name(ROW, TILE) == "e4m3 1x128 x e4m3 128x128 fp32"
    assert fp8_gemm.cute_pair_name(MXFP8, MXFP8) == "e4m3 1x32 x e4m3 1x32 ue8m0"


# ----------------------------------------------------------------------------------------------
# Dispatch: backend="cute" takes the FP8 kernel; auto keeps scaled_mm until the table says
# ----------------------------------------------------------------------------------------------
def test_auto_keeps_scaled_mm_until_measured() -> None:
    assert fp8_gemm.CUTE_AUTO_MIN_M == {}  # nothing measured yet
    for b in (TILE, ROW):
        choice = gd.choose_backend(ROW, b, 8192, 8192, 8192, device="cuda", arch="sm_90a")
        assert choice.backend == "block_scaled"
    choice = gd.choose_backend(MXFP8, MXFP8, 8192, 8192, 8192, device="cuda", arch="sm_90a")
    assert choice.backend == "dequant"


def test_auto_takes_the_kernel_where_the_table_says(monkeypatch) -> None:
    monkeypatch.setitem(fp8_gemm.CUTE_AUTO_MIN_M, "e4m3 1x128 x e4m3 128x128 fp32", 256)
    big = gd.choose_backend(ROW, TILE, 4096, 8192, 8192, device="cuda", arch="sm_90a")
    assert big.backend == "cute" and "from M = 256" in big.why
    small = gd.choose_backend(ROW, TILE, 128, 8192, 8192, device="cuda", arch="sm_90a")
    assert small.backend == "block_scaled"
    other = gd.choose_backend(ROW, ROW, 4096, 8192, 8192, device="cuda", arch="sm_90a")
    assert other.backend == "block_scaled"  # another pair: not in the table
    exact = gd.choose_backend(
        ROW, TILE, 4096, 8192, 8192, device="cuda", arch="sm_90a", semantics="exact"
    )
    assert exact.backend == "dequant"
    blackwell = gd.choose_backend(ROW, TILE, 4096, 8192, 8192, device="cuda", arch="sm_100a")
    assert blackwell.backend != "cute"


def test_backend_cute_routes_fp8_pairs_to_the_fp8_kernel(monkeypatch) -> None:
    seen = {}

    def fake_product(a, b, *, out_dtype, bias, accumulate, keep, out):
        seen["args"] = (a, b, out_dtype, bias, accumulate, keep, out)
        return "fp8 product"

    monkeypatch.setattr(fp8_gemm, "cute_block_scaled_product", fake_product)

    class Q:  # only the formats are read before the kernel call
        def __init__(self, fmt):
            self.format = fmt

    a, b = Q(ROW), Q(TILE)
    call = gd._GemmCall(a, b, torch.bfloat16, None, None, None, False)
    assert gd._fused(call) == "fp8 product"
    assert seen["args"] == (a, b, torch.bfloat16, None, None, None, None)  # not auto: none kept
    out = torch.empty(1)
    assert gd._fused(call._replace(out=out)) == "fp8 product"
    assert seen["args"][-1] is out  # where the caller wants C


# ----------------------------------------------------------------------------------------------
# Host path: the plan is kept per formats (identity), output dtype, bias and accumulate
# ----------------------------------------------------------------------------------------------
def test_plan_is_kept_and_says_what_the_kernel_writes(monkeypatch) -> None:
    monkeypatch.setattr(fp8_gemm, "CUTE_TILE_N", 128)  # the 128-wide tile; 192 below
    fp8_gemm._cute_plans.clear()
    plan = fp8_gemm.cute_plan(ROW, TILE, torch.bfloat16, False, False)
    assert fp8_gemm.cute_plan(ROW, TILE, torch.bfloat16, False, False) is plan
    assert plan.kernel_out == torch.bfloat16 and plan.block_k == 128 and not plan.ue8m0
    assert plan.params.b_2d and plan.params.b_scale_per_tile
    # accumulate is read in fp32: the kernel writes fp32, the epilogue rounds once
    acc = fp8_gemm.cute_plan(ROW, TILE, torch.bfloat16, True, True)
    assert acc.kernel_out == torch.float32 and acc.params.bias and acc.params.accumulate
    fp16 = fp8_gemm.cute_plan(ROW, ROW, torch.float16, False, False)
    assert fp16.kernel_out == torch.float32 and not fp16.params.b_2d
    mx = fp8_gemm.cute_plan(MXFP8, MXFP8, torch.float32, False, False)
    assert mx.ue8m0 and mx.block_k == 32 and mx.params.scale_kind == "ue8m0"
    assert not plan.params.overlap and plan.params.cluster_m == 2  # the measured default
    with mock.patch.object(fp8_gemm, "CUTE_CLUSTER_M", 1):
        assert fp8_gemm.cute_plan(ROW, TILE, torch.bfloat16, False, False).params.cluster_m == 1
    with mock.patch.object(fp8_gemm, "CUTE_OVERLAP", True):
        assert fp8_gemm.cute_plan(ROW, TILE, torch.bfloat16, False, False).params.overlap
        wide = fp8(E4M3, (1, 512))  # two K-blocks of 4 stages each do not fit in 6
        assert not fp8_gemm.cute_plan(wide, wide, torch.bfloat16, False, False).params.overlap
    # the 192-wide tile where B comes in tiles that it spans two of at most, without overlap
    with mock.patch.object(fp8_gemm, "CUTE_TILE_N", 192):
        wide = fp8_gemm.cute_plan(ROW, TILE, torch.bfloat16, False, False).params
        assert wide.tile_n == 192 and wide.b_scale_pair and wide.num_stages == 5
        assert fp8_gemm.cute_plan(ROW, ROW, torch.bfloat16, False, False).params.tile_n == 128
        small = fp8(E4M3, (1, 64)), fp8(E4M3, (64, 64))  # 192 columns span three 64-tiles
        assert fp8_gemm.cute_plan(*small, torch.bfloat16, False, False).params.tile_n == 128
        with mock.patch.object(fp8_gemm, "CUTE_OVERLAP", True):
            assert fp8_gemm.cute_plan(ROW, TILE, torch.bfloat16, False, False).params.tile_n == 128
    # an equal format that is another object gets its own entry (lookups are by identity)
    twin = BlockFormat("fp8_block", E4M3, (1, 128), ScaleSpec(None))
    assert fp8_gemm.cute_plan(twin, TILE, torch.bfloat16, False, False) is not plan
    # a call's width (cute_tile_n) is part of the key
    narrow = fp8_gemm.cute_plan(ROW, TILE, torch.bfloat16, False, False, 128)
    with mock.patch.object(fp8_gemm, "CUTE_TILE_N", 192):
        assert narrow.params.tile_n == 128
        wide = fp8_gemm.cute_plan(ROW, TILE, torch.bfloat16, False, False, 192)
        assert wide.params.tile_n == 192 and wide is not narrow


@pytest.mark.parametrize(
    "m, n, sms, want",
    [
        (8192, 8192, 132, 192),  # 21 waves of 192 columns against 32 of 128
        (4096, 4096, 132, 128),  # 6 waves of 192 (the last a third full) against 8 of 128
        (8192, 2048, 132, 128),  # measured: 1057 against 991 TFLOP/s
        (2048, 8192, 132, 128),  # measured: 970 against 894
        (16, 8192, 132, 128),  # one wave either way: 43 CTAs of 192 columns, 64 of 128
        (16384, 8192, 132, 192),
        (128, 192, 132, 128),  # one CTA of 192 columns against two of 128 side by side
        (8192, 8192, 114, 128),  # an H100 PCIe's SMs: 25 waves of 192 against 36 of 128
    ],
)
def test_the_tile_width_by_shape(m: int, n: int, sms: int, want: int) -> None:
    """tile_n_for: the width whose waves of the persistent grid take less time; the shapes
    measured on the H200 (docs/gemm-sm90.md) get the width that was faster there."""
    assert tile_n_for(m, n, sms, 192) == want
    assert tile_n_for(m, n, sms, 128) == 128  # nothing wider to choose


def test_a_call_takes_the_width_of_its_shape(monkeypatch) -> None:
    """fp8_gemm.cute_tile_n with CUTE_TILE_BY_SHAPE: the widest tile the pair takes where the
    shape fills its waves, else 128; a pair that takes no wider tile, and every pair without
    CUTE_TILE_BY_SHAPE, keep CUTE_TILE_N (cute_plan makes it 128 where the pair needs)."""
    monkeypatch.setitem(fp8_gemm._sm_counts, (0, 1), 132)
    monkeypatch.setattr(fp8_gemm, "CUTE_TILE_N", 192)
    dev = torch.device("cuda", 0)
    assert fp8_gemm.cute_tile_n(ROW, TILE, 4096, 4096, dev) == 128
    assert fp8_gemm.cute_tile_n(ROW, TILE, 8192, 8192, dev) == 192
    assert fp8_gemm.cute_tile_n(ROW, ROW, 4096, 4096, dev) == 192  # 1x128 B: 128 anyway
    assert fp8_gemm.cute_plan(ROW, ROW, torch.bfloat16, False, False, 192).params.tile_n == 128
    monkeypatch.setattr(fp8_gemm, "CUTE_TILE_BY_SHAPE", False)
    assert fp8_gemm.cute_tile_n(ROW, TILE, 4096, 4096, dev) == 192


class _Q:
    """The fields cute_scales reads."""

    def __init__(self, scales, scale_codes=None):
        self.scales = scales
        self.scale_codes = scale_codes


def test_scales_are_passed_as_the_quantize_kernels_write_them() -> None:
    s = torch.rand(5, 3)
    assert fp8_gemm.cute_scales(_Q(s), ue8m0=False) is s  # fp32 row-major: no copy
    t = torch.rand(3, 5).t()
    got = fp8_gemm.cute_scales(_Q(t), ue8m0=False)
    assert got.is_contiguous() and torch.equal(got, t)
    codes = torch.arange(15, dtype=torch.uint8).reshape(5, 3)
    padded = fp8_gemm.cute_scales(_Q(None, codes), ue8m0=True)  # rows of whole 4-byte words
    assert padded.shape == (5, 4) and torch.equal(padded[:, :3], codes)
    assert (padded[:, 3] == 0).all()
    words = torch.arange(40, dtype=torch.uint8).reshape(5, 8)
    assert fp8_gemm.cute_scales(_Q(None, words), ue8m0=True) is words


def test_mn_major_scales_are_the_transposed_rows() -> None:
    """The coalesced variant's scales: [KB, Rp], K-block b's scales of all R rows contiguous,
    Rp = R rounded up to 16 with zero rows; ue8m0 codes likewise (uint8, no word padding)."""
    g = torch.Generator().manual_seed(2)
    s = torch.rand(37, 5, generator=g)
    got = fp8_gemm.cute_scales_mn_major(_Q(s), ue8m0=False)
    assert got.shape == (5, 48) and got.dtype == torch.float32 and got.is_contiguous()
    assert torch.equal(got[:, :37], s.t()) and (got[:, 37:] == 0).all()
    exact = torch.rand(32, 3, generator=g)  # R a multiple of 16: nothing padded
    assert torch.equal(fp8_gemm.cute_scales_mn_major(_Q(exact), ue8m0=False), exact.t())
    codes = torch.randint(0, 255, (20, 7), generator=g, dtype=torch.uint8)
    got = fp8_gemm.cute_scales_mn_major(_Q(None, codes), ue8m0=True)
    assert got.shape == (7, 32) and got.dtype == torch.uint8
    assert torch.equal(got[:, :20], codes.t()) and (got[:, 20:] == 0).all()


def test_mn_major_scales_written_so_are_read_as_they_are() -> None:
    """Scales that are a [R, KB] view of a [KB, Rp] buffer (what the quantize kernels would
    write for this layout) go to the kernel as that buffer: no copy."""
    buffer = torch.rand(6, 48)
    view = buffer[:, :37].t()
    got = fp8_gemm.cute_scales_mn_major(_Q(view), ue8m0=False)
    assert got.data_ptr() == buffer.data_ptr() and got.shape == (6, 48)
    assert torch.equal(got, buffer)
    # a pitch that is not a multiple of 16, or a row-major tensor: transposed into a new one
    odd = torch.rand(6, 40)[:, :37].t()
    assert fp8_gemm.cute_scales_mn_major(_Q(odd), ue8m0=False).data_ptr() != odd.data_ptr()
    one_block = torch.rand(32, 1)  # one K-block: the column is the buffer's row
    got = fp8_gemm.cute_scales_mn_major(_Q(one_block), ue8m0=False)
    assert got.data_ptr() == one_block.data_ptr() and torch.equal(got, one_block.t())


def test_params_refuse_what_the_kernel_cannot_do() -> None:
    from fp4gen.kernels.gemm_sm90_fp8 import GemmSm90Fp8Params

    good = dict(a_element="e4m3", b_element="e4m3", scale_kind="fp32", block_k=128)
    good.update(b_2d=True, out="bf16", bias=False, accumulate=False)
    assert GemmSm90Fp8Params(**good).num_stages == 6  # 33 KiB stages in 227 KiB
    for change, words in (
        ({"block_k": 96}, "neither divides 128"),
        ({"a_element": "e2m1"}, "a_element must be one of"),
        ({"tile_n": 48}, "tile_n must be a multiple of 32"),
        ({"out": "fp16"}, "out must be one of"),
        ({"block_k": 512, "overlap": True}, "overlap holds two K-blocks of 4 stages"),
        ({"cluster_m": 4}, "cluster_m must be 1 or 2"),
        ({"tile_n": 192, "b_2d": False}, "needs B in tiles"),
        ({"tile_n": 192, "block_k": 64}, "spans more than two"),
        ({"tile_n": 192, "overlap": True}, "overlap keeps three accumulators"),
    ):
        with pytest.raises(ValueError, match=words):
            GemmSm90Fp8Params(**{**good, **change})


# ----------------------------------------------------------------------------------------------
# Cross-compilation for sm_90a (no GPU): FP8 wgmma of the right element pair
# ----------------------------------------------------------------------------------------------
def _recipe_pairs(name: str) -> set[tuple[BlockFormat, BlockFormat]]:
    """The (A, B) format pairs of a shipped recipe's fprop, dgrad and wgrad GEMMs."""
    from fp4gen.dsl.model import Operand

    ops = load_recipe(f"{name}.fp4r").operands
    return {
        (ops[a].format, ops[b].format)
        for a, b in (
            (Operand.FPROP_ACTIVATION, Operand.FPROP_WEIGHT),
            (Operand.DGRAD_GRADIENT, Operand.DGRAD_WEIGHT),
            (Operand.WGRAD_GRADIENT, Operand.WGRAD_ACTIVATION),
        )
    }


CUTE_DSL = importlib.util.find_spec("cutlass") is not None


@pytest.mark.skipif(not CUTE_DSL, reason="needs the CuTe DSL (nvidia-cutlass-dsl)")
def test_kernels_cross_compile_to_fp8_wgmma(tmp_path: Path, monkeypatch) -> None:
    """One compile per case (about 1.5 s each on two CPU cores): the fp8_blockwise pairs
    (1x128 x 128x128 with a bf16 output, 1x128 x 1x128 with an fp32 one, a bias and
    accumulate), mxfp8's (1x32, ue8m0), e5m2 x e4m3, and 1x64 / 1x256 blocks."""
    from fp4gen.kernels.gemm_sm90_fp8 import GemmSm90Fp8Params, compile_fp8_gemm

    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_90a")
    cases = [
        ("e4m3", "e4m3", "fp32", 128, True, "bf16", False, False),
        ("e4m3", "e4m3", "fp32", 128, False, "fp32", True, True),
        ("e4m3", "e4m3", "ue8m0", 32, False, "bf16", False, False),
        ("e5m2", "e4m3", "fp32", 128, False, "bf16", True, False),
        ("e4m3", "e5m2", "fp32", 64, True, "fp32", False, False),
        ("e4m3", "e4m3", "fp32", 256, False, "bf16", False, True),
    ]
    cases = [(*case, False, 1) for case in cases]
    # the overlapped variant (two partial accumulators) of the fp8_blockwise fprop pair and of
    # 1x256 blocks (two k-tiles per K-block); 2-CTA clusters multicasting B, with and without
    cases += [(*cases[0][:-2], True, 1), (*cases[-1][:-2], True, 1)]
    cases += [(*cases[0][:-2], False, 2), (*cases[2][:-2], True, 2)]
    cases = [(*case, False) for case in cases]
    # the coalesced variant (MN-major scales, whole-sector stores): fp32 and ue8m0 scales,
    # B's scales MN-major (1xN), per tile (128x128) and per 64 columns (64x64), bf16 and fp32
    # outputs with bias and accumulate, overlap and clusters
    cases += [(*case[:-1], True) for case in cases[:5]]
    cases += [(*cases[6][:-1], True), (*cases[9][:-1], True)]
    cases = [(*case, 128) for case in cases]
    # 192-wide tiles (B's tiles: two scales per tile): the fprop pair coalesced and row-major,
    # with 2-CTA clusters; ue8m0 scales with bias and accumulate; 256x256 B tiles
    cases += [
        ("e4m3", "e4m3", "fp32", 128, True, "bf16", False, False, False, 1, True, 192),
        ("e4m3", "e4m3", "fp32", 128, True, "bf16", False, False, False, 2, False, 192),
        ("e4m3", "e5m2", "ue8m0", 128, True, "fp32", True, True, False, 2, True, 192),
        ("e4m3", "e4m3", "fp32", 256, True, "bf16", True, False, False, 1, True, 192),
    ]
    for case in cases:
        a_el, b_el, kind, block_k, b_2d, out, bias, accumulate, overlap, cluster_m, wide, n = case
        params = GemmSm90Fp8Params(
            a_element=a_el,
            b_element=b_el,
            scale_kind=kind,
            block_k=block_k,
            b_2d=b_2d,
            out=out,
            bias=bias,
            accumulate=accumulate,
            overlap=overlap,
            cluster_m=cluster_m,
            mn_major_scales=wide,
            wide_stores=wide,
            tile_n=n,
        )
        dump = tmp_path / params.name
        compile_fp8_gemm(params, "sm_90a", dump_dir=str(dump))
        ptx = "\n".join(p.read_text() for p in dump.glob("*.ptx"))
        wgmma = set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.(\S+?) ", ptx))
        # m64 n{tile_n} k32 wgmma, A's element first
        assert wgmma == {f"m64n{n}k32.f32.{a_el}.{b_el}"}, (params.name, wgmma)
        # one K-block's wgmma per issue site: one site, or three with overlap (the first
        # block, the loop's two halves; and the odd block left at the end)
        sites = 4 if overlap else 1
        assert ptx.count("wgmma.mma_async") == sites * block_k // 32, params.name
        assert ("wgmma.wait_group.sync.aligned \t1;" in ptx) == overlap
        assert "setmaxnreg.inc.sync.aligned.u32 \t232" in ptx
        assert "cp.async.bulk.tensor.2d" in ptx  # TMA of the codes
        assert ".local" not in ptx, f"{params.name} uses local memory"
        # clusters: B's TMA multicast, stage releases to both CTAs, cluster barriers at the
        # start (barriers initialized) and the end (no CTA leaves before its peer)
        multicast = "multicast::cluster" in ptx
        assert multicast == (cluster_m > 1) and ("mapa.shared::cluster" in ptx) == multicast
        assert ptx.count("barrier.cluster.wait") == (2 if cluster_m > 1 else 0)
        # the scales' copies: one 4-byte cp.async per row (A's 4 instructions of 32 rows, B's
        # 4 of 32 columns), or MN-major 16-byte chunks (A's, a 1xN B's) beside B's rows of
        # tiles (one word where one scale covers the tile)
        copies = re.findall(r"cp\.async\.ca\.shared\.global \[[^]]*\], \[[^]]*\], (\d+);", ptx)
        if not wide:
            assert copies == ["4"] * ((128 + n) // 32), (params.name, copies)
        elif not b_2d:
            assert copies == ["16", "16"], (params.name, copies)
        elif params.b_scale_per_tile or params.b_scale_pair:  # one lane, or two
            assert copies == ["16", "4"], (params.name, copies)
        else:
            assert copies == ["16"] + ["4"] * (n // 32), (params.name, copies)
        # the epilogue: 16-byte bf16 stores after the quad's shuffles, or 8-byte fp32 pairs
        # (element stores where a row reaches past N); else one store per element
        vector = "st.global.v4.b32" if out == "bf16" else "st.global.v2.f32"
        assert (vector in ptx) == wide, params.name
        assert ("shfl.sync.bfly" in ptx) == (wide and out == "bf16"), params.name


def test_shipped_fp8_recipe_pairs_are_served() -> None:
    """The pairs the compile test covers are the shipped recipes' (fp8_blockwise, mxfp8)."""
    names = set()
    for recipe in ("fp8_blockwise", "mxfp8"):
        for a, b in _recipe_pairs(recipe):
            assert fp8_gemm.cute_support(a, b) is None, (recipe, a, b)
            names.add(fp8_gemm.cute_pair_name(a, b))
    assert names == {
        "e4m3 1x128 x e4m3 128x128 fp32",
        "e4m3 1x128 x e4m3 1x128 fp32",
        "e4m3 1x32 x e4m3 1x32 ue8m0",
    }


# ----------------------------------------------------------------------------------------------
# The launch's arguments (the compiled kernel stood in: CPU tensors, the device said to be
# cuda:0 on sm_90a)
# ----------------------------------------------------------------------------------------------
@contextlib.contextmanager
def _cuda_stood_in(launched: list):
    from fp4gen.compiler import jit

    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.dict(jit._archs, {0: "sm_90a"}))
        stack.enter_context(
            mock.patch.object(fp8_gemm, "one_cuda_device", lambda a, b, w: torch.device("cpu"))
        )
        stack.enter_context(mock.patch.object(fp8_gemm, "sm_count", lambda dev, cluster: 132))
        stack.enter_context(
            mock.patch.object(fp8_gemm, "cute_kernel", lambda params: launched.append(params))
        )
        yield


def _on_cuda0(*qs) -> None:
    for q in qs:
        q.__dict__["device"] = torch.device("cuda", 0)  # a cached property


@pytest.mark.parametrize(
    "fa, fb", [(ROW, TILE), (MXFP8, MXFP8), (fp8(E5M2, (1, 64)), fp8(E4M3, (64, 64)))]
)
def test_launch_arguments_of_the_row_major_variant(fa, fb, monkeypatch) -> None:
    """Without CUTE_MN_MAJOR_SCALES the launch passes the scales as the quantize kernels
    wrote them (row-major); the default variant is the coalesced one (test below)."""
    from fp4gen.numerics import quantize

    monkeypatch.setattr(fp8_gemm, "CUTE_MN_MAJOR_SCALES", False)
    monkeypatch.setattr(fp8_gemm, "CUTE_WIDE_STORES", False)

    g = torch.Generator().manual_seed(0)
    m, n, k = 40, 200, 300  # K not a whole number of blocks: zero codes appended
    a = quantize(torch.randn(m, k, generator=g), fa)
    b = quantize(torch.randn(n, k, generator=g), fb)
    _on_cuda0(a, b)
    bias = torch.randn(n, generator=g).to(torch.bfloat16)
    launched: list = []
    with _cuda_stood_in(launched):
        fn, args, product = fp8_gemm.cute_launch(a, b, out_dtype=torch.bfloat16, bias=bias)
    params = launched[0]
    block_k = fa.block[1]
    kp = -(-k // block_k) * block_k
    codes_a, sf_a, codes_b, sf_b, ga, gb, c, bias_arg, ctas = args
    assert codes_a.shape == (m, kp) and codes_b.shape == (n, kp)
    assert codes_a.dtype == torch.uint8 and params.a_element == fa.element.name[:4]
    assert torch.equal(codes_a[:, :k], a.codes) and torch.equal(codes_b[:, :k], b.codes)
    assert (codes_a[:, k:] == 0).all()  # zero codes add exactly 0
    if params.scale_kind == "fp32":
        assert sf_a is a.scales and sf_b is b.scales  # as the quantize kernels wrote them
    else:  # ue8m0 codes, rows padded to whole 4-byte words
        kb = -(-k // block_k)
        assert sf_a.dtype == torch.uint8 and sf_a.shape == (m, -(-kb // 4) * 4)
        assert torch.equal(sf_a[:, :kb], a.scale_codes)
    assert ga.shape == (1,) and gb.shape == (1,) and ga.dtype == torch.float32
    assert c.shape == (m, n) and c.dtype == torch.bfloat16  # bf16 straight from the kernel
    assert bias_arg.dtype == torch.float32 and torch.equal(bias_arg, bias.float())
    assert ctas == 132
    assert params.bias and not params.accumulate and params.b_2d == fb.is_2d
    assert product.c is c and product.scaled and product.bias and not product.accumulated


@pytest.mark.parametrize(
    "fa, fb", [(ROW, TILE), (ROW, ROW), (MXFP8, MXFP8), (fp8(E5M2, (1, 64)), fp8(E4M3, (64, 64)))]
)
def test_launch_arguments_of_the_coalesced_variant(fa, fb, monkeypatch) -> None:
    """With CUTE_MN_MAJOR_SCALES the launch passes A's scales (and a 1xN B's) MN-major,
    [KB, round_up(R, 16)]; B's tile scales as the quantize kernels wrote them."""
    from fp4gen.numerics import quantize

    monkeypatch.setattr(fp8_gemm, "CUTE_MN_MAJOR_SCALES", True)
    monkeypatch.setattr(fp8_gemm, "CUTE_WIDE_STORES", True)
    g = torch.Generator().manual_seed(3)
    m, n, k = 40, 200, 300
    a = quantize(torch.randn(m, k, generator=g), fa)
    b = quantize(torch.randn(n, k, generator=g), fb)
    _on_cuda0(a, b)
    launched: list = []
    with _cuda_stood_in(launched):
        _, args, _ = fp8_gemm.cute_launch(a, b, out_dtype=torch.bfloat16)
    params = launched[0]
    assert params.mn_major_scales and params.wide_stores and "_mn_ws_" in params.name
    ue8m0 = params.scale_kind == "ue8m0"
    kb = -(-k // fa.block[1])
    sf_a, sf_b = args[1], args[3]
    want_a = a.scale_codes if ue8m0 else a.scales
    assert sf_a.shape == (kb, 48) and torch.equal(sf_a[:, :m], want_a.t())
    if fb.is_2d:
        assert not params.b_mn_major and sf_b is b.scales
    else:
        want_b = b.scale_codes if ue8m0 else b.scales
        assert params.b_mn_major and sf_b.shape == (kb, 208)
        assert torch.equal(sf_b[:, :n], want_b.t())


@pytest.mark.parametrize(
    ("out_dtype", "made", "direct"),
    [
        (torch.bfloat16, torch.bfloat16, True),  # the kernel writes bf16: into out
        (torch.float32, torch.float32, True),
        (torch.float16, torch.float16, False),  # fp32 from the kernel, the epilogue rounds
        (torch.bfloat16, torch.float32, False),  # an out of another dtype: made, then copied
    ],
)
def test_the_kernel_writes_into_out_where_its_result_is_the_calls(out_dtype, made, direct):
    """``cute_launch(..., out=t)`` (``fp4gen.gemm``'s ``out``: a layer graph's result tensor)
    passes t as the kernel's C where the kernel writes the call's result itself (its output
    dtype, no accumulate), so nothing is copied after it; else C is made as without ``out``."""
    from fp4gen.numerics import quantize

    g = torch.Generator().manual_seed(2)
    a = quantize(torch.randn(48, 256, generator=g), ROW)
    b = quantize(torch.randn(64, 256, generator=g), TILE)
    _on_cuda0(a, b)
    out = torch.empty((48, 64), dtype=made)
    launched: list = []
    with _cuda_stood_in(launched):
        _, args, product = fp8_gemm.cute_launch(a, b, out_dtype=out_dtype, out=out)
        _, acc_args, _ = fp8_gemm.cute_launch(
            a, b, out_dtype=out_dtype, out=out, accumulate=torch.zeros(48, 64)
        )
    assert (args[6] is out) == direct and (product.c is out) == direct
    assert args[6].shape == (48, 64) and args[6].is_contiguous()
    assert acc_args[6] is not out  # accumulate: the kernel's own fp32 copy
    # a contiguous out off the 16-byte alignment the kernel is compiled for: its own C
    shifted = torch.empty(48 * 64 + 1, dtype=made)[1:].view(48, 64)
    with _cuda_stood_in(launched):
        _, args, _ = fp8_gemm.cute_launch(a, b, out_dtype=out_dtype, out=shifted)
    assert args[6] is not shifted


def test_accumulate_is_a_copy_the_kernel_overwrites() -> None:
    from fp4gen.numerics import quantize

    g = torch.Generator().manual_seed(1)
    a = quantize(torch.randn(16, 256, generator=g), ROW)
    b = quantize(torch.randn(32, 256, generator=g), ROW)
    _on_cuda0(a, b)
    acc = torch.randn(16, 32, generator=g).to(torch.bfloat16)
    launched: list = []
    with _cuda_stood_in(launched):
        _, args, product = fp8_gemm.cute_launch(a, b, out_dtype=torch.bfloat16, accumulate=acc)
    c = args[6]
    assert c.dtype == torch.float32 and c.data_ptr() != acc.data_ptr()
    assert torch.equal(c, acc.float()) and product.accumulated
    assert launched[0].accumulate and launched[0].out == "fp32"  # the epilogue rounds once
    with _cuda_stood_in(launched), pytest.raises(fp4gen.errors.TensorError, match="bias"):
        fp8_gemm.cute_launch(a, b, bias=torch.zeros(5))


@pytest.mark.skipif(not CUTE_DSL, reason="needs the CuTe DSL (nvidia-cutlass-dsl)")
def test_kernel_is_cached_on_disk(tmp_path: Path, monkeypatch) -> None:
    """The first use compiles into the kernel cache; a new process (its memory cleared here)
    loads the shared library instead of compiling again."""
    from fp4gen.compiler.cache import KernelCache

    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_90a")
    monkeypatch.setattr(fp8_gemm, "_cute_compiled", {})
    params = fp8_gemm.cute_plan(ROW, TILE, torch.bfloat16, False, False).params
    cache = KernelCache(tmp_path / "cache")
    first = fp8_gemm.cute_kernel(params, cache)
    assert fp8_gemm._cute_loaded[params].compiled == 1 and callable(first)
    assert fp8_gemm.cute_kernel(params) is first  # kept in this process
    fp8_gemm._cute_compiled.clear()
    fp8_gemm.cute_kernel(params, cache)
    stats = fp8_gemm._cute_loaded[params]
    assert (stats.compiled, stats.loaded) == (0, 1)


def test_dispatch_and_support_do_not_import_the_cute_dsl() -> None:
    """The FP8 pair checks are pure logic: asking them loads no cutlass (a CPU-only install,
    and every dispatch, stay without it)."""
    code = (
        "import sys\n"
        "import fp4gen.gemm_dispatch as gd\n"
        "from fp4gen.formats import BUILTIN_FORMATS, BlockFormat, ScaleSpec\n"
        "from fp4gen.runtime import fp8_gemm\n"
        "e4m3 = BUILTIN_FORMATS['mxfp8_e4m3'].element\n"
        "row = BlockFormat('fp8_block', e4m3, (1, 128), ScaleSpec(None))\n"
        "tile = row.with_block((128, 128))\n"
        "assert fp8_gemm.cute_support(row, tile) is None\n"
        "c = gd.choose_backend(row, tile, 64, 64, 128, device='cuda', arch='sm_90a')\n"
        "assert c.backend == 'block_scaled', c\n"
        "assert 'cutlass' not in sys.modules, 'cutlass imported'\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
