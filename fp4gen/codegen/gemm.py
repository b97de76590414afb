"""Render a GemmKernelSpec into a CuTe DSL module: the fused dequantizing GEMM for Hopper (sm_90a).

Design (docs/gemm-sm90.md, with the H100 measurements): a producer warp loads the packed 4-bit
codes (TMA) and the block-scale codes (cp.async) of each 64-wide k-tile into a ring of fp4
stages; the MMA warpgroups decode the next k-tile to bf16 straight into the wgmma K-major
128B-swizzle layout (three bf16 stages, one named barrier per k-tile) while wgmma runs on the
current one; the epilogue applies S_a * S_b, the bias and the accumulation from registers. That
kernel is the class ``fp4gen.kernels.gemm_sm90.GemmSm90Kernel`` (its docstring has the details);
the small-M kernels (mma.sync on operands decoded in registers, split-K) are the class
``fp4gen.kernels.gemm_sm90_small.GemmSm90SmallKernel``.

Everything that depends on the formats is decided here and baked into the module: each kernel's
parameters (``GemmSm90Params``, ``GemmSm90SmallParams``) and the decodes it is given.
Supported pairs (both operands alike):

* NVFP4: e2m1 elements, e4m3 scales, A 1x16 blocks, B 1x16 or 16x16 blocks. Decode "arith":
  bf16 bits of the code shifted into place (exact, v * 2^-126), one HMUL2 by the scale times
  2^119; the epilogue multiplies by 2^14.
* MXFP4: e2m1 elements, ue8m0 scales, 1x32 blocks for A and B. Decode "lut": prmt byte tables,
  one HMUL2 by the scale, whose bf16 bits are the scale code shifted by 7 (exponent
  arithmetic; code 0 is the subnormal 2^-127). The launcher repeats each scale code twice
  along K, so the kernel reads one code per 16 values as for NVFP4.

Anything else raises NotImplementedError (``fp4gen.gemm`` then takes dequantize + cuBLAS).

``gemm_spec(a, b, m)`` is the spec of an operand pair for M rows of A and ``fused_support(a, b)``
why a pair has no kernel (None when it has one): the backend (``fp4gen.runtime.cute_gemm``) and
the compiler's list of kernels (``fp4gen.compiler.aot``) ask the same functions.

The generated module's contract (used through ``fp4gen.runtime.kernels_for``):

* ``KERNELS = ("gemm",)``, ``ARCHS = ("sm_90a",)``;
* ``compile_kernel(name, arch, *, dump_dir=None)``: the TVM-FFI compiled function (no GPU
  needed); with ``dump_dir`` the PTX is kept there;
* ``launch_args(...)``: validates and pads the operands, returns the compiled function's
  arguments (a benchmark can time the bare call);
* ``run(fns, a_data, a_scales, a_global, b_data, b_scales, b_global, *, k, out, bias=None)``.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from typing import ClassVar

from fp4gen.codegen.render import (
    InputContext,
    SpecEntries,
    TemplateContext,
    doc_block,
    inline,
    input_context,
    render_template,
)
from fp4gen.formats import E2M1, E4M3, UE8M0, BlockFormat, ElementFormat
from fp4gen.spec import GemmKernelSpec, GemmOutDType, GemmTile
from fp4gen.vocab import Arch, StrEnum

ARCHS: tuple[str, ...] = (Arch.SM90A.value,)
SMEM_CAP = 232448  # H100 / H200: max dynamic shared memory per block (227 KiB)
TILE_K = 64  # values per k-tile: 32 code bytes, 128 bf16 bytes (one 128B-swizzle row)
STAGES_BF16 = 3  # decoded stages: one barrier per k-tile is enough with three (see template)


@dataclass(frozen=True)
class SmallMTile(GemmTile):
    """A tile of the small-M kernel (``gemm_sm90_small.py.j2``): warp-level mma.sync.m16n8k16
    with both operands decoded into registers, split-K across CTAs.

    ``tile_m`` x ``tile_n``: rows of A x rows of B per CTA; ``warp_m`` x ``warp_n``: per warp
    (16 or 32 rows of A: 1 or 2 m16 atoms; 32 or 64 rows of B: 4 or 8 n8 atoms), so
    ``tile_m / warp_m`` x ``tile_n / warp_n`` warps tile the CTA; ``mma_warpgroups``: 4-warp
    groups of compute warps, the warps beyond the tiling ones split the CTA's k-tiles round
    robin; ``stages_fp4``: TMA stages of ``ktiles_per_stage`` k-tiles (64 values) each, loaded
    back to back (adjacent 32-byte sectors of every B row in one burst) under one mbarrier;
    ``ctas_per_sm``: the launch bound (registers <= 65536 / (threads * ctas_per_sm)) and the
    occupancy the split-K choice fills.
    """

    warp_m: int = 16
    warp_n: int = 64
    ctas_per_sm: int = 2
    ktiles_per_stage: int = 1

    def __post_init__(self) -> None:
        if self.tile_m not in (16, 32, 64):
            raise ValueError(f"small-M tile_m {self.tile_m}: 16, 32 or 64")
        if self.warp_m not in (16, 32) or self.tile_m % self.warp_m:
            raise ValueError(f"tile_m {self.tile_m} must be a multiple of warp_m (16 or 32)")
        if self.warp_n not in (32, 64) or self.tile_n % self.warp_n:
            raise ValueError(f"tile_n {self.tile_n} must be a multiple of warp_n (32 or 64)")
        warps = 4 * self.mma_warpgroups
        tiling = (self.tile_m // self.warp_m) * (self.tile_n // self.warp_n)
        if warps % tiling:
            raise ValueError(f"{warps} compute warps do not split into {tiling} per k-tile")
        if (self.tile_m * self.tile_n // 8) % (32 * warps):
            raise ValueError("the epilogue's 8-column chunks must divide among the threads")
        if self.mma_n_split != 1 or self.acc_sets != 1:
            raise ValueError("small-M tiles have no wgmma split or accumulator sets")
        if (self.warp_m // 16) * (self.warp_n // 8) * 4 > 64:
            raise ValueError("more than 64 fp32 accumulators per thread")
        if self.stages_fp4 < 2 or self.ctas_per_sm < 1:
            raise ValueError("at least two stages and one CTA per SM")
        kps, warps_k = self.ktiles_per_stage, warps // tiling
        if kps not in (1, 2, 4) or (kps % warps_k and warps_k % kps):
            raise ValueError(
                f"{kps} k-tiles per stage do not divide among {warps_k} warps along K (or the "
                "reverse): 1, 2 or 4"
            )
        # A warp reads every stage_step-th stage. If that stride does not divide the stages,
        # a stage's slot is read by different warps on successive rounds, each warp sees only
        # every other phase of its full barrier, and a parity wait can pass on a phase two
        # rounds old (the slot's previous load still in flight): stale codes, a silent wrong
        # product (seen with 10 stages and 4 warps along K under load, docs/gemm-sm90.md).
        stage_step = max(1, warps_k // kps)
        if self.stages_fp4 % stage_step:
            raise ValueError(
                f"{self.stages_fp4} stages: a multiple of {stage_step} (the stride of each of "
                f"the {warps_k} warps along K through the stages), so every stage is always "
                "read by the same warps"
            )

    @property
    def name(self) -> str:
        """e.g. ``r16n64w1x1x4k1s12c3``: tile, warps along M x N x K, k-tiles per stage,
        stages, CTAs per SM."""
        warps_m = self.tile_m // self.warp_m
        warps_n = self.tile_n // self.warp_n
        warps_k = 4 * self.mma_warpgroups // (warps_m * warps_n)
        return (
            f"r{self.tile_m}n{self.tile_n}w{warps_m}x{warps_n}x{warps_k}"
            f"k{self.ktiles_per_stage}s{self.stages_fp4}c{self.ctas_per_sm}"
        )


# Tile configurations (measurements in docs/gemm-sm90.md):
TILES: dict[str, GemmTile] = {
    # M <= 16: one m16 atom and 64 B rows per warp, the four warps split K k-tile by k-tile,
    # 12 stages, 3 CTAs per SM (16x8192x8192 on H100: 23.3 us, 2.1x cuBLAS BF16)
    "r16": SmallMTile(16, 64, mma_warpgroups=1, stages_fp4=12, ctas_per_sm=3),
    # M <= 32: two m16 atoms per warp, the four warps split K k-tile by k-tile
    # (12 stages, a multiple of the warps' stride 4: 10 let a stage change readers, see above)
    "r32": SmallMTile(32, 64, mma_warpgroups=1, stages_fp4=12, warp_m=32, ctas_per_sm=2),
    # M <= 64: two m16 atoms per warp, 2 x 2 warps over the tile, stages of 2 k-tiles
    "r64": SmallMTile(
        64, 128, mma_warpgroups=1, stages_fp4=4, warp_m=32, ktiles_per_stage=2, ctas_per_sm=2
    ),
    # wgmma kernel, 64x64 tiles, one MMA warpgroup, 4 accumulator sets (16x8192x8192: 53 us)
    "small": GemmTile(64, 64, mma_warpgroups=1, stages_fp4=12, acc_sets=4),
    # M <= 256: 128x64 tiles, two MMA warpgroups (128x8192x8192: 78 us)
    "mid": GemmTile(128, 64, mma_warpgroups=2, stages_fp4=16),
    # larger M: 128x256 tiles, two MMA warpgroups (8192^3: 0.58x cuBLAS BF16)
    "large": GemmTile(128, 256, mma_warpgroups=2, stages_fp4=5),
}
# Small-M alternatives the benchmark times against TILES (benchmarks/gemm.py --tiles NAME, by
# tile name): stages of 2 or 4 k-tiles, 4 CTAs per SM, 8 warps; all within 5 % of "r16" at
# 16x8192x8192 on H100 (docs/gemm-sm90.md)
CANDIDATES: dict[str, GemmTile] = {
    t.name: t
    for t in (
        SmallMTile(16, 64, mma_warpgroups=1, stages_fp4=4, ktiles_per_stage=4, ctas_per_sm=4),
        SmallMTile(16, 64, mma_warpgroups=1, stages_fp4=6, ktiles_per_stage=2, ctas_per_sm=4),
        SmallMTile(16, 128, mma_warpgroups=2, stages_fp4=4, ktiles_per_stage=4, ctas_per_sm=2),
    )
}
MAX_SPLITS = 16  # split-K ways at most
MIN_SPLIT_KTILES = 8  # k-tiles per split at least (two per warp splitting K)


def pick_tile(m: int) -> GemmTile:
    """The tile configuration for M rows of A."""
    if m <= 16:
        return TILES["r16"]
    if m <= 32:
        return TILES["r32"]
    if m <= 64:
        return TILES["r64"]
    if m <= 256:
        return TILES["mid"]
    return TILES["large"]


def choose_splits(tile: GemmTile, m: int, n: int, k: int, sms: int) -> int:
    """Ways a small-M tile splits K across CTAs for an M x N x K product on ``sms`` SMs: as
    many as fit one wave of ``ctas_per_sm`` CTAs per SM, each split at least
    MIN_SPLIT_KTILES k-tiles (whole stages), at most MAX_SPLITS; normalised so no split is
    empty. 1 for the wgmma tiles (they do not split K)."""
    if not isinstance(tile, SmallMTile):
        return 1
    tiles = -(-m // tile.tile_m) * -(-n // tile.tile_n)
    kps = tile.ktiles_per_stage
    k_stages = -(-k // (TILE_K * kps))  # splits are whole stages
    min_stages = -(-MIN_SPLIT_KTILES // kps)
    splits = min(sms * tile.ctas_per_sm // tiles, k_stages // min_stages, MAX_SPLITS)
    if splits <= 1:
        return 1
    per = -(-k_stages // splits)
    return -(-k_stages // per)


_OUT_DTYPES: tuple[GemmOutDType, ...] = ("bf16", "fp32")  # the output dtypes the kernels write


class Decode(StrEnum):
    """How the kernel decodes an operand's e2m1 codes and block scales to bf16 (the module
    docstring has the details); the templates compare it with these words."""

    ARITH = "arith"  # e4m3 scales: the code's bf16 bits shifted into place, one HMUL2
    LUT = "lut"  # ue8m0 scales: prmt byte tables, one HMUL2 (scale by exponent arithmetic)


# (element, scale) pairs with a decode: scale format -> (decode, block along K)
_DECODES: dict[tuple[ElementFormat, ElementFormat], tuple[Decode, int]] = {
    (E2M1, E4M3): (Decode.ARITH, 16),
    (E2M1, UE8M0): (Decode.LUT, 32),
}


def unsupported_reason(spec: GemmKernelSpec) -> str | None:
    """Why the template cannot generate ``spec`` (None when it can)."""
    for side, element, scale in (
        ("A", spec.a_element, spec.a_scale),
        ("B", spec.b_element, spec.b_scale),
    ):
        if element != E2M1:
            return f"{side} has {element.name} elements (the fused GEMM decodes e2m1 only)"
        if scale is None or (element, scale) not in _DECODES:
            scale_name = "fp32" if scale is None else scale.name
            return (
                f"{side} has {scale_name} block scales (the fused GEMM takes e4m3 or ue8m0 "
                "scales: NVFP4 or MXFP4)"
            )
    if spec.a_scale != spec.b_scale:
        return "A and B have different scale formats (mixed pairs are not generated)"
    assert spec.a_scale is not None
    _, block = _DECODES[(spec.a_element, spec.a_scale)]
    if spec.a_block != (1, block):
        return f"A has {spec.a_block[0]}x{spec.a_block[1]} blocks (the fused GEMM takes 1x{block})"
    b_ok = [(1, block), (block, block)] if block == 16 else [(1, block)]
    if spec.b_block not in b_ok:
        shapes = " or ".join(f"{r}x{c}" for r, c in b_ok)
        return f"B has {spec.b_block[0]}x{spec.b_block[1]} blocks (the fused GEMM takes {shapes})"
    return None


def gemm_spec(
    a: BlockFormat,
    b: BlockFormat,
    m: int,
    *,
    out_dtype: GemmOutDType = "fp32",
    bias: bool = False,
    accumulate: bool = False,
    tile: GemmTile | None = None,
) -> GemmKernelSpec:
    """The fused-kernel spec for A [m, K] in format ``a`` times B^T in format ``b``."""
    return GemmKernelSpec(
        a_element=a.element,
        a_block=a.block,
        a_scale=a.scale.element,
        b_element=b.element,
        b_block=b.block,
        b_scale=b.scale.element,
        out_dtype=out_dtype,
        bias=bias,
        accumulate=accumulate,
        tile=tile or pick_tile(m),
    )


@cache
def fused_support(a: BlockFormat, b: BlockFormat) -> str | None:
    """None when a fused kernel is generated for this operand pair, else the reason
    (remembered per pair: the dispatch asks on every call)."""
    return unsupported_reason(gemm_spec(a, b, 1))


def check_gemm(spec: GemmKernelSpec) -> None:
    """Raise NotImplementedError (with the reason) unless the template can generate ``spec``;
    ValueError for a spec no template could (output dtype, a tile over the shared memory)."""
    reason = unsupported_reason(spec)
    if reason is not None:
        raise NotImplementedError(f"{spec.name}: {reason}")
    if spec.out_dtype not in _OUT_DTYPES:
        raise ValueError(f"{spec.name}: output dtype {spec.out_dtype!r} (bf16 or fp32)")
    tc = tile_constants(spec.tile, b_sf_2d=spec.b_block[0] > 1)
    smem = tc.smem_bytes
    if smem > SMEM_CAP:
        raise ValueError(
            f"{spec.name}: the tile needs {smem} bytes of shared memory (> {SMEM_CAP})"
        )
    if isinstance(spec.tile, SmallMTile):
        assert isinstance(tc, SmallTileConstants)
        if spec.tile.ctas_per_sm * (smem + 1024) > SMEM_PER_SM:
            raise ValueError(
                f"{spec.name}: {spec.tile.ctas_per_sm} CTAs of {smem} bytes do not fit in one SM"
            )
        if not tc.reduction_fits:
            raise ValueError(f"{spec.name}: the warps' partial tiles exceed the code slots")


def _round_up(x: int, a: int) -> int:
    return (x + a - 1) // a * a


SMEM_PER_SM = 233472  # H100 / H200: shared memory per SM (228 KiB), 1 KiB of it reserved per CTA


@dataclass(frozen=True)
class SmallTileConstants:
    """Thread and shared-memory layout of a small-M tile (``tc`` of gemm_sm90_small.py.j2)."""

    mt: int  # m16 atoms per warp along M
    nt: int  # n8 atoms per warp along N
    acc_regs: int  # fp32 accumulators per thread: mt * nt * 4
    warps_m: int  # warps along M of the tile
    warps_n: int  # warps along N of the tile
    warps_k: int  # warps splitting each stage's k-tiles (the compute warps beyond the tiling)
    subs: int  # k-tile slots per stage and warp
    stage_step: int  # a warp's stride through the stages
    empty_arrivals: int  # arrivals that release a stage (the warps reading it, 32 each)
    compute_warps: int  # the mma warps
    compute_threads: int  # 32 * compute_warps
    threads: int  # per CTA: the compute threads and the producer warp
    producer_warp: int  # the producer warp's index (after the compute warps)
    sf_b_rows: int  # B scale rows per tile: tile_n, or tile_n / 16 for 16x16 blocks
    sf_rows: int  # scale rows per tile: tile_m + sf_b_rows
    sf_stage_bytes: int  # shared memory of a stage's scale codes (128-byte multiple)
    tx_bytes: int  # TMA bytes of a stage's A and B codes
    epi_steps: int  # 8-column chunks of the output tile per compute thread
    red_bytes: int  # the warps' fp32 partial tiles (reusing the code slots after the mainloop)
    reduction_fits: bool  # red_bytes fit in the code slots
    smem_bytes: int  # dynamic shared memory per CTA


@dataclass(frozen=True)
class WgmmaTileConstants:
    """Thread and shared-memory layout of a wgmma tile (``tc`` of gemm_sm90.py.j2)."""

    m_split: int  # MMA warpgroups along M: mma_warpgroups / mma_n_split
    mma_threads: int  # the MMA warpgroups' threads (they also decode)
    threads: int  # per CTA: the MMA threads and the producer warp
    producer_warp: int  # the producer warp's index (after the MMA warpgroups)
    units: int  # (row, 32-value half) decode units per k-tile: 2 * (tile_m + tile_n)
    units_per_thread: int  # decode units per MMA thread and k-tile, rounded up
    partial_units: bool  # the units do not divide evenly among the MMA threads
    sf_b_rows: int  # B scale rows per tile: tile_n, or tile_n / 16 for 16x16 blocks
    sf_rows: int  # scale rows per tile: tile_m + sf_b_rows
    sf_stage_bytes: int  # shared memory of a stage's scale codes (128-byte multiple)
    tx_bytes: int  # TMA bytes of a stage's A and B codes
    smem_bytes: int  # dynamic shared memory per CTA


def small_tile_constants(tile: SmallMTile, *, b_sf_2d: bool) -> SmallTileConstants:
    """Thread and shared-memory layout of a small-M tile."""
    warps = 4 * tile.mma_warpgroups
    warps_m = tile.tile_m // tile.warp_m
    warps_n = tile.tile_n // tile.warp_n
    warps_k = warps // (warps_m * warps_n)
    kps = tile.ktiles_per_stage
    sf_b_rows = tile.tile_n // 16 if b_sf_2d else tile.tile_n
    sf_rows = tile.tile_m + sf_b_rows
    sf_stage = _round_up(sf_rows * 4 * kps, 128)  # 4 scale codes per row and k-tile
    slots = tile.stages_fp4 * kps
    codes = slots * (tile.tile_m * TILE_K + tile.tile_n * (TILE_K // 2))
    # the warps' partial tiles, fp32 rows of tile_n + 4, reuse the code slots after the mainloop
    reduction = warps_k * tile.tile_m * (tile.tile_n + 4) * 4
    barriers = 8 * 2 * tile.stages_fp4 + 16
    return SmallTileConstants(
        mt=tile.warp_m // 16,
        nt=tile.warp_n // 8,
        acc_regs=(tile.warp_m // 16) * (tile.warp_n // 8) * 4,
        warps_m=warps_m,
        warps_n=warps_n,
        warps_k=warps_k,
        subs=max(1, kps // warps_k),
        stage_step=max(1, warps_k // kps),
        empty_arrivals=32 * warps_m * warps_n * min(kps, warps_k),
        compute_warps=warps,
        compute_threads=32 * warps,
        threads=32 * warps + 32,
        producer_warp=warps,
        sf_b_rows=sf_b_rows,
        sf_rows=sf_rows,
        sf_stage_bytes=sf_stage,
        tx_bytes=kps * (tile.tile_m * TILE_K + tile.tile_n * (TILE_K // 2)),
        epi_steps=tile.tile_m * tile.tile_n // 8 // (32 * warps),
        red_bytes=reduction,
        reduction_fits=reduction <= codes,
        # + 2 KiB slack: the 1024-byte alignment of the code buffers
        smem_bytes=codes + tile.stages_fp4 * sf_stage + barriers + 2048,
    )


def tile_constants(tile: GemmTile, *, b_sf_2d: bool) -> WgmmaTileConstants | SmallTileConstants:
    """Thread and shared-memory layout of a tile (every number the kernel bakes in)."""
    if isinstance(tile, SmallMTile):
        return small_tile_constants(tile, b_sf_2d=b_sf_2d)
    mma_threads = 128 * tile.mma_warpgroups
    units = 2 * (tile.tile_m + tile.tile_n)  # (row, 32-value half) decode units per k-tile
    sf_b_rows = tile.tile_n // 16 if b_sf_2d else tile.tile_n
    sf_rows = tile.tile_m + sf_b_rows
    sf_stage = _round_up(sf_rows * 4, 128)  # 4 scale codes per row and k-tile
    fp4_stage = (tile.tile_m + tile.tile_n) * (TILE_K // 2) + sf_stage
    bf16_stage = (tile.tile_m + tile.tile_n) * TILE_K * 2
    barriers = 8 * 2 * tile.stages_fp4
    return WgmmaTileConstants(
        m_split=tile.mma_warpgroups // tile.mma_n_split,
        mma_threads=mma_threads,
        threads=mma_threads + 32,
        producer_warp=4 * tile.mma_warpgroups,
        units=units,
        units_per_thread=-(-units // mma_threads),
        partial_units=units % mma_threads != 0,
        sf_b_rows=sf_b_rows,
        sf_rows=sf_rows,
        sf_stage_bytes=sf_stage,
        tx_bytes=(tile.tile_m + tile.tile_n) * (TILE_K // 2),
        # + 3 KiB slack: the 1024-byte alignment of the code and bf16 buffers
        smem_bytes=tile.stages_fp4 * fp4_stage + STAGES_BF16 * bf16_stage + barriers + 3072,
    )


@dataclass(frozen=True)
class GemmCommon(TemplateContext):
    """The variables both GEMM templates read. Their e2m1 decodes are imported from
    ``fp4gen.kernels.sm90_decode`` (``decode`` picks which); the kernels' PTX helpers live in
    ``fp4gen.kernels.sm90_ptx``."""

    entries: SpecEntries[GemmKernelSpec] = inline()
    elem: str  # the element format's name, both operands: "e2m1"
    scale: str  # the scale format's name, both operands: "e4m3" or "ue8m0"
    decode: Decode
    a_block: int  # values per block along K (A's 1xN blocks; B's blocks are as long)
    b_block: tuple[int, int]  # B's block shape: (1, N) or (16, 16)
    b_sf_2d: bool  # 16x16 B blocks: one scale row per 16 rows of B
    expand: int  # scale codes per 16 values after the launcher's expansion (1, or 2 for 1x32)
    out: InputContext  # the output dtype's names (name, CuTe DSL type, torch attribute)
    bias: bool  # an fp32 [N] bias added in the epilogue
    accumulate: bool  # the output tensor holds C: C += A @ B^T
    tile_k: int  # values per k-tile
    archs: tuple[str, ...]
    launch_doc: str  # the launch function's docstring paragraph


@dataclass(frozen=True)
class WgmmaContext(TemplateContext):
    """The variables of gemm_sm90.py.j2: the wgmma kernel (operands decoded to bf16 in shared
    memory). The kernel is ``fp4gen.kernels.gemm_sm90.GemmSm90Kernel``; the template writes
    these values into the spec's ``GemmSm90Params``."""

    TEMPLATE: ClassVar[str] = "gemm_sm90.py.j2"

    common: GemmCommon = inline()
    tile: GemmTile
    tc: WgmmaTileConstants
    stages_bf16: int  # decoded bf16 stages in shared memory


@dataclass(frozen=True)
class SmallMContext(TemplateContext):
    """The variables of gemm_sm90_small.py.j2: the small-M kernel (mma.sync on operands decoded
    in registers, split-K across CTAs). The kernel is
    ``fp4gen.kernels.gemm_sm90_small.GemmSm90SmallKernel``; the template writes these values
    into the spec's ``GemmSm90SmallParams``."""

    TEMPLATE: ClassVar[str] = "gemm_sm90_small.py.j2"

    common: GemmCommon = inline()
    tile: SmallMTile
    tc: SmallTileConstants
    a_sf_32: bool  # A's 1x32 scale codes read as they are (no per-call repeat along K)


def _common_context(spec: GemmKernelSpec) -> GemmCommon:
    assert spec.a_scale is not None
    decode, block = _DECODES[(spec.a_element, spec.a_scale)]
    b_sf_2d = spec.b_block[0] > 1
    out = input_context(spec.out_dtype)
    b_rows = "ceil(N/16)" if b_sf_2d else "N"
    small = isinstance(spec.tile, SmallMTile)
    a_operand = "a_codes uint8 [M, K] (one code per byte)" if small else "a_data uint8 [M, K/2]"
    launch_doc = (
        f"{a_operand}, a_scales uint8 [M, ceil(K/{block})] "
        f"({spec.a_scale.name} codes), b_data uint8 [N, ceil(K/2)], b_scales uint8 "
        f"[{b_rows}, ceil(K/{block})], a_global and b_global fp32 with one element, out "
        f"{out.torch} [M, N] (contiguous, 16-byte aligned"
        + ("; it holds C" if spec.accumulate else "")
        + ")"
        + (", bias fp32 [N]" if spec.bias else "")
        + "; all on one CUDA device. K is padded to a multiple of 64 with zero codes"
        + (
            "."
            if block == 16
            else f", B's scale codes repeated {block // 16} times along K (A's as they are)."
            if small
            else f", each scale code repeated {block // 16} times along K."
        )
    )
    return GemmCommon(
        entries=SpecEntries.of(spec),
        elem=spec.a_element.name,
        scale=spec.a_scale.name,
        decode=decode,
        a_block=block,
        b_block=spec.b_block,
        b_sf_2d=b_sf_2d,
        expand=block // 16,
        out=out,
        bias=spec.bias,
        accumulate=spec.accumulate,
        tile_k=TILE_K,
        archs=ARCHS,
        launch_doc=doc_block(launch_doc),
    )


def gemm_context(spec: GemmKernelSpec) -> WgmmaContext | SmallMContext:
    """Everything the template of ``spec``'s tile needs, all derived from the spec: the small-M
    template for a SmallMTile, the wgmma template otherwise."""
    check_gemm(spec)
    common = _common_context(spec)
    if isinstance(spec.tile, SmallMTile):
        return SmallMContext(
            common=common,
            tile=spec.tile,
            tc=small_tile_constants(spec.tile, b_sf_2d=common.b_sf_2d),
            a_sf_32=common.a_block == 32,
        )
    tc = tile_constants(spec.tile, b_sf_2d=common.b_sf_2d)
    assert isinstance(tc, WgmmaTileConstants)
    return WgmmaContext(
        common=common,
        tile=spec.tile,
        tc=tc,
        stages_bf16=STAGES_BF16,
    )


def render_gemm(spec: GemmKernelSpec) -> str:
    """The generated CuTe DSL module (Python source) of ``spec``'s fused GEMM kernel.

    Raises NotImplementedError for operand formats or block shapes the template does not
    cover (see the module docstring)."""
    context = gemm_context(spec)
    return render_template(context.TEMPLATE, context)


__all__ = [
    "ARCHS",
    "CANDIDATES",
    "MAX_SPLITS",
    "TILES",
    "Decode",
    "GemmCommon",
    "SmallMContext",
    "SmallMTile",
    "SmallTileConstants",
    "WgmmaContext",
    "WgmmaTileConstants",
    "check_gemm",
    "choose_splits",
    "fused_support",
    "gemm_context",
    "gemm_spec",
    "pick_tile",
    "render_gemm",
    "small_tile_constants",
    "tile_constants",
    "unsupported_reason",
]
