"""The grouped (Mixture-of-Experts) block-scaled GEMM on sm_100a (fp4gen.runtime.blackwell_grouped).

CPU (CI) checks:
  * the batch layout bit for bit: each group's packed codes and per-row scale codes in its
    corner of the zero-padded batch, the batched scale buffer against the per-group 128x4
    layout (``swizzle_scales``), an independent offset formula and the kernel's own layout
    function ``tile_atom_to_shape_SF((M, K, L))`` evaluated while tracing; decoded back from
    the bytes, the batch holds exactly each group's block values and zeros elsewhere;
  * which groups the kernel takes (``grouped_reason``) and the arguments against the compiled
    signature;
  * cross-compilation for sm_100a of the batched kernel for every hardware pair the grouped
    experts use and every shipped recipe whose experts run grouped, the PTX read back as the
    dense kernel's is (``tcgen05.mma ... block_scale``, the kind, the instruction descriptor's
    formats and scale type, the alpha load, no local memory, no ptxas spills);
  * the kernel cache; the grouped path's wiring (``fp4gen.runtime.grouped._native``).

GPU (sm_100 only, skipped elsewhere): the grouped kernel against each group's ``gemm_reference``
(exact and within the dense test's bound), and the grouped experts' products on the kernel within
the fp32 summation bound of each group's float64 product.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

# plain helpers of the dense GEMM's tests (no fixtures)
from test_gemm_sm100 import (  # noqa: E402
    NOT_HARDWARE,
    ON_SM100,
    bound,
    check_ptx,
    check_ptxas,
    dyadic_operand,
    ptx_compiler,
    reference_pack,
    reference_scale_offset,
)

import fp4gen.runtime.blackwell_grouped as bg
import fp4gen.runtime.grouped as grouped
from fp4gen.codegen.gemm_configs import (
    GROUPED_KERNEL,
    MmaPlan,
    gemm_config,
    mma_plan,
    render_grouped_module,
    render_module,
)
from fp4gen.dsl import load_recipe
from fp4gen.errors import FP4GenError
from fp4gen.formats import BUILTIN_FORMATS, BlockFormat, ScaleSpec
from fp4gen.numerics import gemm_reference, quantize
from fp4gen.numerics.layout import swizzle_scales, unpack, unswizzle_scales
from fp4gen.numerics.minifloat import decode

ROOT = Path(__file__).resolve().parent.parent
F = BUILTIN_FORMATS
NVFP4, MXFP4 = F["nvfp4"], F["mxfp4"]
E4M3, E5M2, E2M3 = F["mxfp8_e4m3"], F["mxfp8_e5m2"], F["mxfp6_e2m3"]
pytestmark = [
    pytest.mark.filterwarnings("ignore:Migrated to examples:DeprecationWarning"),
    pytest.mark.filterwarnings("ignore:FastDivmodDivisor is deprecated:DeprecationWarning"),
]


def groups_of(fmt, rows: list[int], k: list[int] | int, *, block=None, seed=0) -> list:
    """QuantizedTensors [rows[g], K_g] of random values over a wide range of row magnitudes."""
    g = torch.Generator().manual_seed(seed)
    ks = k if isinstance(k, list) else [k] * len(rows)
    out = []
    for r, kk in zip(rows, ks, strict=True):
        x = torch.randn(r, kk, generator=g)
        x = x * torch.exp2(torch.randint(-6, 7, (r, 1), generator=g).float())
        out.append(quantize(x, fmt, block=block))
    return out


# ----------------------------------------------------------------------------------------------
# The batch layout, bit for bit
# ----------------------------------------------------------------------------------------------
def test_batched_scales_are_each_groups_tensor_core_layout() -> None:
    """Group g's buffer starts at g * ceil(R/128) * ceil(C/4) * 512 and is the 128x4 layout of
    its [R, C] scale codes: against ``swizzle_scales`` and the cuBLAS offset formula."""
    gen = torch.Generator().manual_seed(3)
    scales = torch.randint(0, 256, (3, 200, 7), generator=gen, dtype=torch.uint8)
    buf = bg.batched_scales(scales)
    per_group = 2 * 128 * 2 * 4  # ceil(200/128) row atoms x ceil(7/4) column atoms x 512
    assert buf.shape == (3 * per_group,)
    assert torch.equal(buf, torch.cat([swizzle_scales(s) for s in scales]))
    for g in range(3):
        for r in (0, 31, 32, 127, 128, 199):
            for c in range(7):
                offset = g * per_group + reference_scale_offset(r, c, 7)
                assert buf[offset] == scales[g, r, c]


@pytest.fixture(scope="module")
def kernel_offsets() -> dict[str, dict[tuple[int, ...], list[int]]]:
    """The package kernel's batched layouts evaluated for static shapes while tracing: the scale
    factors' ``tile_atom_to_shape_SF((M, K, L), vec)`` (offset of the scale of element
    (m, k, l)) and the K-major A / row-major C layouts its ``__call__`` builds
    (``make_ordered_layout((m, k, l), order=(1, 0, 2))``)."""
    import cutlass.cute as cute
    import cutlass.utils.blockscaled_layout as blockscaled

    sf_shapes = [(130, 96, 3, 32), (200, 160, 2, 16)]
    dense_shapes = [(40, 64, 3)]
    out: dict[str, dict[tuple[int, ...], list[int]]] = {"sf": {}, "dense": {}}

    def sf_offsets(layout, m: int, k: int, batches: int, vec: int) -> list[int]:
        cols = -(-k // vec)
        return [
            int(cute.crd2idx((r, c * vec, g), layout))
            for g in range(batches)
            for r in range(m)
            for c in range(cols)
        ]

    def dense_offsets(layout, rows: int, cols: int, batches: int) -> list[int]:
        return [
            int(cute.crd2idx((r, c, g), layout))
            for g in range(batches)
            for r in range(rows)
            for c in range(cols)
        ]

    @cute.jit
    def probe():
        for m, k, batches, vec in sf_shapes:
            layout = blockscaled.tile_atom_to_shape_SF((m, k, batches), vec)
            out["sf"][(m, k, batches, vec)] = sf_offsets(layout, m, k, batches, vec)
        for rows, cols, batches in dense_shapes:
            layout = cute.make_ordered_layout((rows, cols, batches), order=(1, 0, 2))
            out["dense"][(rows, cols, batches)] = dense_offsets(layout, rows, cols, batches)

    cute.compile(probe)
    return out


@pytest.mark.parametrize("shape", [(130, 96, 3, 32), (200, 160, 2, 16)])
def test_batched_scales_match_the_kernels_layout_function(shape, kernel_offsets) -> None:
    m, k, batches, vec = shape
    cols = -(-k // vec)
    gen = torch.Generator().manual_seed(m)
    scales = torch.randint(0, 256, (batches, m, cols), generator=gen, dtype=torch.uint8)
    offsets = torch.tensor(kernel_offsets["sf"][shape])
    assert offsets.unique().numel() == offsets.numel()
    assert torch.equal(bg.batched_scales(scales)[offsets], scales.reshape(-1))


def test_codes_and_output_are_contiguous_batches_for_the_kernel(kernel_offsets) -> None:
    """A [L, M, K] (K-major) and C [L, M, N] (row-major) as the kernel lays them out: torch's
    contiguous [L, rows, cols] offsets."""
    offsets = kernel_offsets["dense"][(40, 64, 3)]
    assert offsets == list(range(40 * 64 * 3))  # (g, r, c) visited in contiguous order


CASES = {  # (A format, A block, B format, B block, A rows, B rows, K per group)
    "nvfp4_fprop": (NVFP4, None, NVFP4, None, [37, 1, 130], 64, 96),
    "nvfp4_2d_weights": (NVFP4, None, NVFP4, (16, 16), [5, 300], 48, 160),
    "nvfp4_wgrad_unequal_k": (NVFP4, None, NVFP4, None, [64, 64, 64], 40, [32, 96, 16]),
    "nvfp4_k_padded": (NVFP4, None, NVFP4, None, [3, 9], 8, 48),  # K 48 -> 64 in the batch
    "mxfp4": (MXFP4, None, MXFP4, None, [129, 3], 36, 64),
    "mxfp8": (E4M3, None, E4M3, None, [17, 70], 20, 64),
    "mxfp8_x_mxfp6": (E4M3, None, E2M3, None, [9, 2], 8, 128),
}


def case_groups(name: str) -> tuple[list, list]:
    a_fmt, a_block, b_fmt, b_block, a_rows, b_rows, k = CASES[name]
    a = groups_of(a_fmt, a_rows, k, block=a_block, seed=1)
    b = groups_of(b_fmt, [b_rows] * len(a_rows), k, block=b_block, seed=2)
    return a, b


def decode_batch(
    codes: torch.Tensor, scales: torch.Tensor, fmt: BlockFormat, bits: int, k: int
) -> torch.Tensor:
    """Block values [L, rows, K] read back from the batch's bytes: codes unpacked from the bit
    stream, scales from each group's 128x4 buffer, element x block scale."""
    batches, rows, _ = codes.shape
    vec = fmt.block[1]
    cols = -(-k // vec)
    values = decode(unpack(codes.reshape(batches * rows, -1), bits, k), fmt.element)
    per_group = scales.reshape(batches, -1)
    sc = torch.stack([unswizzle_scales(buf, rows, cols) for buf in per_group])
    sv = decode(sc, fmt.scale.element).repeat_interleave(vec, -1)[..., :k]
    return values.reshape(batches, rows, k) * sv


@pytest.mark.parametrize("name", sorted(CASES))
def test_the_batch_holds_each_groups_codes_and_scales(name: str) -> None:
    a_groups, b_groups = case_groups(name)
    plan = bg.grouped_reason(a_groups, b_groups)
    assert isinstance(plan, MmaPlan), plan
    batches, m, n, k = bg.batch_shape(a_groups, b_groups, plan)
    assert (batches, m, n) == (len(a_groups), max(q.rows for q in a_groups), b_groups[0].rows)
    assert k % plan.k_multiple == 0 and k >= max(q.cols for q in a_groups)
    for groups, rows, bits in ((a_groups, m, plan.a_bits), (b_groups, n, plan.b_bits)):
        codes, scales = bg.batched_operand(groups, bits, rows, k, torch.device("cpu"))
        assert codes.shape == (batches, rows, k * bits // 8) and codes.dtype == torch.uint8
        vec = groups[0].format.block[1]
        per_group = scales.reshape(batches, -1)
        for g, q in enumerate(groups):
            width = q.cols * bits // 8
            assert torch.equal(codes[g, : q.rows, :width], reference_pack(q.codes, bits))
            assert not codes[g, q.rows :].any() and not codes[g, :, width:].any()
            sc = unswizzle_scales(per_group[g], rows, -(-k // vec))
            block_rows = min(q.format.block[0], q.rows)
            want = q.scale_codes.repeat_interleave(block_rows, 0)[: q.rows]
            assert torch.equal(sc[: q.rows, : want.shape[1]], want)
            assert not sc[q.rows :].any() and not sc[:, want.shape[1] :].any()
        # decoded from the bytes: each group's block values, zeros around them
        values = decode_batch(codes, scales, groups[0].format, bits, k)
        for g, q in enumerate(groups):
            assert torch.equal(values[g, : q.rows, : q.cols], q.dequantize_blockwise())
            assert not values[g, q.rows :].any() and not values[g, :, q.cols :].any()


def test_grouped_args_match_the_compiled_signature() -> None:
    """What ``compile_grouped_gemm`` declares: uint8 codes [L, M, K * bits / 8] and
    [L, N, K * bits / 8] (16-byte rows, 16-byte aligned), scale buffers of whole 512-byte atoms
    (32-byte aligned), C [L, M, N], alpha fp32 [1] = 1."""
    a_groups, b_groups = case_groups("nvfp4_wgrad_unequal_k")
    plan = bg.grouped_reason(a_groups, b_groups)
    assert isinstance(plan, MmaPlan)
    out = torch.empty(3, 64, 40)
    a_codes, b_codes, sfa, sfb, c, alpha = bg.grouped_args(a_groups, b_groups, plan, out)
    assert c is out and alpha.dtype == torch.float32 and alpha.tolist() == [1.0]
    assert a_codes.shape == (3, 64, 48) and b_codes.shape == (3, 40, 48)  # K 96 -> 48 bytes
    for codes in (a_codes, b_codes):
        assert codes.is_contiguous() and codes.shape[2] % 16 == 0 and codes.data_ptr() % 16 == 0
    for buf in (sfa, sfb):
        assert buf.dim() == 1 and buf.numel() % 512 == 0 and buf.data_ptr() % 32 == 0
    assert sfa.numel() == 3 * 1 * 2 * 512  # per group: 1 row atom x ceil(6/4) column atoms


@pytest.mark.parametrize(
    ("change", "why"),
    [
        ("formats", "not all in one format per side"),
        ("n", "B operands' rows (N) differ"),
        ("fp32_scales", "fp32 block scales"),
        ("odd_n", "N = 6 is not a multiple of 4"),
        ("count", "2 A groups and 1 B groups"),
    ],
)
def test_grouped_reason_says_why_not(change: str, why: str) -> None:
    a_groups, b_groups = groups_of(NVFP4, [4, 8], 64), groups_of(NVFP4, [16, 16], 64)
    if change == "formats":
        a_groups[1] = groups_of(MXFP4, [8], 64)[0]
    elif change == "n":
        b_groups[1] = groups_of(NVFP4, [20], 64)[0]
    elif change == "fp32_scales":
        fp8_block = BlockFormat("fp8_block", E4M3.element, (1, 128), ScaleSpec(None))
        a_groups = groups_of(fp8_block, [4, 8], 128)
        b_groups = groups_of(fp8_block, [16, 16], 128)
    elif change == "odd_n":
        b_groups = groups_of(NVFP4, [6, 6], 64)
    else:
        b_groups = b_groups[:1]
    reason = bg.grouped_reason(a_groups, b_groups)
    assert isinstance(reason, str) and why in reason, reason
    with pytest.raises(FP4GenError, match="cannot take these groups"):
        bg.grouped_product(a_groups, b_groups, arch="sm_100a")


def test_grouped_product_refuses_other_archs() -> None:
    a_groups, b_groups = case_groups("mxfp8")
    with pytest.raises(FP4GenError, match="no block-scaled tcgen05 MMA on sm_90a"):
        bg.grouped_product(a_groups, b_groups, arch="sm_90a")


# ----------------------------------------------------------------------------------------------
# Cross-compilation for sm_100a and the PTX
# ----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def compiled_grouped(tmp_path_factory: pytest.TempPathFactory):
    """config -> (PTX without comments, path of the dumped .ptx), compiled once per session."""
    from fp4gen.runtime.blackwell_grouped_kernel import compile_grouped_gemm

    return ptx_compiler(compile_grouped_gemm, tmp_path_factory.mktemp("sm100_grouped_ptx"))


COMPILE_CASES = {  # name -> (A format, B format, M (picks the tile))
    "nvfp4": (NVFP4, NVFP4, 16),
    "nvfp4_2cta": (NVFP4, NVFP4, 4096),
    "mxfp4": (MXFP4, MXFP4, 4096),
    "mxfp8_e4m3": (E4M3, E4M3, 16),
    "mxfp8_e4m3_x_e5m2": (E4M3, E5M2, 4096),
    "mxfp8_x_mxfp6_e2m3": (E4M3, E2M3, 16),
}


@pytest.mark.parametrize("name", sorted(COMPILE_CASES))
def test_grouped_kernel_cross_compiles_for_sm100a(name: str, compiled_grouped) -> None:
    a, b, m = COMPILE_CASES[name]
    plan = mma_plan(a, b)
    assert isinstance(plan, MmaPlan)
    config = gemm_config(plan, m)
    ptx, path = compiled_grouped(config)
    check_ptx(ptx, plan, config)  # the dense kernel's checks: the same body, batched
    check_ptxas(path)


def test_every_grouped_recipe_cross_compiles_for_sm100a(compiled_grouped) -> None:
    """The shipped recipes whose experts run grouped (``grouped.pass_reason`` None): each of
    their three GEMMs has a native MMA, whose grouped kernel compiles for both tiles, or is not
    a hardware format (1x8 blocks, fp32 block scales: the product of other GPUs)."""
    served, native = set(), set()
    for path in sorted((ROOT / "fp4gen" / "recipes").glob("*.fp4r")):
        table = load_recipe(path).operands
        if grouped.pass_reason(table) is not None:
            continue
        served.add(path.stem)
        pairs = {
            (table.fprop_activation.format, table.fprop_weight.format),
            (table.dgrad_gradient.format, table.dgrad_weight.format),
            (table.wgrad_gradient.format, table.wgrad_activation.format),
        }
        for a, b in pairs:
            plan = mma_plan(a, b)
            if isinstance(plan, str):  # grouped on its other product (logged once)
                assert any(r in plan for r in NOT_HARDWARE), (path.stem, plan)
                continue
            native.add(path.stem)
            for m in (16, 4096):
                config = gemm_config(plan, m)
                ptx, _ = compiled_grouped(config)
                check_ptx(ptx, plan, config)
    assert native >= {"nvfp4", "mxfp4", "mxfp8", "nvfp4_small"}
    assert "exotic_e3m2_b8" in served - native


def test_grouped_kernel_cache_compiles_once_then_loads(tmp_path: Path) -> None:
    from fp4gen.compiler import jit
    from fp4gen.compiler.cache import KernelCache

    plan = mma_plan(NVFP4, NVFP4)
    assert isinstance(plan, MmaPlan)
    config = gemm_config(plan, 16)
    source = render_grouped_module(config)
    assert source != render_module(config)  # its own cache entry
    assert f'KERNELS = ("{GROUPED_KERNEL}",)' in source and config.name in source
    cache = KernelCache(tmp_path)
    fn = bg.grouped_kernel(config, "sm_100a", cache=cache)
    assert callable(fn) and bg.grouped_kernel(config, "sm_100a", cache=cache) is fn
    again = jit.build_kernel(cache, cache.store_source(source), GROUPED_KERNEL, "sm_100a")
    assert not again.built and again.entry.meta["artifact"] in ("kernel.so", "kernel.o")


def test_rendered_grouped_module_names_both_wrappers() -> None:
    import hashlib

    plan = mma_plan(MXFP4, MXFP4)
    assert isinstance(plan, MmaPlan)
    config = gemm_config(plan, 1000)
    source = render_grouped_module(config)
    namespace: dict[str, object] = {}
    exec(compile(source, "generated", "exec"), namespace)
    assert namespace["CONFIG"] == config
    for name in ("blackwell_kernel.py", "blackwell_grouped_kernel.py"):
        text = (ROOT / "fp4gen" / "runtime" / name).read_bytes()
        assert f"source digest {hashlib.sha256(text).hexdigest()[:16]}" in source


# ----------------------------------------------------------------------------------------------
# The grouped path's wiring
# ----------------------------------------------------------------------------------------------
class CudaStandIn:
    """A QuantizedTensor stand-in that says it lives on a CUDA device (no GPU here)."""

    device = torch.device("cuda", 0)
    rows = 3


def test_native_products_only_on_sm100(monkeypatch, caplog) -> None:
    import fp4gen.compiler.jit as jit

    cpu = case_groups("mxfp8")
    assert bg.native_products(list(zip(*cpu, strict=True)), by_rows=True) is None
    assert bg.native_products([], by_rows=True) is None
    pairs = [(CudaStandIn(), CudaStandIn()), (CudaStandIn(), CudaStandIn())]
    monkeypatch.setattr(jit, "detect_arch", lambda device=None: "sm_90a")
    assert bg.native_products(pairs, by_rows=True) is None
    monkeypatch.setattr(jit, "detect_arch", lambda device=None: "sm_100a")
    # the kernel's product [L, M, N] (M the largest group's rows): the groups' rows taken out
    c = torch.arange(2 * 4 * 2, dtype=torch.float32).reshape(2, 4, 2)
    monkeypatch.setattr(bg, "grouped_product", lambda a, b, arch: c)
    assert torch.equal(bg.native_products(pairs, by_rows=False), c)
    assert torch.equal(bg.native_products(pairs, by_rows=True), torch.cat([c[0, :3], c[1, :3]]))
    assert bg.set_native_grouped(False) is True
    try:
        assert bg.native_products(pairs, by_rows=True) is None
    finally:
        assert bg.set_native_grouped(True) is False

    def refuse(a, b, arch):
        raise FP4GenError("the groups' operands are not all in one format per side")

    monkeypatch.setattr(bg, "grouped_product", refuse)
    bg._logged.clear()
    with caplog.at_level(logging.INFO, logger="fp4gen.runtime.blackwell_grouped"):
        assert bg.native_products(pairs, by_rows=True) is None
        assert bg.native_products(pairs, by_rows=True) is None
    assert [r.getMessage() for r in caplog.records] == [
        "the grouped experts' GEMM is not the native grouped one: the groups' operands are not "
        "all in one format per side"
    ]


def test_the_grouped_path_hands_its_quantized_pairs_to_the_native_product(monkeypatch) -> None:
    """With a CPU stand-in for the kernel (each group's block values multiplied by torch.mm, as
    the loop of ``group_rows`` / ``group_k`` multiplies them), a training step of grouped
    experts gives the bits of the dequantize product: every GEMM's pairs reach the native
    product, in the shapes it returns (fprop, dgrad: the groups' rows; wgrad: [L, M, N])."""
    pytest.importorskip("transformers")
    from test_moe import run
    from test_moe_grouped import pair, unequal_routing

    monkeypatch.setattr(grouped, "grouped_mm_available", lambda: False)  # torch.mm per group
    calls: list[tuple[bool, list[tuple[int, int, int]]]] = []

    def stand_in(pairs, device, *, by_rows):
        calls.append((by_rows, [(a.rows, b.rows, a.cols) for a, b in pairs]))
        products = [
            torch.mm(a.dequantize_blockwise(), b.dequantize_blockwise().t()) for a, b in pairs
        ]
        return torch.cat(products) if by_rows else torch.stack(products)

    index, weights = unequal_routing()
    hidden = torch.randn(70, 64)
    _, plain = pair("mixtral", torch.float32)
    want = run(plain, hidden, index, weights)
    monkeypatch.setattr(grouped, "_native", stand_in)
    _, native = pair("mixtral", torch.float32)
    got = run(native, hidden, index, weights)
    for a, b in zip(got[:3], want[:3], strict=True):
        assert torch.equal(a, b)
    for name, grad in want[3].items():
        assert torch.equal(got[3][name], grad), name
    assert [by_rows for by_rows, _ in calls] == [True, True, True, False, True, False]
    fprop_up = calls[0][1]
    assert [rows for rows, _, _ in fprop_up] == [70, 1, 69]  # the experts with tokens
    assert len({n for _, n, _ in fprop_up}) == 1  # one N: the projection's outputs


def test_native_is_never_taken_on_cpu_tensors(monkeypatch) -> None:
    def fail(*args, **kwargs):
        raise AssertionError("the native product was asked for CPU tensors")

    monkeypatch.setattr(bg, "native_products", fail)
    a, b = case_groups("nvfp4_fprop")
    pairs = list(zip(a, b, strict=True))
    assert grouped._native(pairs, torch.device("cpu"), by_rows=True) is None
    assert grouped._native([], torch.device("cpu"), by_rows=False) is None


def test_native_decides_by_the_device_before_reading_a_pair(monkeypatch) -> None:
    """On a CUDA device of an arch without the native MMA, ``_native`` returns None without
    reading the pairs (a grouped launch's are built on first read)."""
    from fp4gen.compiler import jit
    from fp4gen.runtime.grouped_quantize import GroupedOperands

    def unread(g: int) -> None:
        raise AssertionError("a pair was read")

    monkeypatch.setattr(jit, "detect_arch", lambda *a, **k: "sm_90a")
    pairs = grouped._Pairs(GroupedOperands(make=unread, count=3), [None] * 3)
    assert grouped._native(pairs, torch.device("cuda", 0), by_rows=True) is None


# ----------------------------------------------------------------------------------------------
# On a Blackwell GPU
# ----------------------------------------------------------------------------------------------
GPU_CASES = {  # (A format, A block, B format, B block, A rows per group, N, K)
    "nvfp4_unequal": (NVFP4, None, NVFP4, None, [1, 100, 300, 7], 136, 512),
    "nvfp4_2d": (NVFP4, None, NVFP4, (16, 16), [64, 200], 256, 1024),
    "mxfp4": (MXFP4, None, MXFP4, None, [129, 3, 40], 64, 256),
    "mxfp8_e4m3": (E4M3, None, E4M3, None, [17, 250], 200, 512),
    "mxfp8_x_mxfp6": (E4M3, None, E2M3, None, [33, 1], 64, 256),
}


@pytest.mark.gpu
@pytest.mark.skipif(not ON_SM100, reason="needs an sm_100 (Blackwell) GPU")
@pytest.mark.parametrize("name", sorted(GPU_CASES))
def test_grouped_gemm_matches_each_groups_reference(name: str) -> None:
    """exact: dyadic operands (any summation order gives the float64 value): each group's rows
    bit-identical to its ``gemm_reference``; bf16 rounded once. tolerance: the quantizer's
    operands (per-group global scales) within the dense test's bound per group."""
    a_fmt, a_block, b_fmt, b_block, rows, n, k = GPU_CASES[name]
    g = torch.Generator(device="cuda").manual_seed(k)
    a_groups, b_groups = [], []
    for r in rows:
        xa = torch.randn(r, k, generator=g, device="cuda")
        xa = xa * torch.exp2(torch.randint(-8, 9, (r, 1), generator=g, device="cuda").float())
        a_groups.append(quantize(xa, a_fmt, block=a_block))
        b_groups.append(
            quantize(torch.randn(n, k, generator=g, device="cuda"), b_fmt, block=b_block)
        )
    exact_a = [dyadic_operand(q, i) for i, q in enumerate(a_groups)]
    exact_b = [dyadic_operand(q, 10 + i) for i, q in enumerate(b_groups)]
    want = torch.cat([gemm_reference(a, b) for a, b in zip(exact_a, exact_b, strict=True)])
    got = bg.grouped_gemm(exact_a, exact_b, arch="sm_100a")
    assert torch.equal(got, want)
    got16 = bg.grouped_gemm(exact_a, exact_b, arch="sm_100a", out_dtype=torch.bfloat16)
    assert torch.equal(got16, want.bfloat16())

    got = bg.grouped_gemm(a_groups, b_groups, arch="sm_100a").double()
    start = 0
    for a, b in zip(a_groups, b_groups, strict=True):
        ref64 = gemm_reference(a, b).double()
        piece = got[start : start + a.rows]
        start += a.rows
        assert ((piece - ref64).abs() <= bound(a, b, ref64, k, torch.float32)).all()


@pytest.mark.gpu
@pytest.mark.skipif(not ON_SM100, reason="needs an sm_100 (Blackwell) GPU")
@pytest.mark.parametrize("arch", ["mixtral", "gpt_oss"])
def test_grouped_experts_take_the_native_product(monkeypatch, arch: str) -> None:
    """A training step of grouped experts (grouped = True) on sm_100: all six grouped GEMMs run on
    the kernel, each group's product within the fp32 summation bound (K + 8) u sum |a b| of the
    float64 product of its block values (docs/numerics.md 6; ``sum_bound``)."""
    pytest.importorskip("transformers")
    from test_moe import run
    from test_moe_grouped import pair, sum_bound, unequal_routing

    recorded: list[tuple[bool, list, torch.Tensor]] = []
    native = bg.native_products

    def record(pairs, *, by_rows):
        c = native(pairs, by_rows=by_rows)
        assert c is not None, "the native grouped product was not taken"
        recorded.append((by_rows, list(pairs), c))
        return c

    monkeypatch.setattr(bg, "native_products", record)
    _, group = pair(arch, torch.bfloat16, device="cuda")
    index, weights = unequal_routing()
    hidden = torch.randn(70, 64, device="cuda").to(torch.bfloat16)
    run(group, hidden, index.cuda(), weights.to(torch.bfloat16).cuda())
    assert [by_rows for by_rows, _, _ in recorded] == [True, True, True, False, True, False]
    for by_rows, pairs, c in recorded:
        start = 0
        for g, (a, b) in enumerate(pairs):
            va, vb = a.dequantize_blockwise(), b.dequantize_blockwise()
            exact = va.double() @ vb.double().t()
            piece = c[start : start + a.rows] if by_rows else c[g]
            start += a.rows
            assert ((piece.double() - exact).abs() <= sum_bound(va, vb)).all()
