"""What the two Hopper GEMM kernel classes share: ``GemmSm90Base``, the base of
``gemm_sm90.GemmSm90Kernel`` (wgmma) and ``gemm_sm90_small.GemmSm90SmallKernel`` (mma.sync).

Both load their operands the same way, so the loading side is here once:

* host side: the code buffers' layouts in shared memory and the TMA atoms of one slot;
* device side: the stage barriers and the producer warp. Per stage, into buffer i % stages_fp4:
  TMA of the codes of A [tile_m rows] and B [tile_n rows] for each of its k-tiles (back to back:
  the adjacent sectors of every row reach DRAM together), one cp.async of the stage's scale codes
  per row (scale rows are K/16 bytes, too short for a TMA descriptor below K = 256), all on one
  mbarrier: arrive.expect_tx + 32 cp.async.mbarrier.arrive.noinc (count 33). Rows past M / N:
  TMA zero-fills the codes, the scale copies are skipped;
* the epilogue's arithmetic: alpha = S_a * S_b (times the decode's factor) and
  y (+ bias[n]) (+ C[m, n]) rounded once to C's dtype.

The subclasses differ in what their consumers do with a stage (decode into shared memory for
wgmma, or into registers for mma.sync) and in the A codes' width (packed, or one per byte).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, NamedTuple

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, const_expr, range_constexpr
from cutlass.cute.nvgpu import cpasync

from fp4gen.kernels.sm90_ptx import cp_async


@dataclass(frozen=True)
class GemmSm90BaseParams:
    """The compile-time constants both Hopper GEMMs have (``fp4gen.codegen.gemm`` derives them
    from the spec and its tile). A kernel's params add their own and, as fields or properties,
    the rest of what ``GemmSm90Base`` reads: ``stages_fp4`` (mbarrier-guarded stages of codes
    and scale codes), ``ktiles_per_stage`` (loaded back to back), ``a_row_bytes`` and
    ``b_row_bytes`` (code bytes of a row per k-tile), ``sf_row_bytes`` (scale codes of a row per
    stage: one cp.async of 4, 8 or 16 bytes) and ``tx_bytes`` (TMA bytes per stage)."""

    tile_m: int  # rows of A per CTA
    tile_n: int  # rows of B per CTA
    tile_k: int  # values per k-tile (64)
    threads: int  # per CTA: the consumer warps and one producer warp
    producer_warp: int  # the producer warp's index (after the consumer warps)
    sf_rows: int  # scale rows per stage: A's tile_m, then B's
    sf_stage_bytes: int  # shared memory of a stage's scale codes
    b_sf_2d: bool  # 16x16 B blocks: one B scale row per 16 rows of B
    out_dtype: type[cutlass.Numeric]  # C's element type
    bias: bool  # + bias[n], fp32 [N]
    accumulate: bool  # + C[m, n]: C is read, then overwritten
    epilogue_scale: float | None  # alpha's factor undoing the decode's scaling (None: none)
    # A's scale codes one per 32 values ([M, K/32], 1x32 blocks), copied as they are: A's rows
    # of a stage hold a_sf_copy_bytes of them (the small-M kernel reads them so; B's stay
    # repeated to one per 16 values, as its launcher prepares them once per weight)
    a_sf_32: bool = field(default=False, kw_only=True)

    @property
    def sf_per_ktile(self) -> int:
        """Scale codes of a row per k-tile (one per 16 values)."""
        return self.tile_k // 16

    @property
    def a_sf_copy_bytes(self) -> int:
        """Bytes of one A row's cp.async of scale codes per stage: sf_row_bytes, or with
        ``a_sf_32`` the stage's 2 * ktiles_per_stage codes; a stage of one k-tile (2 codes)
        copies the aligned 4-byte word of its pair of stages (cp.async moves 4, 8 or 16)."""
        if not self.a_sf_32:
            return self.sf_row_bytes  # type: ignore[attr-defined]
        return max(4, self.tile_k // 32 * self.ktiles_per_stage)  # type: ignore[attr-defined]


class CtaTile(NamedTuple):
    """A CTA's output tile (runtime values): its indices, its first row (of A and C) and column
    (row of B), and C's extents that rows and columns are checked against."""

    m_tile: Int32
    n_tile: Int32
    m0: Int32
    n0: Int32
    M: Int32
    N: Int32


class CodeSources(NamedTuple):
    """What the producer warp copies from and into: the kernel's TMA atoms and tensors of the A
    and B codes and their shared-memory layouts (``GemmSm90Base.code_tma``), the scale codes,
    and the scale tensors' extents."""

    tma_atom_a: cute.CopyAtom
    mA_tma: cute.Tensor
    tma_atom_b: cute.CopyAtom
    mB_tma: cute.Tensor
    a_layout: cute.Layout
    b_layout: cute.Layout
    mSFA: cute.Tensor
    mSFB: cute.Tensor
    ks: Int32  # K / 16: scale codes per row
    nsf_b: Int32  # B's scale rows: N, or ceil(N / 16) for 16x16 blocks


class GemmSm90Base:
    """The loading side and the epilogue arithmetic of the Hopper GEMMs (module docstring).
    A subclass stores its params in ``p``, defines ``shared_storage`` (with ``full`` and
    ``empty`` barriers of stages_fp4 each and the code and scale buffers ``sA4``, ``sB4``,
    ``sSF``) and its launch and kernel."""

    TAKES_BIAS: ClassVar[bool] = False  # the launch's arguments: with or without mBias
    p: Any  # a GemmSm90BaseParams subclass with the names its docstring lists
    shared_storage: Any  # the @cute.struct of the launch's shared memory

    def __init__(self, params: GemmSm90BaseParams) -> None:
        if params.bias != self.TAKES_BIAS:
            raise ValueError(
                f"{type(self).__name__} takes bias={self.TAKES_BIAS}; the params say {params.bias}"
            )
        self.p = params

    def tile_counts(self, M, N) -> tuple[Int32, Int32]:
        """Output tiles along M and along N (the last ones partial), on the host or the device."""
        p = self.p
        m_tiles = (M + (p.tile_m - 1)) // p.tile_m
        n_tiles = (N + (p.tile_n - 1)) // p.tile_n
        return m_tiles, n_tiles

    # ---- host side
    def code_tma(
        self, mA: cute.Tensor, mB: cute.Tensor
    ) -> tuple[cute.Layout, cute.Layout, cute.CopyAtom, cute.Tensor, cute.CopyAtom, cute.Tensor]:
        """The shared-memory layouts of the A and B code buffers (rows, row bytes, k-tile
        slots) and the TMA atoms and tensors that fill one slot of each."""
        p = self.p
        slots = p.stages_fp4 * p.ktiles_per_stage
        a_layout = cute.make_layout(
            (p.tile_m, p.a_row_bytes, slots), stride=(p.a_row_bytes, 1, p.tile_m * p.a_row_bytes)
        )
        b_layout = cute.make_layout(
            (p.tile_n, p.b_row_bytes, slots), stride=(p.b_row_bytes, 1, p.tile_n * p.b_row_bytes)
        )
        tma_atom_a, tma_a = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileG2SOp(),
            mA,
            cute.slice_(a_layout, (None, None, 0)),
            (p.tile_m, p.a_row_bytes),
        )
        tma_atom_b, tma_b = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileG2SOp(),
            mB,
            cute.slice_(b_layout, (None, None, 0)),
            (p.tile_n, p.b_row_bytes),
        )
        return a_layout, b_layout, tma_atom_a, tma_a, tma_atom_b, tma_b

    # ---- device side
    @cute.jit
    def stage_barriers(self, src: CodeSources, tidx, warp_idx, empty_arrivals: int):
        """The shared memory and its stage barriers: ``full`` (the producer's expect_tx arrive
        and 32 cp.async arrives) and ``empty`` (``empty_arrivals`` consumer arrivals), set up
        before any thread goes on; the producer warp prefetches the TMA descriptors."""
        p = self.p
        smem = cutlass.memory.SmemAllocator()
        storage = smem.allocate(self.shared_storage)
        full = storage.full.data_ptr()
        empty = storage.empty.data_ptr()
        if tidx == 0:
            for i in range_constexpr(p.stages_fp4):
                cute.arch.mbarrier_init(full + i, 33)  # expect_tx arrive + 32 cp.async arrives
                cute.arch.mbarrier_init(empty + i, empty_arrivals)
            cute.arch.mbarrier_init_fence()
        if warp_idx == p.producer_warp:
            cpasync.prefetch_descriptor(src.tma_atom_a)
            cpasync.prefetch_descriptor(src.tma_atom_b)
        cute.arch.barrier()
        return storage, full, empty

    @cute.jit
    def producer(self, src: CodeSources, storage, full, empty, tile: CtaTile, k_begin, nk, lane):
        """The producer warp: stages k_begin .. k_begin + nk - 1 of the CTA's tile, TMA of the
        codes (ktiles_per_stage k-tiles per stage) + cp.async of the scale codes."""
        p = self.p
        tma_atom_a, mA_tma, tma_atom_b, mB_tma, a_layout, b_layout, mSFA, mSFB, ks, nsf_b = src
        m_tile, n_tile, m0, n0, M, _ = tile
        sA4 = storage.sA4.get_tensor(a_layout)
        sB4 = storage.sB4.get_tensor(b_layout)
        gA4 = cute.local_tile(mA_tma, (p.tile_m, p.a_row_bytes), (None, None))
        gB4 = cute.local_tile(mB_tma, (p.tile_n, p.b_row_bytes), (None, None))
        tAsA, tAgA = cpasync.tma_partition(
            tma_atom_a,
            0,
            cute.make_layout(1),
            cute.group_modes(sA4, 0, 2),
            cute.group_modes(gA4, 0, 2),
        )
        tBsB, tBgB = cpasync.tma_partition(
            tma_atom_b,
            0,
            cute.make_layout(1),
            cute.group_modes(sB4, 0, 2),
            cute.group_modes(gB4, 0, 2),
        )
        sf_base = storage.sSF.data_ptr().toint()
        sfa_g = mSFA.iterator.toint()
        ks_a = mSFA.shape[1]  # A's scale codes per row: ks, or with a_sf_32 its 1x32 codes
        sfb_g = mSFB.iterator.toint()
        for i in cutlass.range(nk, unroll=1):
            st = i % p.stages_fp4
            kst = k_begin + i
            cute.arch.mbarrier_wait(empty + st, ((i // p.stages_fp4) & 1) ^ 1)
            with cute.arch.elect_one():
                cute.arch.mbarrier_arrive_and_expect_tx(full + st, p.tx_bytes)
            # cute.copy elects its own thread: called by the whole warp
            for s in range_constexpr(p.ktiles_per_stage):
                kt = kst * p.ktiles_per_stage + s
                slot = st * p.ktiles_per_stage + s
                cute.copy(
                    tma_atom_a, tAgA[(None, m_tile, kt)], tAsA[(None, slot)], tma_bar_ptr=full + st
                )
                cute.copy(
                    tma_atom_b, tBgB[(None, n_tile, kt)], tBsB[(None, slot)], tma_bar_ptr=full + st
                )
            # scale codes: sf_row_bytes per row, one cp.async each, the same barrier
            sf_dst = sf_base + st * p.sf_stage_bytes
            for j in range_constexpr((p.sf_rows + 31) // 32):
                row = lane + 32 * j
                if row < p.tile_m:
                    if m0 + row < M:
                        if const_expr(p.a_sf_32 and p.ktiles_per_stage == 1):
                            a_off = (kst // 2) * 4  # the word of stages kst & ~1 and kst | 1
                        else:
                            a_off = kst * p.a_sf_copy_bytes
                        cp_async(
                            sf_dst + row * p.sf_row_bytes,
                            sfa_g + Int64(m0 + row) * Int64(ks_a) + Int64(a_off),
                            p.a_sf_copy_bytes,
                        )
                elif row < p.sf_rows:
                    if const_expr(p.b_sf_2d):
                        grow = n0 // 16 + (row - p.tile_m)  # one scale row per 16 rows of B
                    else:
                        grow = n0 + (row - p.tile_m)
                    if grow < nsf_b:
                        cp_async(
                            sf_dst + row * p.sf_row_bytes,
                            sfb_g + Int64(grow) * Int64(ks) + Int64(kst * p.sf_row_bytes),
                            p.sf_row_bytes,
                        )
            cute.arch.cp_async_mbarrier_arrive_noinc(full + st)
        cute.arch.cp_async_wait_group(0)

    # ---- the epilogue's arithmetic
    @cute.jit
    def alpha(self, mGA: cute.Tensor, mGB: cute.Tensor) -> Float32:
        """S_a * S_b, times the decode's epilogue factor if it has one."""
        alpha = mGA[0] * mGB[0]
        if const_expr(self.p.epilogue_scale is not None):
            alpha = alpha * Float32(self.p.epilogue_scale)
        return alpha

    @cute.jit
    def store_output(self, mC: cute.Tensor, mBias: cute.Tensor | None, gm, gn, y: Float32):
        """C[gm, gn] = y (+ bias[gn]) (+ C[gm, gn]) in fp32, one rounding to C's dtype."""
        p = self.p
        if const_expr(p.bias):
            y = y + mBias[gn]
        if const_expr(p.accumulate):
            y = y + Float32(mC[gm, gn])
        mC[gm, gn] = p.out_dtype(y)
