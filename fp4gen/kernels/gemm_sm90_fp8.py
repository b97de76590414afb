"""The block-scaled FP8 GEMM for Hopper (sm_90a): C = S_a S_b sum_b s_a s_b P_b (+ bias) (+ C).

What it computes (docs/numerics.md section 6.1; oracle:
``fp4gen.numerics.gemm_block_scaled_reference``), for A [M, K] and B [N, K] FP8 codes (e4m3 or
e5m2 on either side) quantized along K in K-blocks of ``block_k`` values::

    P_b[m, n] = sum_{i in K-block b} q_a[m, i] q_b[n, i]          (FP8 tensor cores)
    C[m, n]   = fp32(S_a S_b) * sum_b fp32(s_a[m, b] s_b[n, b]) P_b[m, n]  (+ bias[n]) (+ C[m, n])

The codes come as uint8 tensors and are read as their FP8 type. A's block scales are one per
row and K-block, [M, KB]; B's one per row and K-block ([N, KB], 1 x block_k blocks) or one per
block_k x block_k tile ([ceil(N / block_k), KB]), both row-major as the quantize kernels write
them: fp32 decode factors, or ue8m0 codes (uint8,
value 2^(code - 127); code 0 is 2^-127, 255 NaN) whose rows the launcher pads to a multiple of
4 bytes. S_a and S_b are fp32 device tensors of one element (never read on the host).

Design (DeepGEMM's published scheme for 1x128 x 128x128 FP8; CUTLASS's CuTe DSL Hopper
examples for the TMA / wgmma plumbing). Persistent: a grid of at most one CTA per SM walks the
output tiles (tile_m x tile_n, rasterized in groups of group_m M-tiles for L2 reuse) with
stride gridDim. 384 threads:

producer warp (warp 8; its warpgroup gives registers away: setmaxnreg 40)
    per k-tile (tile_k values) into stage s % stages: TMA of A [tile_m, tile_k] and B [tile_n,
    tile_k] straight into the 128B-swizzled (64B / 32B for tile_k 64 / 32) wgmma layout, and
    one 4-byte cp.async per row of the k-tile's block scale (A's tile_m rows, then B's tile_n
    columns: B's scale row n, or n // block_k for tiles), all on one mbarrier:
    arrive.expect_tx + 32 cp.async.mbarrier.arrive.noinc (count 33). Rows past M / N: TMA
    zero-fills the codes; the scale reads are clamped to the last row (they only feed outputs
    that are never stored).
MMA warpgroups 0, 1 (setmaxnreg 232; rows 0-63 and 64-127 of the tile, m64 n{tile_n} k32 FP8
wgmma, fp32 accumulation)
    per K-block: the block's k-tiles into a partial accumulator (the first wgmma of the block
    overwrites it), the block's scales from the stage (shared memory, read while the wgmma
    run), wait for the wgmma, release the stage, then promote:
    total[i] += partial[i] * fp32(s_a[row] s_b[col]). Both warpgroups wait for the same
    stages, so their promotions coincide and the tensor cores idle meanwhile; with ``overlap``
    each keeps two partial accumulators and issues block b's wgmma before it promotes block
    b - 1 (``wgmma.wait_group 1``), releasing block b - 1's stages after reading its scales.
epilogue
    from the registers: y = total * fp32(S_a S_b) (+ bias[n]) (+ C[m, n]) in fp32, one
    rounding to C's dtype, predicated scalar stores (any M and N). The producer already loads
    the next tile meanwhile.

Numerics: each P_b is the tensor cores' sum of the block's products (their adder keeps about
14 bits of the aligned sum: numerics.md 6.1 bounds it), then fp32 multiplies and adds as the
formula says (the compiler may fuse the multiply-add: one rounding fewer, inside the bound).

Limits: K % block_k == 0 (the launcher zero-pads codes, which add exactly 0; the scales keep
their ceil(K / block_k) columns), block_k a multiple of the wgmma K (32) that divides 128 or is a
multiple of 128: 32, 64, 128, 256, 384, ...; tile_k = min(block_k, 128). A and B row-major with
16-byte aligned rows (K % 16 == 0) and bases; M, N >= 1 arbitrary; M * N < 2^31.
"""

from __future__ import annotations

import math
import os
import shlex
from dataclasses import dataclass
from typing import ClassVar

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import BFloat16, Float32, Int32, Int64, Uint8, Uint32, const_expr, range_constexpr
from cutlass.cute.nvgpu import cpasync, warpgroup
from cutlass.cutlass_dsl import dsl_user_op
from cutlass.tensor_utils import LayoutEnum

from fp4gen.codegen.gemm_fp8 import MAX_TILE_K, SCALE_KINDS, block_k_reason, wide_tile_reason
from fp4gen.kernels.sm90_ptx import cp_async, inline_asm, ir_arg, lds_u32

from cutlass._mlir import ir  # isort: skip  (after cutlass: the DSL's MLIR bindings)
from cutlass._mlir.dialects import llvm  # isort: skip

SMEM_BYTES = 227 * 1024  # sm_90a's shared memory per CTA
ELEMENTS = {"e4m3": cutlass.Float8E4M3FN, "e5m2": cutlass.Float8E5M2}
OUTPUTS = {"bf16": BFloat16, "fp32": Float32}


@dataclass(frozen=True)
class GemmSm90Fp8Params:
    """Everything the kernel depends on besides its tensors (``make_params`` derives the rest
    from the recipe's pair): compile-time constants, one compiled kernel per value."""

    a_element: str  # "e4m3" or "e5m2"
    b_element: str
    scale_kind: str  # "fp32" (decode factors) or "ue8m0" (codes)
    block_k: int  # K-block length of both operands
    b_2d: bool  # B's blocks are block_k x block_k tiles (one scale row per block_k rows)
    out: str  # "bf16" or "fp32"
    bias: bool  # + bias[n], fp32 [N]
    accumulate: bool  # + C[m, n]: C is read, then overwritten
    tile_m: int = 128  # two MMA warpgroups of 64 rows
    tile_n: int = 128
    stages: int = 0  # 0: as many as shared memory holds
    group_m: int = 8  # M-tiles per raster group
    # two partial accumulators: K-block b's wgmma run while block b - 1 is promoted (three
    # accumulators of tile_n / 2 registers each; off: one, the tensor cores idle during the
    # promotion unless the other warpgroup fills them)
    overlap: bool = False
    # CTAs per cluster along M (1 or 2): with 2, the two CTAs of a cluster compute vertically
    # adjacent tiles and each loads half of their common B tile, multicast to both (a quarter
    # less L2 traffic per CTA)
    cluster_m: int = 1
    # A's block scales (and B's where its blocks are 1 x block_k) come MN-major, [KB, Rp]: one
    # K-block's scales of all rows contiguous (Rp >= rows, a multiple of 4 fp32 / 16 ue8m0
    # codes), so the producer copies a tile's rows of one K-block with 16-byte cp.async, every
    # sector's bytes used (off: the row-major [R, KB] scales, one 4-byte cp.async per row, 4
    # of every 32 bytes read used)
    mn_major_scales: bool = False
    # the epilogue writes whole sectors: bf16 rows of 8 columns (16 bytes) gathered within each
    # quad of lanes by shuffles, fp32 column pairs as 8-byte stores (off: one 2- or 4-byte
    # store per element, 8 or 16 of every 32 bytes written used)
    wide_stores: bool = False
    # M-grouped (fp4gen.kernels.gemm_sm90_fp8_grouped): A's rows in groups at device offsets,
    # B one [N, K] matrix per group; no output tile spans two groups
    grouped: bool = False
    # K-grouped (fp4gen.kernels.gemm_sm90_fp8_kgrouped): the groups side by side along K at
    # device offsets (whole K-blocks each), C one [M, N] matrix per group (the experts' wgrad)
    k_grouped: bool = False

    def __post_init__(self) -> None:
        reason = block_k_reason(self.block_k)
        for name, value, allowed in (
            ("a_element", self.a_element, ELEMENTS),
            ("b_element", self.b_element, ELEMENTS),
            ("scale_kind", self.scale_kind, SCALE_KINDS),
            ("out", self.out, OUTPUTS),
        ):
            if value not in allowed:
                reason = reason or f"{name} must be one of {tuple(allowed)}, got {value!r}"
        if self.cluster_m not in (1, 2):
            reason = reason or f"cluster_m must be 1 or 2, got {self.cluster_m}"
        if self.tile_m != 128:
            reason = reason or f"tile_m must be 128 (two warpgroups of 64 rows), got {self.tile_m}"
        if self.tile_n % 32 or not 32 <= self.tile_n <= 192:
            reason = reason or f"tile_n must be a multiple of 32 in [32, 192], got {self.tile_n}"
        if reason is None:  # registers: B's scales per column, a third accumulator
            reason = wide_tile_reason(self.tile_n, self.block_k, self.b_2d, self.overlap)
        if reason is None and self.overlap and self.num_stages < 2 * self.ktiles_per_block:
            # two K-blocks in flight hold their stages until promoted: fewer would deadlock
            reason = (
                f"overlap holds two K-blocks of {self.ktiles_per_block} stages; "
                f"{self.num_stages} stages are too few"
            )
        if reason is None and self.grouped and (self.cluster_m != 1 or self.mn_major_scales):
            # a group's tiles start at any row: no 16-byte scale chunks, no cluster pairs
            reason = "grouped takes cluster_m 1 and row-major scales"
        if (
            reason is None
            and self.k_grouped
            and (
                self.grouped
                or self.cluster_m != 1
                or self.overlap
                or self.b_2d
                or self.bias
                or self.accumulate
            )
        ):
            # a tile's K range is its group's: one partial accumulator, 1xN blocks on both
            # sides, one CTA per cluster, no bias or accumulate
            reason = (
                "k_grouped takes 1xN B blocks, cluster_m 1 and none of grouped, overlap, "
                "bias, accumulate"
            )
        if reason is not None:
            raise ValueError(f"GemmSm90Fp8Params: {reason}")

    @property
    def tile_k(self) -> int:
        return min(self.block_k, MAX_TILE_K)

    @property
    def ktiles_per_block(self) -> int:
        return self.block_k // self.tile_k

    @property
    def sf_stage_bytes(self) -> int:
        """A stage's block scales: 4 bytes per row of A and of B (an fp32 scale, or the aligned
        word holding a ue8m0 code)."""
        return 4 * (self.tile_m + self.tile_n)

    @property
    def stage_bytes(self) -> int:
        return (self.tile_m + self.tile_n) * self.tile_k + self.sf_stage_bytes

    @property
    def num_stages(self) -> int:
        if self.stages:
            return self.stages
        # the barriers and alignment padding: 2 KiB kept free
        return max(2, min(8, (SMEM_BYTES - 2048) // self.stage_bytes))

    @property
    def scale_bytes(self) -> int:
        """Bytes of one block scale in global memory: an fp32 factor or a ue8m0 code."""
        return 4 if self.scale_kind == "fp32" else 1

    @property
    def rows_per_chunk(self) -> int:
        """Rows of an MN-major scale tensor in one 16-byte cp.async (and the multiple of
        which its row pitch Rp must be)."""
        return 16 // self.scale_bytes

    @property
    def b_mn_major(self) -> bool:
        """B's scales come MN-major too (1 x block_k blocks; block_k x block_k tiles keep
        their row-major [ceil(N / block_k), KB], a few rows per tile)."""
        return self.mn_major_scales and not self.b_2d

    @property
    def b_scale_pair(self) -> bool:
        """Tiles wider than 128 (B in tiles): an output tile's columns span two rows of B's
        tile scales at most, split at a boundary column that depends on the tile; the two
        scales are read, each column group picks one (no per-column scale registers)."""
        return self.b_2d and self.tile_n > 128 and not self.b_scale_per_tile

    @property
    def b_scale_per_tile(self) -> bool:
        """One B scale per tile and K-block (tiles of B no wider than its scale tiles)."""
        return self.b_2d and self.block_k % self.tile_n == 0

    @property
    def name(self) -> str:
        """A short name of the specialization (cache keys, logs)."""
        b = f"{self.block_k}x{self.block_k}" if self.b_2d else f"1x{self.block_k}"
        extra = ("_bias" if self.bias else "") + ("_acc" if self.accumulate else "")
        extra += "_overlap" if self.overlap else ""
        extra += f"_c{self.cluster_m}x1" if self.cluster_m > 1 else ""
        extra += "_mn" if self.mn_major_scales else ""
        extra += "_ws" if self.wide_stores else ""
        extra += "_grouped" if self.grouped else ""
        extra += "_kgrouped" if self.k_grouped else ""
        return (
            f"fp8gemm_{self.a_element}_1x{self.block_k}_{self.b_element}_{b}_{self.scale_kind}"
            f"_{self.out}{extra}_m{self.tile_m}n{self.tile_n}s{self.num_stages}"
        )


# ---- PTX helpers this kernel alone needs
@dsl_user_op
def lds_f32(addr: Int32, *, loc=None, ip=None) -> Float32:
    """One fp32 from shared memory."""
    res = inline_asm(
        ir.Type.parse("f32"),
        [ir_arg(addr, Int32, loc, ip)],
        "ld.shared.f32 $0, [$1];",
        "=f,r,~{memory}",
        True,
    )
    return Float32(res)


@dsl_user_op
def lds_v2_f32(addr: Int32, *, loc=None, ip=None) -> tuple[Float32, Float32]:
    """Two fp32 from shared memory (8-byte aligned)."""
    f32 = ir.Type.parse("f32")
    res = inline_asm(
        ir.Type.parse("!llvm.struct<(f32, f32)>"),
        [ir_arg(addr, Int32, loc, ip)],
        "ld.shared.v2.f32 {$0, $1}, [$2];",
        "=f,=f,r,~{memory}",
        True,
    )
    return (
        Float32(llvm.extractvalue(f32, res, [0], loc=loc, ip=ip)),
        Float32(llvm.extractvalue(f32, res, [1], loc=loc, ip=ip)),
    )


@dsl_user_op
def bits_to_f32(bits: Uint32, *, loc=None, ip=None) -> Float32:
    """The fp32 whose bits are ``bits``."""
    res = inline_asm(
        ir.Type.parse("f32"), [ir_arg(bits, Uint32, loc, ip)], "mov.b32 $0, $1;", "=f,r"
    )
    return Float32(res)


@dsl_user_op
def pack_bf16x2(lo: Float32, hi: Float32, *, loc=None, ip=None) -> Uint32:
    """Two fp32 rounded to nearest-even bf16 (each as a lone conversion would), ``lo`` in the
    low half: two neighbouring columns of C as memory holds them."""
    res = inline_asm(
        ir.Type.parse("i32"),
        [ir_arg(hi, Float32, loc, ip), ir_arg(lo, Float32, loc, ip)],
        "cvt.rn.bf16x2.f32 $0, $1, $2;",
        "=r,f,f",
    )
    return Uint32(res)


@dsl_user_op
def stg_v4_b32(
    addr: Int64, a: Uint32, b: Uint32, c: Uint32, d: Uint32, *, loc=None, ip=None
) -> None:
    """16 bytes to global memory (16-byte aligned)."""
    inline_asm(
        None,
        [ir_arg(addr, Int64, loc, ip)] + [ir_arg(v, Uint32, loc, ip) for v in (a, b, c, d)],
        "st.global.v4.b32 [$0], {$1, $2, $3, $4};",
        "l,r,r,r,r,~{memory}",
        True,
    )


@dsl_user_op
def stg_u16(addr: Int64, v: Uint32, *, loc=None, ip=None) -> None:
    """The low 2 bytes of ``v`` to global memory."""
    inline_asm(
        None,
        [ir_arg(addr, Int64, loc, ip), ir_arg(v, Uint32, loc, ip)],
        "{\n\t.reg .b16 h;\n\tcvt.u16.u32 h, $1;\n\tst.global.b16 [$0], h;\n\t}",
        "l,r,~{memory}",
        True,
    )


@dsl_user_op
def stg_v2_f32(addr: Int64, a: Float32, b: Float32, *, loc=None, ip=None) -> None:
    """Two fp32 to global memory (8-byte aligned)."""
    inline_asm(
        None,
        [ir_arg(addr, Int64, loc, ip), ir_arg(a, Float32, loc, ip), ir_arg(b, Float32, loc, ip)],
        "st.global.v2.f32 [$0], {$1, $2};",
        "l,f,f,~{memory}",
        True,
    )


@dsl_user_op
def ldg_v2_f32(addr: Int64, *, loc=None, ip=None) -> tuple[Float32, Float32]:
    """Two fp32 from global memory (8-byte aligned)."""
    f32 = ir.Type.parse("f32")
    res = inline_asm(
        ir.Type.parse("!llvm.struct<(f32, f32)>"),
        [ir_arg(addr, Int64, loc, ip)],
        "ld.global.v2.f32 {$0, $1}, [$2];",
        "=f,=f,l,~{memory}",
        True,
    )
    return (
        Float32(llvm.extractvalue(f32, res, [0], loc=loc, ip=ip)),
        Float32(llvm.extractvalue(f32, res, [1], loc=loc, ip=ip)),
    )


@cute.jit
def quad_transpose(words: list, q: Int32) -> list:
    """The 4 x 4 transpose of 32-bit words within each quad of lanes: lane q's word t
    becomes lane t's word q. Two butterfly rounds (lane distance 2, then 1), in each a lane
    keeps the half of its words on its own side and trades the other half."""
    a = list(words)
    for step in range_constexpr(2):
        k = 2 >> step
        upper = (q & k) != 0
        for t in range_constexpr(4):
            if const_expr(t & k == 0):
                send = cutlass.select_(upper, a[t], a[t ^ k])
                got = cute.arch.shuffle_sync_bfly(send, offset=k)
                keep_t, keep_tk = a[t], a[t ^ k]
                a[t] = cutlass.select_(upper, got, keep_t)
                a[t ^ k] = cutlass.select_(upper, keep_tk, got)
    return a


@cute.jit
def ue8m0_value(word: Uint32, byte: Int32) -> Float32:
    """Byte ``byte`` of ``word`` as a ue8m0 scale: 2^(code - 127) (fp32 exponent bits; code 0
    is the subnormal 2^-127, code 255 NaN)."""
    code = (word >> Uint32(byte * 8)) & Uint32(0xFF)
    bits = code << Uint32(23)
    bits = cutlass.select_(code == Uint32(0), Uint32(0x00400000), bits)
    bits = cutlass.select_(code == Uint32(0xFF), Uint32(0x7FC00000), bits)
    return bits_to_f32(bits)


class GemmSm90Fp8Kernel:
    """The block-scaled FP8 GEMM (module docstring):
    ``__call__(mA, mSFA, mB, mSFB, mGA, mGB, mC, max_ctas, stream)``; ``GemmSm90Fp8BiasKernel``
    adds ``mBias`` after ``mC``."""

    TAKES_BIAS: ClassVar[bool] = False
    GROUPED: ClassVar[bool] = False  # the launch takes the groups' offsets (grouped variant)
    K_GROUPED: ClassVar[bool] = False  # the launch takes the groups' K offsets (K-grouped)
    MMA_WARPGROUPS: ClassVar[int] = 2
    PRODUCER_WARP: ClassVar[int] = 8  # the first warp of the third warpgroup
    THREADS: ClassVar[int] = 384
    PRODUCER_REGS: ClassVar[int] = 40
    MMA_REGS: ClassVar[int] = 232

    def __init__(self, params: GemmSm90Fp8Params) -> None:
        if params.bias != self.TAKES_BIAS:
            raise ValueError(
                f"{type(self).__name__} takes bias={self.TAKES_BIAS}; the params say {params.bias}"
            )
        if params.k_grouped != self.K_GROUPED:
            raise ValueError(
                f"{type(self).__name__} takes k_grouped={self.K_GROUPED}; the params say "
                f"{params.k_grouped}"
            )
        if params.grouped != self.GROUPED:
            raise ValueError(
                f"{type(self).__name__} takes grouped={self.GROUPED}; the params say "
                f"{params.grouped}"
            )
        self.p = params
        self.a_dtype = ELEMENTS[params.a_element]
        self.b_dtype = ELEMENTS[params.b_element]
        self.out_dtype = OUTPUTS[params.out]

    @cute.jit
    def __call__(
        self,
        mA: cute.Tensor,  # uint8 [M, K]: FP8 codes
        mSFA: cute.Tensor,  # fp32 [M, KB] or uint8 [M, KB padded to 4]
        mB: cute.Tensor,  # uint8 [N, K]: FP8 codes
        mSFB: cute.Tensor,  # [N or ceil(N / block_k), KB (padded)]
        mGA: cute.Tensor,  # fp32 [1] S_a
        mGB: cute.Tensor,  # fp32 [1] S_b
        mC: cute.Tensor,  # out [M, N]
        max_ctas: Int32,  # the persistent grid's size limit (the GPU's SM count)
        stream: cuda.CUstream,
    ):
        self.launch(mA, mSFA, mB, mSFB, mGA, mGB, mC, None, max_ctas, stream)

    @cute.jit
    def launch(
        self,
        mA: cute.Tensor,
        mSFA: cute.Tensor,
        mB: cute.Tensor,
        mSFB: cute.Tensor,
        mGA: cute.Tensor,
        mGB: cute.Tensor,
        mC: cute.Tensor,
        mBias: cute.Tensor | None,
        max_ctas: Int32,
        stream: cuda.CUstream,
        mOffs: cute.Tensor | None = None,
    ):
        """The TMA atoms, shared-memory layouts and the persistent grid. The codes come as
        uint8 tensors (what every fp4gen kernel takes) and are read as their FP8 type.
        ``mOffs`` (grouped): the groups' first rows, int32 [G + 1]."""
        p = self.p
        mA = cute.make_tensor(cute.recast_ptr(mA.iterator, dtype=self.a_dtype), mA.layout)
        mB = cute.make_tensor(cute.recast_ptr(mB.iterator, dtype=self.b_dtype), mB.layout)
        stages = p.num_stages
        tiler = (p.tile_m, p.tile_n, p.tile_k)
        # two copies of one wgmma: one overwrites its accumulator (a K-block's first k-step),
        # one adds to it; each field set once, outside the loops (a field set inside a loop
        # region cannot be used in another)
        tiled_mma, mma_add = (
            sm90_utils.make_trivial_tiled_mma(
                self.a_dtype,
                self.b_dtype,
                cute.nvgpu.OperandMajorMode.K,
                cute.nvgpu.OperandMajorMode.K,
                Float32,
                (self.MMA_WARPGROUPS, 1, 1),
                tiler_mn=(64, p.tile_n),
            )
            for _ in range(2)
        )
        sA_layout = sm90_utils.make_smem_layout_a(LayoutEnum.ROW_MAJOR, tiler, self.a_dtype, stages)
        sB_layout = sm90_utils.make_smem_layout_b(LayoutEnum.ROW_MAJOR, tiler, self.b_dtype, stages)
        tma_atom_a, tma_a = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileG2SOp(),
            mA,
            cute.slice_(sA_layout, (None, None, 0)),
            (p.tile_m, p.tile_k),
        )
        if const_expr(p.cluster_m > 1):  # each CTA loads 1 / cluster_m of B, multicast
            tma_atom_b, tma_b = cpasync.make_tiled_tma_atom(
                cpasync.CopyBulkTensorTileG2SMulticastOp(),
                mB,
                cute.slice_(sB_layout, (None, None, 0)),
                (p.tile_n, p.tile_k),
                num_multicast=p.cluster_m,
            )
        else:
            tma_atom_b, tma_b = cpasync.make_tiled_tma_atom(
                cpasync.CopyBulkTensorTileG2SOp(),
                mB,
                cute.slice_(sB_layout, (None, None, 0)),
                (p.tile_n, p.tile_k),
            )

        @cute.struct
        class SharedStorage:
            full: cute.struct.MemRange[Int64, stages]
            empty: cute.struct.MemRange[Int64, stages]
            sSF: cute.struct.Align[cute.struct.MemRange[Uint8, p.sf_stage_bytes * stages], 16]
            sA: cute.struct.Align[cute.struct.MemRange[self.a_dtype, cute.cosize(sA_layout)], 1024]
            sB: cute.struct.Align[cute.struct.MemRange[self.b_dtype, cute.cosize(sB_layout)], 1024]

        self.shared_storage = SharedStorage

        m_tiles = (mC.shape[0] + (p.tile_m - 1)) // p.tile_m
        n_tiles = (mC.shape[1] + (p.tile_n - 1)) // p.tile_n
        units = (m_tiles + (p.cluster_m - 1)) // p.cluster_m * n_tiles  # a cluster's tiles
        if const_expr(p.grouped):  # at most one partial M-tile more per group
            units = (m_tiles + mOffs.shape[0] - 1) * n_tiles
        if const_expr(p.k_grouped):  # C: the groups' [M, N] stacked, every group's tiles
            groups = mOffs.shape[0] - 1
            m_tiles = (mC.shape[0] // groups + (p.tile_m - 1)) // p.tile_m
            units = groups * m_tiles * n_tiles
        ctas = cutlass.min(units, max_ctas // p.cluster_m) * p.cluster_m
        self.kernel(
            tma_atom_a,
            tma_a,
            tma_atom_b,
            tma_b,
            mSFA,
            mSFB,
            mGA,
            mGB,
            mC,
            mBias,
            tiled_mma,
            mma_add,
            sA_layout,
            sB_layout,
            mOffs,
        ).launch(
            grid=[ctas, 1, 1],
            block=[self.THREADS, 1, 1],
            cluster=[p.cluster_m, 1, 1],
            min_blocks_per_mp=1,
            stream=stream,
        )

    # ---- device side
    @cute.jit
    def tile_origin(self, t, m_tiles, n_tiles):
        """Output tile t's first row and column: groups of group_m M-tiles, M fastest inside a
        group (neighbouring CTAs share B tiles and, across a group, A tiles in L2)."""
        p = self.p
        per_group = p.group_m * n_tiles
        group = t // per_group
        first_m = group * p.group_m
        group_size = cutlass.min(m_tiles - first_m, p.group_m)
        in_group = t - group * per_group
        m_tile = first_m + in_group % group_size
        n_tile = in_group // group_size
        return m_tile, n_tile

    @cute.kernel
    def kernel(
        self,
        tma_atom_a: cute.CopyAtom,
        mA_tma: cute.Tensor,
        tma_atom_b: cute.CopyAtom,
        mB_tma: cute.Tensor,
        mSFA: cute.Tensor,
        mSFB: cute.Tensor,
        mGA: cute.Tensor,
        mGB: cute.Tensor,
        mC: cute.Tensor,
        mBias: cute.Tensor | None,
        tiled_mma: cute.TiledMma,
        mma_add: cute.TiledMma,
        sA_layout: cute.ComposedLayout,
        sB_layout: cute.ComposedLayout,
        mOffs: cute.Tensor | None,
    ):
        p = self.p
        stages = p.num_stages
        kpb = p.ktiles_per_block
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        nctas, _, _ = cute.arch.grid_dim()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        wg_idx = warp_idx // 4
        lane = cute.arch.lane_idx()

        M = mC.shape[0]
        N = mC.shape[1]
        m_tiles = (M + (p.tile_m - 1)) // p.tile_m
        n_tiles = (N + (p.tile_n - 1)) // p.tile_n
        # a cluster computes cluster_m vertically adjacent tiles (a unit); the clusters walk
        # the units u = cluster, cluster + clusters, ...; this CTA takes row rank of each
        m_units = (m_tiles + (p.cluster_m - 1)) // p.cluster_m
        units = m_units * n_tiles
        if const_expr(p.grouped):  # every group's tiles (gemm_sm90_fp8_grouped)
            units = self.group_tile_count(mOffs, n_tiles)
        if const_expr(
            p.k_grouped
        ):  # C [groups x M, N]: each group's M rows (gemm_sm90_fp8_kgrouped)
            M = M // (mOffs.shape[0] - 1)
            m_tiles = (M + (p.tile_m - 1)) // p.tile_m
            units = (mOffs.shape[0] - 1) * m_tiles * n_tiles
        rank = bidx % p.cluster_m
        cluster = bidx // p.cluster_m
        clusters = nctas // p.cluster_m
        my_tiles = (units - cluster + clusters - 1) // clusters

        gA = cute.local_tile(mA_tma, (p.tile_m, p.tile_k), (None, None))  # (tm, tk, m, k)
        gB = cute.local_tile(mB_tma, (p.tile_n, p.tile_k), (None, None))
        k_tiles = cute.size(gA, mode=[3])
        k_blocks = k_tiles // kpb

        # ---- shared memory and the stage barriers
        smem = cutlass.memory.SmemAllocator()
        storage = smem.allocate(self.shared_storage)
        full = storage.full.data_ptr()
        empty = storage.empty.data_ptr()
        if tidx == 0:
            for i in range_constexpr(stages):
                cute.arch.mbarrier_init(full + i, 33)  # expect_tx arrive + 32 cp.async arrives
                # one arrival per MMA warp of each CTA that reads the stage's multicast half
                cute.arch.mbarrier_init(empty + i, 4 * self.MMA_WARPGROUPS * p.cluster_m)
            cute.arch.mbarrier_init_fence()
        if warp_idx == self.PRODUCER_WARP:
            cpasync.prefetch_descriptor(tma_atom_a)
            cpasync.prefetch_descriptor(tma_atom_b)
        if const_expr(p.cluster_m > 1):  # the peer's barriers initialized before any multicast
            cute.arch.cluster_arrive()
            cute.arch.cluster_wait()
        else:
            cute.arch.barrier()

        sA = storage.sA.get_tensor(sA_layout.outer, swizzle=sA_layout.inner)
        sB = storage.sB.get_tensor(sB_layout.outer, swizzle=sB_layout.inner)
        sf_base = storage.sSF.data_ptr().toint()

        # ============================================================== producer warpgroup
        if wg_idx == self.MMA_WARPGROUPS:
            cute.arch.setmaxregister_decrease(self.PRODUCER_REGS)
        if warp_idx == self.PRODUCER_WARP:
            tAsA, tAgA = cpasync.tma_partition(
                tma_atom_a,
                0,
                cute.make_layout(1),
                cute.group_modes(sA, 0, 2),
                cute.group_modes(gA, 0, 2),
            )
            tBsB, tBgB = cpasync.tma_partition(
                tma_atom_b,
                rank,  # this CTA's 1 / cluster_m of the B tile, multicast to the cluster
                cute.make_layout(p.cluster_m),
                cute.group_modes(sB, 0, 2),
                cute.group_modes(gB, 0, 2),
            )
            tx_bytes = (p.tile_m + p.tile_n) * p.tile_k
            sfa_g = mSFA.iterator.toint()
            sfb_g = mSFB.iterator.toint()
            sfa_cols = mSFA.shape[1]
            sfb_cols = mSFB.shape[1]
            last_a = mSFA.shape[0] - 1
            last_b = mSFB.shape[0] - 1
            if const_expr(p.grouped):  # the walk's group, its first tile and its M-tiles
                g, first, mt = self.walk_start(mOffs)
            if const_expr(p.k_grouped):  # the stages used by the tiles before this one
                s_base = Int32(0)
                g, k0, tile_k_tiles = Int32(0), Int32(0), Int32(0)  # set per tile
            for i in cutlass.range(my_tiles, unroll=1):
                if const_expr(p.grouped):
                    t = cluster + i * clusters
                    g, first, mt = self.walk_to(t, g, first, mt, mOffs, n_tiles)
                    m_tile, n_tile = self.tile_origin(t - first, mt, n_tiles)
                    m0 = mOffs[g] + m_tile * p.tile_m  # A's and C's row
                    n0 = n_tile * p.tile_n  # the column in the group's [N, K] B
                    b_row0 = g * self.b_scale_rows(N)  # the group's first scale row of B
                    tAgA_t = self.rows_at(tma_atom_a, mA_tma, sA, m0, p.tile_m)
                    tBgB_t = self.rows_at(tma_atom_b, mB_tma, sB, g * N + n0, p.tile_n)
                elif const_expr(p.k_grouped):
                    g, m_tile, n_tile = self.k_group_tile(cluster + i * clusters, m_tiles, n_tiles)
                    m0 = m_tile * p.tile_m
                    n0 = n_tile * p.tile_n
                    k0, tile_k_tiles = self.k_group_range(mOffs, g)
                else:
                    m_unit, n_tile = self.tile_origin(cluster + i * clusters, m_units, n_tiles)
                    m_tile = m_unit * p.cluster_m + rank
                    m0 = m_tile * p.tile_m
                    n0 = n_tile * p.tile_n
                n_kt = k_tiles
                if const_expr(p.k_grouped):
                    n_kt = tile_k_tiles
                for kt in cutlass.range(n_kt, unroll=1):
                    if const_expr(p.k_grouped):  # noqa: SIM108 (the DSL traces statements)
                        s_lin = s_base + kt
                    else:
                        s_lin = i * k_tiles + kt
                    st = s_lin % stages
                    cute.arch.mbarrier_wait(empty + st, ((s_lin // stages) & 1) ^ 1)
                    with cute.arch.elect_one():
                        cute.arch.mbarrier_arrive_and_expect_tx(full + st, tx_bytes)
                    # cute.copy elects its own thread: called by the whole warp
                    if const_expr(p.grouped):  # the group's rows, at any offset
                        cute.copy(tma_atom_a, tAgA_t[(None, kt)], tAsA[(None, st)],
                                  tma_bar_ptr=full + st)  # fmt: skip
                        cute.copy(tma_atom_b, tBgB_t[(None, kt)], tBsB[(None, st)],
                                  tma_bar_ptr=full + st)  # fmt: skip
                    elif const_expr(p.k_grouped):  # the group's k-tiles, from its first on
                        cute.copy(tma_atom_a, tAgA[(None, m_tile, k0 + kt)], tAsA[(None, st)],
                                  tma_bar_ptr=full + st)  # fmt: skip
                        cute.copy(tma_atom_b, tBgB[(None, n_tile, k0 + kt)], tBsB[(None, st)],
                                  tma_bar_ptr=full + st)  # fmt: skip
                    else:
                        cute.copy(tma_atom_a, tAgA[(None, m_tile, kt)], tAsA[(None, st)],
                                  tma_bar_ptr=full + st)  # fmt: skip
                        if const_expr(p.cluster_m > 1):
                            cute.copy(tma_atom_b, tBgB[(None, n_tile, kt)], tBsB[(None, st)],
                                      tma_bar_ptr=full + st,
                                      mcast_mask=cutlass.Int16((1 << p.cluster_m) - 1))  # fmt: skip
                        else:
                            cute.copy(tma_atom_b, tBgB[(None, n_tile, kt)], tBsB[(None, st)],
                                      tma_bar_ptr=full + st)  # fmt: skip
                    # the block scales of the k-tile's K-block
                    if const_expr(p.k_grouped):  # noqa: SIM108 (the DSL traces statements)
                        kb = (k0 + kt) // kpb
                    else:
                        kb = kt // kpb
                    if const_expr(p.mn_major_scales):
                        sf_dst = sf_base + st * p.sf_stage_bytes
                        self.copy_scales_mn_major(sf_dst, sfa_g, mSFA.shape[1], m0, kb, lane,
                                                  p.tile_m)  # fmt: skip
                        if const_expr(p.b_mn_major):
                            b_dst = sf_dst + p.tile_m * 4
                            self.copy_scales_mn_major(b_dst, sfb_g, mSFB.shape[1], n0, kb,
                                                      lane, p.tile_n)  # fmt: skip
                        else:
                            self.copy_scales_by_row(sf_base, st, sfa_g, sfb_g, sfa_cols,
                                                    sfb_cols, last_a, last_b, m0, n0, kb, lane,
                                                    False)  # fmt: skip
                    else:
                        self.copy_scales_by_row(sf_base, st, sfa_g, sfb_g, sfa_cols, sfb_cols,
                                                last_a, last_b, m0, n0, kb, lane, True,
                                                b_row0=b_row0 if const_expr(p.grouped)
                                                else None)  # fmt: skip
                    cute.arch.cp_async_mbarrier_arrive_noinc(full + st)
                if const_expr(p.k_grouped):
                    s_base = s_base + tile_k_tiles
            cute.arch.cp_async_wait_group(0)

        # ============================================================== MMA warpgroups
        if wg_idx < self.MMA_WARPGROUPS:
            cute.arch.setmaxregister_increase(self.MMA_REGS)
            tiled_mma.set(warpgroup.Field.ACCUMULATE, False)
            mma_add.set(warpgroup.Field.ACCUMULATE, True)
            mmas = (tiled_mma, mma_add)
            thr_wg = tiled_mma.get_slice(wg_idx * 128)
            tCrA = tiled_mma.make_fragment_A(thr_wg.partition_A(sA))
            tCrB = tiled_mma.make_fragment_B(thr_wg.partition_B(sB))
            cC = cute.make_identity_tensor((p.tile_m, p.tile_n))
            tCcC = tiled_mma.get_slice(tidx).partition_C(cC)
            total = cute.make_rmem_tensor(tCcC.shape, Float32)
            partial = cute.make_rmem_tensor(tCcC.shape, Float32)
            parts = [partial]
            if const_expr(p.overlap):
                parts.append(cute.make_rmem_tensor(tCcC.shape, Float32))
            num_kk = cute.size(tCrA, mode=[2])  # wgmma k-steps per k-tile
            # the accumulator of m64 n{tile_n}: element v0 + 2 v1 + 4 j holds row r0 + 8 v1,
            # column c_j + v0 (c_j = 2 (lane % 4) + 8 j), as tCcC says
            row0, _ = tCcC[0]
            row1, _ = tCcC[2]
            cols = []
            for j in range_constexpr(p.tile_n // 8):
                _, c = tCcC[4 * j]
                cols.append(c)
            alpha = mGA[0] * mGB[0]
            if const_expr(p.grouped):  # the same walk as the producer's
                g, first, mt = self.walk_start(mOffs)
            if const_expr(p.k_grouped):
                s_base = Int32(0)
                g, k0, tile_k_tiles = Int32(0), Int32(0), Int32(0)  # set per tile
            for i in cutlass.range(my_tiles, unroll=1):
                if const_expr(p.k_grouped):
                    g, m_tile, n_tile = self.k_group_tile(cluster + i * clusters, m_tiles, n_tiles)
                    m0 = m_tile * p.tile_m
                    n0 = n_tile * p.tile_n
                    k0, tile_k_tiles = self.k_group_range(mOffs, g)
                    # the group's S_a S_b; its [M, N] of C from row g M
                    tile_alpha, m_end, tile_bias = mGA[g] * mGB[g], M, mBias
                elif const_expr(p.grouped):
                    t = cluster + i * clusters
                    g, first, mt = self.walk_to(t, g, first, mt, mOffs, n_tiles)
                    m_tile, n_tile = self.tile_origin(t - first, mt, n_tiles)
                    m0 = mOffs[g] + m_tile * p.tile_m
                    n0 = n_tile * p.tile_n
                    # the group's S_a S_b, last row (rows past it are the next group's) and bias
                    tile_alpha = mGA[g] * mGB[g]
                    m_end = mOffs[g + 1]
                    tile_bias = self.group_bias(mBias, g, N)
                else:
                    m_unit, n_tile = self.tile_origin(cluster + i * clusters, m_units, n_tiles)
                    m_tile = m_unit * p.cluster_m + rank
                    m0 = m_tile * p.tile_m
                    n0 = n_tile * p.tile_n
                    tile_alpha, m_end, tile_bias = alpha, M, mBias
                total.fill(0.0)
                if const_expr(p.overlap):
                    ks = (full, empty, sf_base, lane, i * k_tiles, row0, row1, cols, n0)
                    # block b into parts[b % 2] while block b - 1 is promoted
                    self.issue_block(mmas, parts[0], tCrA, tCrB, ks, 0)
                    for q in cutlass.range((k_blocks - 1) // 2, unroll=1):
                        for h in range_constexpr(2):
                            blk = 1 + 2 * q + h
                            self.issue_block(mmas, parts[1 - h], tCrA, tCrB, ks, blk)
                            warpgroup.wait_group(1)  # block blk - 1 done
                            self.finish_block(total, parts[h], ks, blk - 1)
                    if k_blocks % 2 == 0:  # an odd block left: it goes to parts[1]
                        self.issue_block(mmas, parts[1], tCrA, tCrB, ks, k_blocks - 1)
                        warpgroup.wait_group(1)
                        self.finish_block(total, parts[0], ks, k_blocks - 2)
                        warpgroup.wait_group(0)
                        self.finish_block(total, parts[1], ks, k_blocks - 1)
                    else:
                        warpgroup.wait_group(0)
                        self.finish_block(total, parts[0], ks, k_blocks - 1)
                n_blocks = k_blocks
                if const_expr(p.k_grouped):
                    n_blocks = tile_k_tiles // kpb
                for blk in cutlass.range(0 if const_expr(p.overlap) else n_blocks, unroll=1):
                    for sub in range_constexpr(kpb):
                        if const_expr(p.k_grouped):
                            s_lin = s_base + blk * kpb + sub
                        else:
                            s_lin = i * k_tiles + blk * kpb + sub
                        st = s_lin % stages
                        cute.arch.mbarrier_wait(full + st, (s_lin // stages) & 1)
                        warpgroup.fence()
                        for kk in range_constexpr(num_kk):
                            # the block's first wgmma overwrites the partial sum
                            cute.gemm(
                                mmas[int(sub > 0 or kk > 0)],
                                partial,
                                tCrA[(None, None, kk, st)],
                                tCrB[(None, None, kk, st)],
                                partial,
                            )
                        warpgroup.commit_group()
                        if const_expr(sub == kpb - 1):
                            kb = blk
                            if const_expr(p.k_grouped):  # the K-block's column of the scales
                                kb = k0 // kpb + blk
                            sa, sb = self.block_scales(sf_base + st * p.sf_stage_bytes,
                                                       kb, row0, row1, cols, n0)  # fmt: skip
                        warpgroup.wait_group(0)
                        self.release(empty + st, lane)
                    self.promote(total, partial, sa, sb)

                # ---- epilogue: registers -> global, predicated
                if const_expr(p.wide_stores and p.k_grouped):  # the group's own C
                    c0 = g * M + m0
                    self.store_tile_wide(mC, tile_bias, total, tile_alpha,
                                         (c0 + row0, c0 + row1), n0, cols, lane,
                                         g * M + M)  # fmt: skip
                elif const_expr(p.wide_stores):
                    self.store_tile_wide(mC, tile_bias, total, tile_alpha,
                                         (m0 + row0, m0 + row1), n0, cols, lane,
                                         m_end if const_expr(p.grouped) else None)  # fmt: skip
                else:
                    for e in range_constexpr(cute.size(total)):
                        mm, nn = tCcC[e]
                        gm = m0 + mm
                        gn = n0 + nn
                        if (gm < m_end) & (gn < N):
                            if const_expr(p.k_grouped):  # the group's own C
                                self.store_output(mC, tile_bias, g * M + gm, gn,
                                                  total[e] * tile_alpha)  # fmt: skip
                            else:
                                self.store_output(mC, tile_bias, gm, gn, total[e] * tile_alpha)
                if const_expr(p.k_grouped):
                    s_base = s_base + tile_k_tiles

        if const_expr(p.cluster_m > 1):  # no CTA leaves while its peer may still arrive on it
            cute.arch.cluster_arrive()
            cute.arch.cluster_wait()

    @cute.jit
    def k_group_tile(self, t, m_tiles, n_tiles):
        """K-grouped: tile t's group and its M- and N-tile (every group has m_tiles x n_tiles
        tiles, group by group, each rasterized as the dense kernel's)."""
        per_group = m_tiles * n_tiles
        g = t // per_group
        m_tile, n_tile = self.tile_origin(t - g * per_group, m_tiles, n_tiles)
        return g, m_tile, n_tile

    @cute.jit
    def k_group_range(self, mOffs: cute.Tensor, g):
        """K-grouped: group g's first k-tile and its k-tiles (its K offsets are whole
        K-blocks: checked by the host)."""
        p = self.p
        return mOffs[g] // p.tile_k, (mOffs[g + 1] - mOffs[g]) // p.tile_k

    @cute.jit
    def copy_scales_by_row(
        self, sf_base, st, sfa_g, sfb_g, sfa_cols, sfb_cols, last_a, last_b, m0, n0, kb, lane,
        with_a: cutlass.Constexpr, b_row0=None,
    ):  # fmt: skip
        """The K-block's scales from the row-major [R, KB] tensors into stage ``st``: one
        4-byte cp.async per row of A (``with_a``: else B's alone) and per column of C (B's
        row, or n // block_k for tiles; with MN-major A scales and one or two B scales per
        tile, only the words the consumers read). Rows past M / N are clamped to the last
        (they only feed outputs that are never stored). ``b_row0`` (grouped): the group's first
        row of B's scales."""
        p = self.p
        if const_expr(p.scale_kind == "fp32"):  # noqa: SIM108 (the DSL traces statements)
            col_bytes = kb * 4
        else:
            col_bytes = kb & ~3  # the aligned word holding the code
        elem = p.scale_bytes
        sf_dst = sf_base + st * p.sf_stage_bytes
        if const_expr(p.mn_major_scales and p.b_scale_per_tile):  # one word: one lane
            if lane == 0:
                row_b = cutlass.min(n0 // p.block_k, last_b)
                src = sfb_g + Int64(row_b) * Int64(sfb_cols * elem) + Int64(col_bytes)
                cp_async(sf_dst + p.tile_m * 4, src, 4)
        elif const_expr(p.mn_major_scales and p.b_scale_pair):
            # the words the consumers read: the first and the last column's (lanes 0 and 1)
            if lane < 2:
                col = lane * (p.tile_n - 1)
                row_b = cutlass.min((n0 + col) // p.block_k, last_b)
                src = sfb_g + Int64(row_b) * Int64(sfb_cols * elem) + Int64(col_bytes)
                cp_async(sf_dst + (p.tile_m + col) * 4, src, 4)
        else:
            for j in range_constexpr((p.tile_m + p.tile_n) // 32):
                row = lane + 32 * j
                if const_expr(32 * (j + 1) <= p.tile_m):  # rows of A
                    if const_expr(with_a):
                        grow = cutlass.min(m0 + row, last_a)
                        src = sfa_g + Int64(grow) * Int64(sfa_cols * elem) + Int64(col_bytes)
                        cp_async(sf_dst + row * 4, src, 4)
                else:  # columns of C: rows of B or of its scale tiles
                    n = n0 + (row - p.tile_m)
                    if const_expr(p.b_2d):
                        n = n // p.block_k
                    if const_expr(b_row0 is not None):  # grouped: the group's scale rows
                        n = b_row0 + n
                    grow = cutlass.min(n, last_b)
                    src = sfb_g + Int64(grow) * Int64(sfb_cols * elem) + Int64(col_bytes)
                    cp_async(sf_dst + row * 4, src, 4)

    @cute.jit
    def copy_scales_mn_major(self, dst, sf_g, pitch, r0, kb, lane, rows: cutlass.Constexpr):
        """K-block ``kb``'s scales of rows r0 .. r0 + rows - 1 from an MN-major [KB, pitch]
        tensor into ``dst`` (packed: row r at r * scale_bytes): 16-byte cp.async, each lane one
        chunk of 16 / scale_bytes rows (pitch is a multiple of that). A chunk past the tensor's
        end is read from its last chunk instead (rows past M / N only feed outputs that are
        never stored)."""
        p = self.p
        per_chunk = p.rows_per_chunk
        chunks = rows // per_chunk
        row_base = Int64(kb) * Int64(pitch)
        for j in range_constexpr((chunks + 31) // 32):
            c = lane + 32 * j
            if c < chunks:
                start = cutlass.min(r0 + c * per_chunk, pitch - per_chunk)
                src = sf_g + (row_base + Int64(start)) * Int64(p.scale_bytes)
                cp_async(dst + c * 16, src, 16)

    @cute.jit
    def issue_block(self, mmas, acc, tCrA, tCrB, ks, blk):
        """The wgmma of K-block ``blk`` into ``acc`` (its first one overwrites it), one commit
        group; its stages stay held until ``finish_block``."""
        p = self.p
        full, _, _, _, tile_stage0, _, _, _, _ = ks
        for sub in range_constexpr(p.ktiles_per_block):
            s_lin = tile_stage0 + blk * p.ktiles_per_block + sub
            st = s_lin % p.num_stages
            cute.arch.mbarrier_wait(full + st, (s_lin // p.num_stages) & 1)
            warpgroup.fence()
            for kk in range_constexpr(p.tile_k // 32):
                mma = mmas[int(sub > 0 or kk > 0)]  # the block's first overwrites acc
                cute.gemm(mma, acc, tCrA[(None, None, kk, st)], tCrB[(None, None, kk, st)], acc)
        warpgroup.commit_group()

    @cute.jit
    def finish_block(self, total, acc, ks, blk):
        """K-block ``blk``'s wgmma are done: its scales from its last stage, its stages
        released, ``acc`` promoted into ``total``."""
        p = self.p
        _, empty, sf_base, lane, tile_stage0, row0, row1, cols, n0 = ks
        last = tile_stage0 + blk * p.ktiles_per_block + p.ktiles_per_block - 1
        st_last = last % p.num_stages
        base = sf_base + st_last * p.sf_stage_bytes
        sa, sb = self.block_scales(base, blk, row0, row1, cols, n0)
        for sub in range_constexpr(p.ktiles_per_block):
            self.release(empty + (last - sub) % p.num_stages, lane)
        self.promote(total, acc, sa, sb)

    @cute.jit
    def release(self, empty_st, lane):
        """This warp is done with a stage: one arrival on its empty barrier in each CTA of the
        cluster (the producers there multicast into this CTA's copy of the stage)."""
        if const_expr(self.p.cluster_m > 1):
            if lane < self.p.cluster_m:
                cute.arch.mbarrier_arrive(empty_st, peer_cta_rank_in_cluster=lane)
        else:
            if lane == 0:
                cute.arch.mbarrier_arrive(empty_st)

    @cute.jit
    def block_scales(self, base: Int32, kb, row0, row1, cols: list, n0):
        """The K-block's scales this thread needs from the stage at ``base``: s_a of its two
        rows and s_b of its columns (pairs (c_j, c_j + 1), one value per tile, or with
        ``b_scale_pair`` the tile's two B scales and the column where the second begins)."""
        p = self.p
        b0 = base + p.tile_m * 4
        if const_expr(p.scale_kind == "fp32"):
            sa = (lds_f32(base + row0 * 4), lds_f32(base + row1 * 4))
        elif const_expr(p.mn_major_scales):  # codes packed one per row: row r's is byte r
            sa = tuple(ue8m0_value(lds_u32(base + (r & ~3)), r & 3) for r in (row0, row1))
        else:
            byte = kb & 3
            sa = (
                ue8m0_value(lds_u32(base + row0 * 4), byte),
                ue8m0_value(lds_u32(base + row1 * 4), byte),
            )
        if const_expr(p.b_scale_pair):  # by rows: column c's scale in the word at b0 + 4 c
            lo = self.b_tile_scale(b0, kb)
            hi = self.b_tile_scale(b0 + (p.tile_n - 1) * 4, kb)
            sb = (lo, hi, p.block_k - n0 % p.block_k)
        elif const_expr(p.scale_kind == "fp32"):
            if const_expr(p.b_scale_per_tile):
                sb = lds_f32(b0)
            else:
                sb = [lds_v2_f32(b0 + c * 4) for c in cols]
        elif const_expr(p.b_mn_major):  # columns c, c + 1 (c even): bytes of one word
            sb = []
            for c in cols:
                word = lds_u32(b0 + (c & ~3))
                sb.append((ue8m0_value(word, c & 3), ue8m0_value(word, (c & 3) + 1)))
        elif const_expr(p.b_scale_per_tile):
            sb = self.b_tile_scale(b0, kb)
        else:
            byte = kb & 3
            sb = [
                (
                    ue8m0_value(lds_u32(b0 + c * 4), byte),
                    ue8m0_value(lds_u32(b0 + c * 4 + 4), byte),
                )
                for c in cols
            ]
        return sa, sb

    @cute.jit
    def b_tile_scale(self, addr, kb):
        """A B scale copied by rows: the fp32 factor at ``addr``, or the ue8m0 code of K-block
        ``kb`` in the word there."""
        if const_expr(self.p.scale_kind == "fp32"):
            value = lds_f32(addr)
        else:
            value = ue8m0_value(lds_u32(addr), kb & 3)
        return value

    @cute.jit
    def promote(self, total: cute.Tensor, partial: cute.Tensor, sa, sb):
        """total += partial * fp32(s_a s_b), element by element."""
        p = self.p
        if const_expr(p.b_scale_pair):
            # column group j (8 columns, never split: the boundary is a multiple of 32) takes
            # the second B scale from the boundary on; before the smallest boundary (the gcd
            # of tile_n and block_k) always the first, from block_k on always the second
            lo, hi, boundary = sb
            s_lo = (sa[0] * lo, sa[1] * lo)
            s_hi = (sa[0] * hi, sa[1] * hi)
            first_split = math.gcd(p.tile_n, p.block_k)
            for j in range_constexpr(p.tile_n // 8):
                for v1 in range_constexpr(2):
                    if const_expr(8 * j + 8 <= first_split):
                        s = s_lo[v1]
                    elif const_expr(8 * j >= p.block_k):
                        s = s_hi[v1]
                    else:
                        s = cutlass.select_(8 * j >= boundary, s_hi[v1], s_lo[v1])
                    for v0 in range_constexpr(2):
                        e = v0 + 2 * v1 + 4 * j
                        total[e] = total[e] + partial[e] * s
        else:
            for j in range_constexpr(p.tile_n // 8):
                for v1 in range_constexpr(2):
                    for v0 in range_constexpr(2):
                        e = v0 + 2 * v1 + 4 * j
                        s_b = sb if const_expr(p.b_scale_per_tile) else sb[j][v0]
                        s = sa[v1] * s_b
                        total[e] = total[e] + partial[e] * s

    @cute.jit
    def store_tile_wide(
        self, mC, mBias, total, alpha, rows: tuple, n0, cols: list, lane, m_end=None
    ):
        """The epilogue with whole-sector stores (``wide_stores``): y = total * alpha
        (+ bias[n]) (+ C[m, n]) in fp32 as ``store_output`` computes it, then fp32 column pairs
        as 8-byte stores (a quad's 4 lanes: 32 contiguous bytes of a row), or bf16 pairs packed
        and transposed within the quad so that each lane holds 8 contiguous columns: 16-byte
        stores (a quad: 64 bytes of a row). Where a row's columns reach past N or N breaks the
        alignment, the same values element by element. ``m_end`` (grouped, K-grouped): the group's
        end in C, the rows stored are those below it."""
        p = self.p
        M = mC.shape[0]
        if const_expr(m_end is not None):
            M = m_end
        N = mC.shape[1]
        c_addr = mC.iterator.toint()
        if const_expr(p.out == "fp32"):
            for v1 in range_constexpr(2):
                gm = rows[v1]
                row_addr = c_addr + Int64(gm) * Int64(N) * Int64(4)
                for j in range_constexpr(p.tile_n // 8):
                    gn = n0 + cols[j]
                    e0 = 2 * v1 + 4 * j
                    if gm < M:
                        if ((N & 1) == 0) & (gn + 1 < N):  # 8-byte aligned, both in C
                            y0 = total[e0] * alpha
                            y1 = total[e0 + 1] * alpha
                            if const_expr(p.bias):
                                y0 = y0 + mBias[gn]
                                y1 = y1 + mBias[gn + 1]
                            addr = row_addr + Int64(gn) * Int64(4)
                            if const_expr(p.accumulate):
                                c0, c1 = ldg_v2_f32(addr)
                                y0 = y0 + c0
                                y1 = y1 + c1
                            stg_v2_f32(addr, y0, y1)
                        else:
                            for v0 in range_constexpr(2):
                                if gn + v0 < N:
                                    self.store_output(mC, mBias, gm, gn + v0,
                                                      total[e0 + v0] * alpha)  # fmt: skip
        else:
            q = lane & 3
            last_n = N - 1
            for v1 in range_constexpr(2):
                gm = rows[v1]
                gm_in = cutlass.min(gm, M - 1)  # reads of C stay inside it
                words = []
                for j in range_constexpr(p.tile_n // 8):
                    gn = n0 + cols[j]
                    ys = []
                    for v0 in range_constexpr(2):
                        y = total[v0 + 2 * v1 + 4 * j] * alpha
                        gn_in = cutlass.min(gn + v0, last_n)  # past N: never stored
                        if const_expr(p.bias):
                            y = y + mBias[gn_in]
                        if const_expr(p.accumulate):
                            y = y + Float32(mC[gm_in, gn_in])
                        ys.append(y)
                    words.append(pack_bf16x2(ys[0], ys[1]))
                row_addr = c_addr + Int64(gm) * Int64(N) * Int64(2)
                for g in range_constexpr(p.tile_n // 32):
                    # lane q: columns 8 (4 g + q) .. + 7 of the row, from the quad's words
                    w = quad_transpose(words[4 * g : 4 * g + 4], q)
                    gc = n0 + 32 * g + 8 * q
                    addr = row_addr + Int64(gc) * Int64(2)
                    if gm < M:
                        if ((N & 7) == 0) & (gc + 8 <= N):  # 16-byte aligned, all in C
                            stg_v4_b32(addr, w[0], w[1], w[2], w[3])
                        else:
                            for t in range_constexpr(4):
                                for h in range_constexpr(2):
                                    if gc + (2 * t + h) < N:
                                        stg_u16(addr + Int64(2 * (2 * t + h)),
                                                w[t] >> Uint32(16 * h))  # fmt: skip

    @cute.jit
    def store_output(self, mC: cute.Tensor, mBias: cute.Tensor | None, gm, gn, y: Float32):
        """C[gm, gn] = y (+ bias[gn]) (+ C[gm, gn]) in fp32, one rounding to C's dtype."""
        p = self.p
        if const_expr(p.bias):
            y = y + mBias[gn]
        if const_expr(p.accumulate):
            y = y + Float32(mC[gm, gn])
        mC[gm, gn] = self.out_dtype(y)


class GemmSm90Fp8BiasKernel(GemmSm90Fp8Kernel):
    """The kernel with a bias: ``__call__(mA, mSFA, mB, mSFB, mGA, mGB, mC, mBias, max_ctas,
    stream)`` with mBias fp32 [N]."""

    TAKES_BIAS: ClassVar[bool] = True

    @cute.jit
    def __call__(
        self,
        mA: cute.Tensor,
        mSFA: cute.Tensor,
        mB: cute.Tensor,
        mSFB: cute.Tensor,
        mGA: cute.Tensor,
        mGB: cute.Tensor,
        mC: cute.Tensor,
        mBias: cute.Tensor,
        max_ctas: Int32,
        stream: cuda.CUstream,
    ):
        self.launch(mA, mSFA, mB, mSFB, mGA, mGB, mC, mBias, max_ctas, stream)


def compile_options(arch: str, dump_dir: str | None) -> str:
    """The ``cute.compile`` options of an FP8 GEMM variant for ``arch`` (sm_90a only), with the
    PTX kept in ``dump_dir`` (created if missing) where given."""
    if arch != "sm_90a":
        raise ValueError(f"unsupported arch {arch!r}: the FP8 wgmma kernel is sm_90a's")
    options = f"--enable-tvm-ffi --gpu-arch {arch}"
    if dump_dir is not None:
        os.makedirs(dump_dir, exist_ok=True)
        options += f" --keep-ptx --dump-dir {shlex.quote(os.fspath(dump_dir))}"
    return options


def tile_origin_of(local: int, m_tiles: int, n_tiles: int, group_m: int) -> tuple[int, int]:
    """``GemmSm90Fp8Kernel.tile_origin`` in Python (the CPU tests' tile walks): the M- and
    N-tile of tile ``local``, group_m M-tiles at a time, M fastest inside a group."""
    per_group = group_m * n_tiles
    first_m = local // per_group * group_m
    size = min(m_tiles - first_m, group_m)
    in_group = local - local // per_group * per_group
    return first_m + in_group % size, in_group // size


def fake_scales(params: GemmSm90Fp8Params, a_rows, b_rows) -> tuple:
    """The fake block-scale tensors of A and B that ``params``' kernel is compiled against:
    row-major [rows, KB] (fp32, or ue8m0 codes with KB a multiple of 4), or with
    ``mn_major_scales`` MN-major [KB, Rp] (Rp a multiple of a 16-byte chunk's rows) for A and
    for B where ``b_mn_major``. ``a_rows`` / ``b_rows``: the row-major tensors' row counts (the
    codes' M and N where they must match them, else a free symbol)."""
    fake = cute.runtime.make_fake_compact_tensor
    sf_t = Float32 if params.scale_kind == "fp32" else Uint8
    sf_div = 1 if params.scale_kind == "fp32" else 4  # ue8m0 rows padded to whole words
    kb_a = cute.sym_int(divisibility=sf_div)
    kb_b = cute.sym_int(divisibility=sf_div)
    sf_a = fake(sf_t, (a_rows, kb_a), stride_order=(1, 0), assumed_align=4)
    sf_b = fake(sf_t, (b_rows, kb_b), stride_order=(1, 0), assumed_align=4)
    if params.mn_major_scales:
        pitch = cute.sym_int(divisibility=params.rows_per_chunk)
        sf_a = fake(sf_t, (cute.sym_int(), pitch), stride_order=(1, 0), assumed_align=16)
        if params.b_mn_major:
            pitch_b = cute.sym_int(divisibility=params.rows_per_chunk)
            sf_b = fake(sf_t, (cute.sym_int(), pitch_b), stride_order=(1, 0), assumed_align=16)
    return sf_a, sf_b


def compile_fp8_gemm(
    params: GemmSm90Fp8Params, arch: str = "sm_90a", *, dump_dir: str | None = None
):
    """The TVM-FFI compiled kernel of ``params`` for ``arch`` (sm_90a), built against fake
    tensors with dynamic M, N and K (K % block_k == 0, checked by the caller); needs no GPU.
    With ``dump_dir`` (created if missing) the PTX is kept there. Arguments of the result: A, A's
    scales, B, B's scales, S_a, S_b, C (, bias), max_ctas; the stream is the current torch one.
    Grouped params: ``gemm_sm90_fp8_grouped.compile_grouped_fp8_gemm``."""
    if params.grouped:  # its own arguments (the offsets, B batched)
        raise ValueError("grouped params: compile them with compile_grouped_fp8_gemm")
    options = compile_options(arch, dump_dir)
    fake = cute.runtime.make_fake_compact_tensor
    m, n = cute.sym_int(), cute.sym_int()
    k = cute.sym_int(divisibility=params.block_k)
    cls = GemmSm90Fp8BiasKernel if params.bias else GemmSm90Fp8Kernel
    sf_a, sf_b = fake_scales(params, m, cute.sym_int())
    args = [
        fake(Uint8, (m, k), stride_order=(1, 0), assumed_align=16),  # A's FP8 codes
        sf_a,
        fake(Uint8, (n, k), stride_order=(1, 0), assumed_align=16),  # B's FP8 codes
        sf_b,
        fake(Float32, (1,), assumed_align=4),
        fake(Float32, (1,), assumed_align=4),
        fake(OUTPUTS[params.out], (m, n), stride_order=(1, 0), assumed_align=16),
    ]
    if params.bias:
        args.append(fake(Float32, (n,), assumed_align=4))
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    return cute.compile(cls(params), *args, Int32(1), stream, options=options)


__all__ = [
    "GemmSm90Fp8BiasKernel",
    "GemmSm90Fp8Kernel",
    "GemmSm90Fp8Params",
    "compile_fp8_gemm",
]
