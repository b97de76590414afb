"""The grouped block-scaled FP8 GEMM without a GPU (fp4gen.kernels.gemm_sm90_fp8_grouped,
fp4gen.runtime.fp8_grouped): the tile walk from the groups' offsets (every output element in
exactly one tile, no tile across two groups, empty groups without tiles), the kernel's
cross-compilation for sm_90a to FP8 wgmma, its parameters, and the launch's arguments as the
kernel reads them. On a GPU: tests/test_fp8_grouped_gpu.py."""

from __future__ import annotations

import dataclasses
import importlib.util
import re
from pathlib import Path
from typing import Any

import pytest
import torch

from fp4gen.errors import FP4GenError, TensorError
from fp4gen.formats import BUILTIN_FORMATS, BlockFormat, ScaleSpec
from fp4gen.numerics import quantize
from fp4gen.runtime import fp8_grouped

CUTE_DSL = importlib.util.find_spec("cutlass") is not None
needs_dsl = pytest.mark.skipif(not CUTE_DSL, reason="needs the CuTe DSL (nvidia-cutlass-dsl)")

E4M3 = BUILTIN_FORMATS["mxfp8_e4m3"].element
E5M2 = BUILTIN_FORMATS["mxfp8_e5m2"].element
MXFP8 = BUILTIN_FORMATS["mxfp8_e4m3"]
ROW = BlockFormat("fp8_block", E4M3, (1, 128), ScaleSpec(None))
TILE = ROW.with_block((128, 128))


def fp8(element, block: tuple[int, int]) -> BlockFormat:
    return BlockFormat("fp8_test", element, block, ScaleSpec(None))


# ----------------------------------------------------------------------------------------------
# The tile walk
# ----------------------------------------------------------------------------------------------
@needs_dsl
@pytest.mark.parametrize(
    "sizes, n, group_m",
    [
        ([0, 1, 300, 129, 0, 64], 200, 8),  # empty, tiny, unequal; N not a multiple of 128
        ([1000], 128, 8),
        ([0, 0, 0, 5], 384, 2),
        ([128 * 9 + 1, 0, 127], 1000, 8),  # more M-tiles than a raster group
    ],
)
def test_the_tile_walk_covers_every_output_once(sizes, n, group_m) -> None:
    """Every (row, column) of C in exactly one tile; a tile's rows start inside its group and
    are stored only up to the group's end; groups in order, each with ceil(M_g / 128) x
    ceil(N / 128) tiles (none for an empty group)."""
    from fp4gen.kernels.gemm_sm90_fp8_grouped import tile_walk

    offsets = fp8_grouped.offsets_of(sizes)
    tiles = tile_walk(offsets, n, group_m=group_m)
    n_tiles = -(-n // 128)
    assert len(tiles) == sum(-(-m // 128) * n_tiles for m in sizes)
    assert [t[0] for t in tiles] == sorted(t[0] for t in tiles)  # group-major
    covered = torch.zeros(offsets[-1], n, dtype=torch.int32)
    for g, row0, end, col0 in tiles:
        assert sizes[g] > 0 and offsets[g] <= row0 < offsets[g + 1] == end
        covered[row0 : min(row0 + 128, end), col0 : col0 + 128] += 1
    assert (covered == 1).all()


# ----------------------------------------------------------------------------------------------
# Parameters and cross-compilation
# ----------------------------------------------------------------------------------------------
@needs_dsl
def test_grouped_params_refuse_clusters_and_mn_major_scales() -> None:
    from fp4gen.kernels.gemm_sm90_fp8 import GemmSm90Fp8Kernel, GemmSm90Fp8Params
    from fp4gen.kernels.gemm_sm90_fp8_grouped import GemmSm90Fp8GroupedKernel

    base = dict(a_element="e4m3", b_element="e4m3", scale_kind="fp32", block_k=128, b_2d=True,
                out="bf16", bias=False, accumulate=False)  # fmt: skip
    params = GemmSm90Fp8Params(**base, grouped=True)
    assert params.name.endswith("_grouped_m128n128s6")
    for extra in ({"cluster_m": 2}, {"mn_major_scales": True}):
        with pytest.raises(ValueError, match="grouped takes cluster_m 1 and row-major scales"):
            GemmSm90Fp8Params(**base, grouped=True, **extra)
    # the dense class takes dense params only, the grouped class grouped ones
    with pytest.raises(ValueError, match="takes grouped=False"):
        GemmSm90Fp8Kernel(params)
    with pytest.raises(ValueError, match="takes grouped=True"):
        GemmSm90Fp8GroupedKernel(GemmSm90Fp8Params(**base))


def test_grouped_fields_are_the_dense_variant_without_clusters(monkeypatch) -> None:
    from fp4gen.runtime import fp8_gemm

    monkeypatch.setattr(fp8_gemm, "CUTE_CLUSTER_M", 2)
    monkeypatch.setattr(fp8_gemm, "CUTE_MN_MAJOR_SCALES", True)
    monkeypatch.setattr(fp8_gemm, "CUTE_WIDE_STORES", True)
    monkeypatch.setattr(fp8_gemm, "CUTE_OVERLAP", True)
    fields = fp8_grouped.grouped_fields(ROW, TILE, "bf16", True)
    assert fields["grouped"] and fields["cluster_m"] == 1 and not fields["mn_major_scales"]
    assert fields["wide_stores"] and fields["overlap"] and fields["bias"]
    assert not fields["accumulate"] and fields["b_2d"] and fields["block_k"] == 128


@needs_dsl
def test_grouped_kernels_cross_compile_to_fp8_wgmma(tmp_path: Path, monkeypatch) -> None:
    """The grouped variants compile for sm_90a (about 2 s each on two CPU cores): the
    fp8_blockwise fprop pair (bf16 out), e5m2 x e4m3 with ue8m0 scales, a bias and
    whole-sector stores (fp32 out), 1x128 B with overlap. The PTX: FP8 wgmma of the element
    pair, TMA of the codes, the 4-byte scale copies, the offsets read (the walk), no local
    memory."""
    from fp4gen.codegen.gemm_fp8 import module_source
    from fp4gen.kernels.gemm_sm90_fp8 import GemmSm90Fp8Params, compile_fp8_gemm
    from fp4gen.kernels.gemm_sm90_fp8_grouped import compile_grouped_fp8_gemm

    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_90a")
    cases = [
        ("e4m3", "e4m3", "fp32", 128, True, "bf16", False, False, False),
        ("e5m2", "e4m3", "ue8m0", 32, False, "fp32", True, True, False),
        ("e4m3", "e4m3", "fp32", 128, False, "bf16", False, False, True),
    ]
    for a_el, b_el, kind, block_k, b_2d, out, bias, wide, overlap in cases:
        params = GemmSm90Fp8Params(
            a_element=a_el, b_element=b_el, scale_kind=kind, block_k=block_k, b_2d=b_2d,
            out=out, bias=bias, accumulate=False, wide_stores=wide, overlap=overlap,
            grouped=True,
        )  # fmt: skip
        # the generated module (the kernel cache's source) binds the grouped compile
        assert "compile_grouped_fp8_gemm(PARAMS, arch" in module_source(params)
        with pytest.raises(ValueError, match="compile_grouped_fp8_gemm"):
            compile_fp8_gemm(params, "sm_90a")
        dump = tmp_path / params.name
        compile_grouped_fp8_gemm(params, "sm_90a", dump_dir=str(dump))
        ptx = "\n".join(p.read_text() for p in dump.glob("*.ptx"))
        assert "GemmSm90Fp8Grouped" in ptx  # the grouped class's kernel
        wgmma = set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.(\S+?) ", ptx))
        assert wgmma == {f"m64n128k32.f32.{a_el}.{b_el}"}, (params.name, wgmma)
        assert "cp.async.bulk.tensor.2d" in ptx  # TMA of the codes at the group's rows
        assert ".local" not in ptx, f"{params.name} uses local memory"
        copies = re.findall(r"cp\.async\.ca\.shared\.global \[[^]]*\], \[[^]]*\], (\d+);", ptx)
        assert copies == ["4"] * 8, (params.name, copies)
        assert "multicast::cluster" not in ptx
        assert ("st.global.v2.f32" in ptx) == wide


# ----------------------------------------------------------------------------------------------
# The launch's arguments (CPU tensors: the layouts, no launch)
# ----------------------------------------------------------------------------------------------
def joined(parts: list) -> object:
    """The groups' QuantizedTensors as one, rows after rows (what a grouped launch's ``whole``
    holds)."""
    first = parts[0]
    return dataclasses.replace(
        first,
        codes=torch.cat([q.codes for q in parts]),
        scales=torch.cat([q.scales for q in parts]),
        scale_codes=None
        if first.scale_codes is None
        else torch.cat([q.scale_codes for q in parts]),
        packed=None,
        shape=torch.Size((sum(q.rows for q in parts), first.cols)),
    )


@pytest.mark.parametrize("fa, fb", [(ROW, TILE), (MXFP8, MXFP8)])
def test_launch_arguments_from_the_groups_as_one(fa, fb) -> None:
    """Given each side's groups as one tensor (a grouped quantize's ``whole``) and their S_dec
    as one vector, the launch's arguments are those it builds from the groups, bit for bit;
    where a group is None or the rows differ, the groups' own are taken."""
    g = torch.Generator().manual_seed(1)
    sizes, n, k = [3, 140, 1], 256, 300
    a = [quantize(torch.randn(m, k, generator=g), fa) for m in sizes]
    b = [quantize(torch.randn(n, k, generator=g), fb) for _ in sizes]
    # each side's S_dec a column of a [groups, 2] table, as a dual-output grouped launch
    # gives them (strided): the launch passes unit-stride vectors, the kernel's rule
    table = torch.tensor([[2.0, 1.0], [0.5, 8.0], [4.0, 0.25]])
    scales = (table[:, 0], table[:, 1])
    for side, s in zip((a, b), scales, strict=True):
        for q, value in zip(side, s, strict=True):
            object.__setattr__(q, "global_scale", value.clone())
    _, want = fp8_grouped.grouped_launch(a, b, out_dtype=torch.bfloat16, sms=4)
    _, got = fp8_grouped.grouped_launch(
        a, b, out_dtype=torch.bfloat16, sms=4, wholes=(joined(a), joined(b)), global_scales=scales
    )
    for i in range(7):  # codes, scales, S_dec and offsets of both sides; C is uninitialized
        assert got[i].dtype == want[i].dtype and torch.equal(got[i], want[i]), i
        assert got[i].is_contiguous(), i
    # a whole whose rows are not the groups' is not taken
    _, other = fp8_grouped.grouped_launch(a, b, sms=4, wholes=(joined(a[:2]), None))
    assert torch.equal(other[0], want[0])
    # groups of one launch each (their shapes known, built only when read): none is read
    lazy = [unread(side) for side in (a, b)]
    _, from_launch = fp8_grouped.grouped_launch(
        *lazy, out_dtype=torch.bfloat16, sms=4, wholes=(joined(a), joined(b)), global_scales=scales
    )
    for i in range(7):
        assert torch.equal(from_launch[i], want[i]), i


def unread(groups: list) -> Any:
    """``groups`` as a grouped launch hands them out, each entry failing when read."""
    from fp4gen.runtime.grouped_quantize import GroupedOperands

    def fail(g: int) -> None:
        raise AssertionError(f"group {g} was read")

    lazy = GroupedOperands(make=fail, count=len(groups))
    lazy.shapes = [tuple(q.shape) for q in groups]
    return lazy


@pytest.mark.parametrize(
    "fa, fb", [(ROW, TILE), (ROW, ROW), (MXFP8, MXFP8), (fp8(E5M2, (1, 64)), fp8(E4M3, (64, 64)))]
)
def test_launch_arguments(fa, fb) -> None:
    g = torch.Generator().manual_seed(0)
    sizes, n, k = [3, 0, 140, 1], 200, 300  # an empty group; K not whole blocks
    # an empty group's A is None (no rows to quantize), as the grouped quantize gives it
    a = [quantize(torch.randn(m, k, generator=g), fa) if m else None for m in sizes]
    b = [quantize(torch.randn(n, k, generator=g), fb) for _ in sizes]
    bias = torch.randn(len(sizes), n, generator=g).to(torch.bfloat16)
    plan, args = fp8_grouped.grouped_launch(a, b, out_dtype=torch.bfloat16, bias=bias, sms=132)
    codes_a, sf_a, codes_b, sf_b, ga, gb, offsets, c, bias_arg, sms = args
    block_k = fa.block[1]
    kp, kb = -(-k // block_k) * block_k, -(-k // block_k)
    m = sum(sizes)
    assert plan.params.grouped and plan.params.bias and plan.params.b_2d == fb.is_2d
    assert offsets.dtype == torch.int32 and offsets.tolist() == [0, 3, 3, 143, 144]
    assert codes_a.shape == (m, kp) and codes_b.shape == (len(sizes) * n, kp)
    assert codes_a.dtype == codes_b.dtype == torch.uint8
    assert torch.equal(codes_a[:, :k], torch.cat([q.codes for q in a if q is not None]))
    assert torch.equal(codes_b[:, :k], torch.cat([q.codes for q in b]))
    assert not codes_a[:, k:].any() and not codes_b[:, k:].any()  # zero codes add exactly 0
    b_rows = -(-n // block_k) if fb.is_2d else n  # scale rows per group
    if plan.ue8m0:  # codes, each row padded to whole 4-byte words
        kb4 = -(-kb // 4) * 4
        assert sf_a.dtype == torch.uint8 and sf_a.shape == (m, kb4)
        assert sf_b.shape == (len(sizes) * b_rows, kb4)
        assert torch.equal(sf_a[:, :kb], torch.cat([q.scale_codes for q in a if q is not None]))
        assert torch.equal(sf_b[:, :kb], torch.cat([q.scale_codes for q in b]))
    else:  # fp32 factors, as the quantize kernels write them, stacked
        assert torch.equal(sf_a, torch.cat([q.scales for q in a if q is not None]))
        assert sf_b.shape == (len(sizes) * b_rows, kb)
        assert torch.equal(sf_b, torch.cat([q.scales for q in b]))
    assert ga.shape == gb.shape == (len(sizes),) and ga.dtype == torch.float32
    assert ga[1] == 1.0 and torch.equal(gb, torch.cat([q.global_scale.reshape(1) for q in b]))
    assert torch.equal(
        ga[[0, 2, 3]], torch.cat([q.global_scale.reshape(1) for q in a if q is not None])
    )
    assert c.shape == (m, n) and c.dtype == torch.bfloat16  # bf16 straight from the kernel
    assert bias_arg.shape == (len(sizes) * n,) and bias_arg.dtype == torch.float32
    assert torch.equal(bias_arg.reshape(len(sizes), n), bias.float())
    assert sms == 132
    # an fp16 output: the kernel writes fp32, rounded once on the host
    plan, args = fp8_grouped.grouped_launch(a, b, out_dtype=torch.float16, sms=1)
    assert args[7].dtype == torch.float32 and not plan.params.bias and len(args) == 9


def test_groups_that_cannot_be_multiplied_say_why() -> None:
    g = torch.Generator().manual_seed(1)
    a = [quantize(torch.randn(4, 256, generator=g), ROW) for _ in range(2)]
    b = [quantize(torch.randn(64, 256, generator=g), TILE) for _ in range(2)]
    with pytest.raises(TensorError, match="2 A groups and 1 B groups"):
        fp8_grouped.grouped_launch(a, b[:1])
    with pytest.raises(TensorError, match="at least one"):
        fp8_grouped.grouped_launch([], [])
    with pytest.raises(TensorError, match="every group is empty"):
        fp8_grouped.grouped_launch([None], [b[0]])
    with pytest.raises(TensorError, match=r"B\[1\] is None, A\[1\] is not"):
        fp8_grouped.grouped_launch(a, [b[0], None])
    other = quantize(torch.randn(32, 256, generator=g), TILE)
    with pytest.raises(TensorError, match=r"B\[1\] is \[32, 256\], B\[0\] \[64, 256\]"):
        fp8_grouped.grouped_launch(a, [b[0], other])
    short = quantize(torch.randn(4, 128, generator=g), ROW)
    with pytest.raises(TensorError, match=r"A\[1\] is \[4, 128\], B's K is 256"):
        fp8_grouped.grouped_launch([a[0], short], b)
    mixed = quantize(torch.randn(4, 256, generator=g), MXFP8)
    with pytest.raises(TensorError, match="one format per operand"):
        fp8_grouped.grouped_launch([a[0], mixed], b)
    with pytest.raises(TensorError, match=r"the bias must be \[groups, N\] = \[2, 64\]"):
        fp8_grouped.grouped_launch(a, b, bias=torch.zeros(64))
    nvfp4 = [quantize(torch.randn(4, 256, generator=g), "nvfp4") for _ in range(2)]
    with pytest.raises(FP4GenError, match="does not serve this pair: .*e2m1"):
        fp8_grouped.grouped_launch(nvfp4, nvfp4)
    with pytest.raises(FP4GenError, match="runs on CUDA tensors"):
        fp8_grouped.grouped_block_scaled(a, b)


def test_the_switch() -> None:
    assert fp8_grouped.grouped_fp8_enabled()  # on: its GPU tests passed
    assert fp8_grouped.set_grouped_fp8(False) is True
    try:
        assert not fp8_grouped.grouped_fp8_enabled()
    finally:
        assert fp8_grouped.set_grouped_fp8(True) is False


@needs_dsl
def test_grouped_kernel_is_cached_on_disk(tmp_path: Path, monkeypatch) -> None:
    """The grouped kernel goes through the kernel cache as the dense ones do (its generated
    module binds compile_grouped_fp8_gemm): compiled on first use, loaded after."""
    from fp4gen.compiler.cache import KernelCache
    from fp4gen.runtime import fp8_gemm

    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_90a")
    monkeypatch.setattr(fp8_gemm, "_cute_compiled", {})
    params = fp8_grouped.grouped_plan(ROW, TILE, torch.bfloat16, True).params
    assert params.grouped and params.bias
    cache = KernelCache(tmp_path / "cache")
    assert callable(fp8_gemm.cute_kernel(params, cache))
    assert fp8_gemm._cute_loaded[params].compiled == 1
    fp8_gemm._cute_compiled.clear()
    fp8_gemm.cute_kernel(params, cache)
    stats = fp8_gemm._cute_loaded[params]
    assert (stats.compiled, stats.loaded) == (0, 1)


def test_a_launch_takes_the_wholes_only_where_every_groups_shape_fits() -> None:
    """``_launched`` (the check that lets a launch read each side's whole, no group): the rows
    of A's groups and B's [N, K] where every shape fits one launch; None where any group's
    shape differs (a B of other rows or K, an A of other K) or a group is empty."""
    g = torch.Generator().manual_seed(2)
    sizes, n, k = [3, 140, 1], 256, 256
    a = [quantize(torch.randn(m, k, generator=g), ROW) for m in sizes]
    b = [quantize(torch.randn(n, k, generator=g), TILE) for _ in sizes]
    wholes = (joined(a), joined(b))
    lazy_a, lazy_b = unread(a), unread(b)
    launched = fp8_grouped._launched(lazy_a, lazy_b, None, wholes)
    assert launched is not None and launched[1] == sizes and launched[2] == (n, k)
    for side, i, shape in [(lazy_b, 1, (n - 128, k)), (lazy_b, 2, (n, k - 128)),
                           (lazy_a, 0, (3, k - 128)), (lazy_a, 1, None)]:  # fmt: skip
        kept = side.shapes[i]
        side.shapes[i] = shape
        assert fp8_grouped._launched(lazy_a, lazy_b, None, wholes) is None, (i, shape)
        side.shapes[i] = kept
