"""The K-grouped block-scaled FP8 GEMM without a GPU (fp4gen.kernels.gemm_sm90_fp8_kgrouped,
fp4gen.runtime.fp8_kgrouped): the tile walk (every group's output once, each tile its group's
K range), the kernel's cross-compilation for sm_90a to FP8 wgmma, its parameters, the launch's
arguments as the kernel reads them, and the grouped experts' wgrad taking it only where it is
on (the default). On a GPU: tests/test_fp8_kgrouped_gpu.py."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest
import torch

from fp4gen.errors import FP4GenError, TensorError
from fp4gen.formats import BUILTIN_FORMATS, BlockFormat, ScaleSpec
from fp4gen.numerics import quantize
from fp4gen.runtime import fp8_grouped, fp8_kgrouped

CUTE_DSL = importlib.util.find_spec("cutlass") is not None
needs_dsl = pytest.mark.skipif(not CUTE_DSL, reason="needs the CuTe DSL (nvidia-cutlass-dsl)")

E4M3 = BUILTIN_FORMATS["mxfp8_e4m3"].element
MXFP8 = BUILTIN_FORMATS["mxfp8_e4m3"]
ROW = BlockFormat("fp8_block", E4M3, (1, 128), ScaleSpec(None))
TILE = ROW.with_block((128, 128))


@needs_dsl
@pytest.mark.parametrize(
    "ks, m, n", [([128, 0, 384, 256], 200, 300), ([1024], 128, 128), ([0, 0, 128], 129, 64)]
)
def test_the_tile_walk_covers_every_group_once(ks, m, n) -> None:
    """Every group has ceil(M / 128) x ceil(N / 128) tiles, in group order, each (row,
    column) of its C once, each tile with its group's K range."""
    from fp4gen.kernels.gemm_sm90_fp8_kgrouped import k_tile_walk

    koffs = fp8_grouped.offsets_of(ks)
    tiles = k_tile_walk(koffs, m, n)
    per_group = -(-m // 128) * -(-n // 128)
    assert len(tiles) == len(ks) * per_group
    assert [t[0] for t in tiles] == [g for g in range(len(ks)) for _ in range(per_group)]
    for g in range(len(ks)):
        mine = [t for t in tiles if t[0] == g]
        assert {(t[3], t[4]) for t in mine} == {(koffs[g], ks[g])}
        covered = {(r, c) for _, r0, c0, _, _ in mine for r in range(r0, min(r0 + 128, m))
                   for c in range(c0, min(c0 + 128, n))}  # fmt: skip
        assert len(covered) == m * n


def test_params_take_only_what_a_k_range_allows() -> None:
    from fp4gen.kernels.gemm_sm90_fp8 import GemmSm90Fp8Params

    base = dict(a_element="e4m3", b_element="e4m3", scale_kind="fp32", block_k=128,
                b_2d=False, out="bf16", bias=False, accumulate=False, k_grouped=True)  # fmt: skip
    assert GemmSm90Fp8Params(**base).name.endswith("_kgrouped_m128n128s6")
    coalesced = GemmSm90Fp8Params(**base, mn_major_scales=True, wide_stores=True)
    assert coalesced.name.endswith("_mn_ws_kgrouped_m128n128s6")
    for extra in (
        {"b_2d": True},
        {"bias": True},
        {"accumulate": True},
        {"overlap": True},
        {"cluster_m": 2},
        {"grouped": True},
    ):
        with pytest.raises(ValueError, match="k_grouped takes"):
            GemmSm90Fp8Params(**{**base, **extra})


def test_module_source_binds_k_grouped_only_where_set() -> None:
    """The other FP8 kernels' generated modules keep their text (their cache keys and the
    manifests' hashes); the K-grouped one binds its own compile."""
    from fp4gen.codegen.gemm_fp8 import module_source

    plan = fp8_kgrouped.k_grouped_plan(ROW, ROW, torch.float32)
    source = module_source(plan.params)
    assert "k_grouped=True" in source and "compile_k_grouped_fp8_gemm(PARAMS, arch" in source
    dense = fp8_kgrouped.fp8_gemm.cute_plan(ROW, TILE, torch.bfloat16, False, False).params
    assert "k_grouped" not in module_source(dense)


@needs_dsl
@pytest.mark.parametrize("coalesced", [True, False], ids=["coalesced", "row-major"])
def test_k_grouped_kernels_cross_compile_to_fp8_wgmma(
    tmp_path: Path, monkeypatch, coalesced: bool
) -> None:
    """The K-grouped variants compile for sm_90a: fp8_blockwise's wgrad pair (1x128 x 1x128,
    fp32 scales; bf16 and fp32 out) and MXFP8's (1x32, ue8m0). The PTX: FP8 wgmma, TMA of the
    codes, no local memory, no clusters; the coalesced variant copies the MN-major scales in
    16-byte chunks and stores whole sectors (bf16: 16-byte stores, fp32: 8-byte pairs), the
    row-major one copies a 4-byte scale per row and stores element by element."""
    from fp4gen.kernels.gemm_sm90_fp8 import compile_fp8_gemm
    from fp4gen.kernels.gemm_sm90_fp8_kgrouped import compile_k_grouped_fp8_gemm

    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_90a")
    monkeypatch.setattr(fp8_kgrouped, "_coalesced", [coalesced])
    for fmt, out in ((ROW, torch.bfloat16), (ROW, torch.float32), (MXFP8, torch.bfloat16)):
        params = fp8_kgrouped.k_grouped_plan(fmt, fmt, out).params
        with pytest.raises(ValueError, match="k_grouped"):
            compile_fp8_gemm(params, "sm_90a")
        dump = tmp_path / params.name
        compile_k_grouped_fp8_gemm(params, "sm_90a", dump_dir=str(dump))
        ptx = "\n".join(p.read_text() for p in dump.glob("*.ptx"))
        assert "GemmSm90Fp8KGrouped" in ptx
        wgmma = set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.(\S+?) ", ptx))
        assert wgmma == {"m64n128k32.f32.e4m3.e4m3"}, (params.name, wgmma)
        assert "cp.async.bulk.tensor.2d" in ptx
        assert ".local" not in ptx, f"{params.name} uses local memory"
        copies = re.findall(r"cp\.async\.ca\.shared\.global \[[^]]*\], \[[^]]*\], (\d+);", ptx)
        assert copies == (["16"] * 2 if coalesced else ["4"] * 8), (params.name, copies)
        assert "multicast::cluster" not in ptx
        wide = "st.global.v4" if out == torch.bfloat16 else "st.global.v2.f32"
        assert (wide in ptx) == coalesced, params.name


def groups_of(ks: list[int], m: int, n: int, fmt: BlockFormat = ROW, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    a = [None if k == 0 else quantize(torch.randn(m, k, generator=g), fmt) for k in ks]
    b = [None if k == 0 else quantize(torch.randn(n, k, generator=g), fmt) for k in ks]
    return a, b


@pytest.mark.parametrize("fmt", [ROW, MXFP8])
def test_launch_arguments(fmt) -> None:
    """Codes and scales of the groups side by side along K (ue8m0 codes padded to whole
    words), each group's S_dec, the K offsets, C [G x M, N] (the row-major variant)."""
    ks, m, n = [256, 0, 128, 384], 40, 24
    a, b = groups_of(ks, m, n, fmt)
    previous = fp8_kgrouped.set_k_grouped_coalesced(False)
    try:
        plan, args = fp8_kgrouped.k_grouped_launch(a, b, out_dtype=torch.bfloat16, sms=3)
    finally:
        fp8_kgrouped.set_k_grouped_coalesced(previous)
    assert plan.params.k_grouped and plan.kernel_out == torch.bfloat16
    assert not plan.params.mn_major_scales and not plan.params.wide_stores
    present = [(qa, qb) for qa, qb in zip(a, b, strict=True) if qa is not None]
    assert torch.equal(args[0], torch.cat([qa.codes for qa, _ in present], dim=1))
    assert torch.equal(args[2], torch.cat([qb.codes for _, qb in present], dim=1))
    if plan.ue8m0:
        kb = sum(ks) // 32
        assert args[1].shape == (m, -(-kb // 4) * 4) and args[1].dtype == torch.uint8
        assert torch.equal(args[1][:, :kb], torch.cat([qa.scale_codes for qa, _ in present], 1))
        assert not args[1][:, kb:].any()
    else:
        assert torch.equal(args[1], torch.cat([qa.scales for qa, _ in present], dim=1))
        assert torch.equal(args[3], torch.cat([qb.scales for _, qb in present], dim=1))
    want_a = [1.0 if q is None else float(q.global_scale) for q in a]
    assert args[4].tolist() == want_a
    assert args[6].tolist() == [0, 256, 256, 384, 768]
    assert args[7].shape == (len(ks) * m, n) and args[8] == 3


@pytest.mark.parametrize("fmt", [ROW, MXFP8])
def test_launch_arguments_of_the_coalesced_variant(fmt) -> None:
    """The default variant reads the groups' scales side by side MN-major: [KB, Rp], K-block
    kb's scales of all rows contiguous, Rp the rows rounded up to 16 (zeros past them); the
    other arguments as the row-major variant's."""
    ks, m, n = [256, 0, 128, 384], 40, 24
    a, b = groups_of(ks, m, n, fmt)
    plan, args = fp8_kgrouped.k_grouped_launch(a, b, out_dtype=torch.bfloat16, sms=3)
    assert plan.params.mn_major_scales and plan.params.wide_stores
    previous = fp8_kgrouped.set_k_grouped_coalesced(False)
    try:
        _, row_major = fp8_kgrouped.k_grouped_launch(a, b, out_dtype=torch.bfloat16, sms=3)
    finally:
        fp8_kgrouped.set_k_grouped_coalesced(previous)
    kb = sum(ks) // fmt.block[1]
    for i, rows in ((1, m), (3, n)):
        pitch = -(-rows // 16) * 16
        assert args[i].shape == (kb, pitch) and args[i].is_contiguous(), (i, args[i].shape)
        assert torch.equal(args[i][:, :rows], row_major[i][:, :kb].t()), i
        assert not args[i][:, rows:].any(), i
    for i in (0, 2, 4, 5, 6, 8):
        assert torch.equal(torch.as_tensor(args[i]), torch.as_tensor(row_major[i])), i


def test_groups_that_cannot_be_multiplied_say_why() -> None:
    a, b = groups_of([128, 256], 8, 16)
    with pytest.raises(TensorError, match="2 A groups and 1 B groups"):
        fp8_kgrouped.k_grouped_launch(a, b[:1])
    with pytest.raises(TensorError, match="every group is empty"):
        fp8_kgrouped.k_grouped_launch([None], [None])
    with pytest.raises(TensorError, match="group 1 has one operand only"):
        fp8_kgrouped.k_grouped_launch(a, [b[0], None])
    other, _ = groups_of([128], 4, 16, seed=2)
    with pytest.raises(TensorError, match=r"group 1 is \[4, 128\] x \[16, 256\]"):
        fp8_kgrouped.k_grouped_launch([a[0], other[0]], b)
    odd, odd_b = groups_of([128, 200], 8, 16, seed=3)
    with pytest.raises(FP4GenError, match=r"whole K-blocks of 128 per group; the groups' K"):
        fp8_kgrouped.k_grouped_launch(odd, odd_b)
    tiles = [quantize(torch.randn(16, 128), TILE)]
    with pytest.raises(FP4GenError, match="1xN blocks on both sides"):
        fp8_kgrouped.k_grouped_launch(a[:1], tiles)
    with pytest.raises(FP4GenError, match="runs on CUDA tensors"):
        fp8_kgrouped.k_grouped_block_scaled(a, b)


def test_the_switch() -> None:
    assert fp8_kgrouped.k_grouped_fp8_enabled()  # on: its GPU tests passed
    assert fp8_kgrouped.set_k_grouped_fp8(False) is True
    try:
        assert not fp8_kgrouped.k_grouped_fp8_enabled()
    finally:
        assert fp8_kgrouped.set_k_grouped_fp8(True) is False


def test_grouped_wgrad_takes_the_k_grouped_launch_only_where_on(monkeypatch) -> None:
    """The grouped experts' FP8 wgrad: each expert's dense GEMM with the switch off; with it on
    (and the pair served), one K-grouped launch of every expert's pair, in order."""
    from fp4gen.runtime import grouped

    a, b = groups_of([128, 256, 128], 8, 16)
    pairs = grouped._Pairs(a, b)
    dense, launches = [], []
    monkeypatch.setattr(
        grouped, "_dense_fp8", lambda x, y, dt, bias: dense.append((x, y)) or torch.zeros(8, 16)
    )
    monkeypatch.setattr(grouped, "fp8_grouped_reason", lambda *args: None)

    def k_grouped(x, y, out_dtype, **kw):
        launches.append((list(x), list(y), out_dtype))
        return torch.ones(3, 8, 16)

    monkeypatch.setattr(fp8_kgrouped, "k_grouped_block_scaled", k_grouped)
    monkeypatch.setattr(fp8_kgrouped, "_enabled", [False])
    got = grouped._fp8_wgrad(pairs, torch.float32, "experts")
    assert len(dense) == 3 and not launches and got.shape == (3, 8, 16) and not got.any()
    monkeypatch.setattr(fp8_kgrouped, "_enabled", [True])
    got = grouped._fp8_wgrad(pairs, torch.float32, "experts")
    assert len(dense) == 3 and len(launches) == 1 and got.all()
    assert launches[0][0] == a and launches[0][1] == b and launches[0][2] == torch.float32


def side_of(groups: list) -> object:
    """The groups' [rows, K_g] copies side by side as one [rows, sum K_g] QuantizedTensor (what
    a grouped tile launch's ``side`` holds)."""
    import dataclasses

    first = groups[0]
    return dataclasses.replace(
        first,
        codes=torch.cat([q.codes for q in groups], dim=1),
        scales=torch.cat([q.scales for q in groups], dim=1),
        scale_codes=None,
        packed=None,
        shape=torch.Size((first.shape[0], sum(q.shape[1] for q in groups))),
    )


def test_launch_arguments_from_the_launches_side_by_side_copies(monkeypatch) -> None:
    """Given each side's groups as a launch's side-by-side columnwise copy, their shapes known
    without building them and their S_dec as one vector, the arguments are those made from the
    groups, bit for bit, and no group is read."""
    from test_fp8_grouped import unread

    ks, m, n = [256, 128, 384], 40, 24
    a, b = groups_of(ks, m, n)
    scales = (torch.tensor([2.0, 0.5, 4.0]), torch.tensor([1.0, 8.0, 0.25]))
    for side, s in zip((a, b), scales, strict=True):
        for q, value in zip(side, s, strict=True):
            object.__setattr__(q, "global_scale", value.clone())
    _, want = fp8_kgrouped.k_grouped_launch(a, b, out_dtype=torch.bfloat16, sms=2)
    sides = (side_of(a), side_of(b))
    assert fp8_kgrouped._from_sides[0]  # on by default
    _, got = fp8_kgrouped.k_grouped_launch(
        unread(a), unread(b), out_dtype=torch.bfloat16, sms=2, sides=sides, global_scales=scales
    )
    for i in range(7):  # codes, scales, S_dec and K offsets of both sides; C is uninitialized
        assert got[i].dtype == want[i].dtype and torch.equal(got[i], want[i]), i
    assert got[7].shape == want[7].shape


def test_the_side_by_side_copies_serve_only_where_every_groups_shape_fits() -> None:
    """``_launched``: each group's K and [M, N] where both sides' groups fit one launch of
    the side-by-side copies; None where any group's rows differ on either side, B's K is not
    A's, a group is empty (the groups are then read one by one), or a copy is not the groups'
    [rows, sum K] side by side."""
    from test_fp8_grouped import unread

    ks, m, n = [256, 128, 384], 40, 24
    a, b = groups_of(ks, m, n)
    sides = (side_of(a), side_of(b))
    lazy_a, lazy_b = unread(a), unread(b)
    assert fp8_kgrouped._launched(lazy_a, lazy_b, sides)[1:] == (ks, (m, n))
    assert fp8_kgrouped._launched(lazy_a, lazy_b, (side_of(a[:2]), sides[1])) is None
    for side, i, shape in [(lazy_a, 1, (m - 8, 128)), (lazy_b, 2, (n - 8, 384)),
                           (lazy_b, 0, (n, 128)), (lazy_a, 2, None)]:  # fmt: skip
        kept = side.shapes[i]
        side.shapes[i] = shape
        assert fp8_kgrouped._launched(lazy_a, lazy_b, sides) is None, (i, shape)
        side.shapes[i] = kept


# ----------------------------------------------------------------------------------------------
# In an experts module, on the CPU: the launch's arguments against the loop's GEMMs
# ----------------------------------------------------------------------------------------------
def as_launched(out):
    """A definition's GroupedCopies as a launch hands them out: each group built on first read,
    the shapes known, with the definition's wholes, sides and S_dec."""
    from fp4gen.runtime.grouped_tile import GroupedCopies

    copies = len(next(g for g in out if g is not None))
    lazy = GroupedCopies(
        make_copy=lambda g, i: None if out[g] is None else out[g][i], count=len(out), copies=copies
    )
    lazy.shapes = [[None if g is None else tuple(g[i].shape) for g in out] for i in range(copies)]
    lazy.wholes, lazy.sides = out.wholes, out.sides
    lazy.global_scales = torch.stack(
        [
            torch.stack([q.global_scale.float() for q in g])
            if g is not None
            else torch.ones(copies)
            for g in out
        ]
    )
    return lazy


def groups_from_arguments(args: list, template_a, template_b, mn_major: bool) -> tuple[list, list]:
    """Each group's A and B as QuantizedTensors rebuilt from the K-grouped launch's arguments
    (its columns of the side-by-side codes and scales, its S_dec): what the kernel reads, the
    MN-major scales of the coalesced variant (``mn_major``) transposed back."""
    import dataclasses

    koffs = args[6].tolist()
    out = []
    for codes, scales, s_dec, template in (
        (args[0], args[1], args[4], template_a),
        (args[2], args[3], args[5], template_b),
    ):
        if mn_major:
            scales = scales[:, : codes.shape[0]].t()
        side = []
        for g in range(len(koffs) - 1):
            k0, k1 = koffs[g], koffs[g + 1]
            side.append(
                dataclasses.replace(
                    template,
                    codes=codes[:, k0:k1].contiguous(),
                    scales=scales[:, k0 // 128 : k1 // 128].contiguous(),
                    scale_codes=None,
                    packed=None,
                    global_scale=s_dec[g].reshape(()),
                    shape=torch.Size((codes.shape[0], k1 - k0)),
                )
            )
        out.append(side)
    return out[0], out[1]


@pytest.mark.parametrize("from_sides", [False, True])
@pytest.mark.parametrize("arch", ["mixtral", "gpt_oss"])
def test_experts_k_grouped_wgrad_is_the_loops_on_the_cpu(monkeypatch, arch, from_sides) -> None:
    """fp8_blockwise experts on the CPU, the grouped quantize by its definition (with the
    side-by-side copies a launch gives) and the K-grouped launch stood in by the loop's own
    GEMM on each group rebuilt from the launch's arguments: every gradient equals the loop's
    bit for bit, with the arguments made from the groups or (``from_sides``) the side-by-side
    copies as they are, reading no group."""
    from test_moe import routing, run
    from test_moe_grouped import pair
    from test_moe_grouped_tile import definition_standing_in

    import fp4gen.runtime.grouped_quantize as gq
    import fp4gen.runtime.grouped_tile as gt
    from fp4gen.runtime import grouped
    from fp4gen.runtime import linear as linear_module

    definition, _ = definition_standing_in(gt.reference_groups_tile)
    real_rows = gq.quantize_groups
    monkeypatch.setattr(grouped, "_serves", lambda t: True)
    monkeypatch.setattr(grouped, "_grouped_tile_quantize", [True])
    monkeypatch.setattr(
        gt, "quantize_groups_tile", lambda *a, **kw: as_launched(definition(*a, **kw))
    )
    monkeypatch.setattr(
        gq, "quantize_groups", lambda *a, **kw: real_rows(*a, **{**kw, "backend": "reference"})
    )
    monkeypatch.setattr(grouped, "fp8_grouped_reason", lambda *args: None)
    monkeypatch.setattr(fp8_kgrouped, "_from_sides", [from_sides])
    launches, looked = [], []
    first_group = grouped._first_group

    def recorded_first_group(operands):
        looked.append((first_group(operands), operands))
        return looked[-1][0]

    monkeypatch.setattr(grouped, "_first_group", recorded_first_group)

    def k_grouped(a, b, *, out_dtype, sides=(None, None), global_scales=(None, None), offsets=None):
        template_a = sides[0] if from_sides else a[0]
        template_b = sides[1] if from_sides else b[0]
        plan, args = fp8_kgrouped.k_grouped_launch(
            a, b, out_dtype=out_dtype, sides=sides, global_scales=global_scales, offsets=offsets
        )
        # the groups' K offsets are the routing's table, made once for every launch
        assert offsets is not None and args[6] is offsets[1]
        launches.append(getattr(a, "built", None))
        ga, gb = groups_from_arguments(args, template_a, template_b, plan.params.mn_major_scales)
        gemm = linear_module.gemm
        return torch.stack([gemm(x, y, out_dtype=out_dtype) for x, y in zip(ga, gb, strict=True)])

    monkeypatch.setattr(fp8_kgrouped, "k_grouped_block_scaled", k_grouped)
    loop, group = pair(arch, torch.bfloat16, "fp8_blockwise")
    index, weights = routing(40, empty=None)
    hidden = torch.randn(40, 64, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    want = run(loop, hidden, index, weights.to(torch.bfloat16))
    got = run(group, hidden, index, weights.to(torch.bfloat16))
    assert len(launches) == 2  # one K-grouped launch per projection
    # groups of the wgrad gradient built: none with the arguments from the side-by-side copies
    # (the dispatch's look at the pair reads that copy and the groups' shapes: _first_group),
    # every one from the groups
    assert launches == ([0, 0] if from_sides else [4, 4])
    # what the dispatch checks (fprop, dgrad, wgrad) read of each side's first group is what
    # building the group gives
    assert len(looked) == 12  # 3 GEMMs x 2 sides x 2 projections
    for first, operands in looked:
        built = operands[0]
        assert (first.format, first.rows, first.cols) == (built.format, built.rows, built.cols)
        assert first.device == built.device
    for a, b in zip(got[:3], want[:3], strict=True):
        assert torch.equal(a, b)
    for name, grad in want[3].items():
        assert torch.equal(got[3][name], grad), name


@pytest.mark.parametrize("coalesced", [True, False], ids=["coalesced", "row-major"])
def test_k_grouped_sides_launches_what_the_launch_builds(monkeypatch, coalesced: bool) -> None:
    """``k_grouped_sides`` (the static experts' wgrad: side-by-side copies, device sizes only)
    hands the kernel the arguments ``k_grouped_launch`` builds from the same copies, bit for
    bit, and returns C [G, M, N] in the asked dtype."""
    ks, m, n = [256, 128, 384], 40, 24
    a, b = groups_of(ks, m, n)
    scales = (torch.tensor([2.0, 0.5, 4.0]), torch.tensor([1.0, 8.0, 0.25]))
    offsets = torch.tensor([0, 256, 384, 768], dtype=torch.int32)
    sides = (side_of(a), side_of(b))
    monkeypatch.setattr(fp8_kgrouped, "_coalesced", [coalesced])
    _, want = fp8_kgrouped.k_grouped_launch(
        a, b, out_dtype=torch.float32, sms=7, sides=sides, global_scales=scales,
        offsets=(ks, offsets),
    )  # fmt: skip
    launched = []

    def kernel(params):
        assert params.k_grouped and params.mn_major_scales == coalesced
        return lambda *args: launched.append(args) or args[7].fill_(1.5)

    monkeypatch.setattr(fp8_kgrouped.fp8_gemm, "cute_kernel", kernel)
    monkeypatch.setattr(fp8_kgrouped, "grid_limit", lambda sms, dev: 7)
    got = fp8_kgrouped.k_grouped_sides(*sides, scales, offsets, len(ks), torch.bfloat16)
    assert got.shape == (len(ks), m, n) and got.dtype == torch.bfloat16 and (got == 1.5).all()
    (args,) = launched
    for i in (0, 1, 2, 3, 4, 5, 6, 8):
        assert torch.equal(torch.as_tensor(args[i]), torch.as_tensor(want[i])), i
    assert args[7].shape == want[7].shape
