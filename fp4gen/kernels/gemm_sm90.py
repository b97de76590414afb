"""The fused dequantizing GEMM for Hopper (sm_90a): C = S_a * S_b * A @ B^T (+ bias) (+ C).

What it computes (docs/numerics.md section 6; oracle: ``fp4gen.numerics.gemm_reference``)::

    C[m, n] = S_a * S_b * sum_k (q_a[m, k] * s_a) * (q_b[n, k] * s_b)  (+ bias[n])  (+ C[m, n])

A and B are e2m1 codes packed two per byte (element 0 in the low nibble), [M, K/2] and [N, K/2],
with one block-scale code per 16 values along K ([M, K/16]; B's [N, K/16], or [ceil(N/16), K/16]
for 16x16 blocks). S_a and S_b are fp32 device tensors of one element (never read on the host).
The epilogue follows gemm_reference: y = fp32(acc * S_a * S_b) (+ bias[n]) (+ C[m, n]) in fp32,
one rounding to C's dtype. Element x block scale is exact in bf16, so the products are exact and
the result differs from the float64 oracle only by the fp32 summation order.

Design (design (a) of the CuTe DSL guide: dequantize through shared memory, SS wgmma; measured
on H100 in docs/gemm-sm90.md). One CTA computes one tile_m x tile_n output tile over all of K
(no split-K); the grid is rasterized in groups of group_m M-tiles for L2 reuse. The threads:

producer warp (after the MMA warpgroups; ``gemm_sm90_base.GemmSm90Base.producer``)
    per k-tile (64 values), into fp4 stage kt % stages_fp4: TMA of the packed codes of A
    [tile_m, 32 B] and B [tile_n, 32 B], and 4-byte cp.async of the scale codes (scale rows are
    K/16 bytes, too short for a TMA descriptor below K = 256). Both land on one mbarrier:
    arrive.expect_tx + 32 cp.async.mbarrier.arrive.noinc (count 33). Rows past M / N: TMA
    zero-fills the codes, the scale copies are skipped.
MMA warpgroups (mma_m_split x mma_n_split wgmma atoms of 64 x tile_n / mma_n_split)
    per k-tile t: wgmma(t) on bf16 stage t % 3 (4 x m64nNk16, fp32 accumulation, one commit
    group; k16 step kb into accumulator set kb % acc_sets); decode k-tile t+1 into bf16 stage
    (t+1) % 3; release its fp4 stage; wait_group(1); one named barrier over the MMA threads.
    Stage (t+1) % 3 was last read by wgmma(t-2), which every warpgroup waited for before the
    barrier of iteration t-1, so three bf16 stages need one barrier per k-tile (two would race:
    wait_group is per warpgroup).
    Decode unit: (row, 32 values) = one 16-byte LDS of codes + one 2-byte LDS of two scale
    codes, four 16-byte STS straight into the wgmma K-major 128B-swizzle layout (row r at
    r * 128, 16-byte chunk q at q ^ (r % 8)); a quarter-warp writes 8 distinct chunks (no bank
    conflicts). Rows >= M (A) / >= N (B) are not decoded: stale shared memory there only feeds
    outputs that are never stored. fence.proxy.async before the barrier makes the
    generic-proxy stores visible to wgmma.
epilogue
    from the accumulator registers: y = acc * alpha (+ bias) (+ C), predicated scalar stores
    (any M and N).

The e2m1 decode (8 codes and a pair of scale codes -> 4 bf16x2 words) is passed in: the
"arith" or "lut" decode of ``fp4gen.kernels.sm90_decode`` (its docstring has both); the arith
decode leaves a factor the epilogue undoes (``GemmSm90Params.epilogue_scale``).

Limits: K % 64 == 0 (the launcher zero-pads codes and scales, exact); M, N >= 1 arbitrary;
compact row-major operands with 16-byte aligned bases; M * N < 2^31 and max(M, N) * K / 2 < 2^31.

A generated module (``fp4gen.codegen.gemm``) binds a spec's ``GemmSm90Params`` and decode in a
subclass of its own (the kernel symbol names the spec) and adds the host code.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import BFloat16, Float32, Int64, Uint8, Uint32, const_expr, range_constexpr
from cutlass.cute.nvgpu import warpgroup
from cutlass.tensor_utils import LayoutEnum

from fp4gen.kernels.gemm_sm90_base import CodeSources, CtaTile, GemmSm90Base, GemmSm90BaseParams
from fp4gen.kernels.sm90_ptx import lds_u16, lds_v4, sts_v4


@dataclass(frozen=True)
class GemmSm90Params(GemmSm90BaseParams):
    """Everything the kernel depends on besides its tensors and its decode: compile-time
    constants (``fp4gen.codegen.gemm`` derives them from the spec and its tile). A row's k-tile
    is 32 code bytes, decoded 128 bf16 bytes (one 128B-swizzle row)."""

    mma_warpgroups: int
    mma_m_split: int  # wgmma atoms of 64 x tile_n / mma_n_split: mma_m_split x mma_n_split
    mma_n_split: int
    acc_sets: int  # independent accumulators (k16 step kb uses set kb % acc_sets): 1, 2 or 4
    stages_fp4: int  # packed codes + scales, loaded ahead by the producer warp
    stages_bf16: int  # decoded operands (three: one barrier per k-tile suffices)
    group_m: int  # M-tiles per raster group
    mma_threads: int  # the MMA warpgroups' threads (they also decode)
    units: int  # decode units (row, 32 values) per k-tile: 2 * (tile_m + tile_n)
    units_per_thread: int  # rounded up
    partial_units: bool  # the units do not divide evenly among the MMA threads
    tx_bytes: int  # TMA bytes per fp4 stage

    @property
    def code_row_bytes(self) -> int:
        """Packed code bytes of a row per k-tile."""
        return self.tile_k // 2

    # what GemmSm90Base's producer reads (GemmSm90BaseParams): one k-tile per fp4 stage, A and
    # B codes both packed
    @property
    def ktiles_per_stage(self) -> int:
        return 1

    @property
    def a_row_bytes(self) -> int:
        return self.code_row_bytes

    @property
    def b_row_bytes(self) -> int:
        return self.code_row_bytes

    @property
    def sf_row_bytes(self) -> int:
        return self.sf_per_ktile


# 8 e2m1 codes, a bf16x2 scale pair and which half of it -> 4 bf16x2 words (sm90_decode.decode8_*)
Decode8 = Callable[[Uint32, Uint32, bool], tuple[Uint32, Uint32, Uint32, Uint32]]
# two scale codes (low 16 bits) -> their bf16x2 pair (sm90_decode.scale_pair_*)
ScalePair = Callable[[Uint32], Uint32]
# the per-thread constants of the decode units (unit_consts): lists of units_per_thread values
UnitConsts = tuple[list, list, list, list, list, list]


class GemmSm90Kernel(GemmSm90Base):
    """C = alpha * A @ B^T (+ C) on sm_90a without a bias (module docstring):
    ``__call__(mA, mSFA, mB, mSFB, mGA, mGB, mC, stream)``."""

    p: GemmSm90Params

    def __init__(self, params: GemmSm90Params, decode8: Decode8, scale_pair: ScalePair) -> None:
        super().__init__(params)
        self.decode8 = decode8
        self.scale_pair = scale_pair

    # ---- host side: the launch
    @cute.jit
    def __call__(
        self,
        mA: cute.Tensor,  # uint8 [M, K/2] codes
        mSFA: cute.Tensor,  # uint8 [M, K/16] scale codes
        mB: cute.Tensor,  # uint8 [N, K/2] codes
        mSFB: cute.Tensor,  # uint8 [N or ceil(N/16), K/16] scale codes
        mGA: cute.Tensor,  # fp32 [1] S_a
        mGB: cute.Tensor,  # fp32 [1] S_b
        mC: cute.Tensor,  # out_dtype [M, N]
        stream: cuda.CUstream,
    ):
        self.launch(mA, mSFA, mB, mSFB, mGA, mGB, mC, None, stream)

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
        mBias: cute.Tensor | None,  # fp32 [N], with params.bias
        stream: cuda.CUstream,
    ):
        """The TMA descriptors, shared-memory layouts and the grid of the kernel."""
        p = self.p
        tiled_mma = sm90_utils.make_trivial_tiled_mma(
            BFloat16,
            BFloat16,
            warpgroup.OperandMajorMode.K,
            warpgroup.OperandMajorMode.K,
            Float32,
            (p.mma_m_split, p.mma_n_split, 1),
            tiler_mn=(64, p.tile_n // p.mma_n_split),
        )
        atom = warpgroup.make_smem_layout_atom(
            sm90_utils.get_smem_layout_atom(LayoutEnum.ROW_MAJOR, BFloat16, p.tile_k), BFloat16
        )
        sA_layout = cute.tile_to_shape(atom, (p.tile_m, p.tile_k, p.stages_bf16), order=(0, 1, 2))
        sB_layout = cute.tile_to_shape(atom, (p.tile_n, p.tile_k, p.stages_bf16), order=(0, 1, 2))
        a4_layout, b4_layout, tma_atom_a, tma_a, tma_atom_b, tma_b = self.code_tma(mA, mB)

        @cute.struct
        class SharedStorage:
            full: cute.struct.MemRange[Int64, p.stages_fp4]
            empty: cute.struct.MemRange[Int64, p.stages_fp4]
            sA4: cute.struct.Align[
                cute.struct.MemRange[Uint8, p.tile_m * p.code_row_bytes * p.stages_fp4], 1024
            ]
            sB4: cute.struct.Align[
                cute.struct.MemRange[Uint8, p.tile_n * p.code_row_bytes * p.stages_fp4], 1024
            ]
            sSF: cute.struct.Align[
                cute.struct.MemRange[Uint8, p.sf_stage_bytes * p.stages_fp4], 128
            ]
            sA: cute.struct.Align[cute.struct.MemRange[BFloat16, cute.cosize(sA_layout)], 1024]
            sB: cute.struct.Align[cute.struct.MemRange[BFloat16, cute.cosize(sB_layout)], 1024]

        self.shared_storage = SharedStorage

        m_tiles, n_tiles = self.tile_counts(mC.shape[0], mC.shape[1])
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
            sA_layout,
            sB_layout,
            a4_layout,
            b4_layout,
        ).launch(
            grid=[m_tiles * n_tiles, 1, 1],
            block=[p.threads, 1, 1],
            min_blocks_per_mp=1,
            stream=stream,
        )

    # ---- device side
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
        sA_layout: cute.ComposedLayout,
        sB_layout: cute.ComposedLayout,
        a4_layout: cute.Layout,
        b4_layout: cute.Layout,
    ):
        p = self.p
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        wg_idx = warp_idx // 4
        lane = cute.arch.lane_idx()

        M = mC.shape[0]
        N = mC.shape[1]
        ks = mSFA.shape[1]  # K / 16
        k_tiles = ks // p.sf_per_ktile
        nsf_b = mSFB.shape[0]

        # ---- tile coordinates: groups of group_m M-tiles, M fastest inside a group
        m_tiles, n_tiles = self.tile_counts(M, N)
        per_group = p.group_m * n_tiles
        group = bidx // per_group
        first_m = group * p.group_m
        group_size = cutlass.min(m_tiles - first_m, p.group_m)
        in_group = bidx - group * per_group
        m_tile = first_m + in_group % group_size
        n_tile = in_group // group_size
        m0 = m_tile * p.tile_m
        n0 = n_tile * p.tile_n

        src = CodeSources(
            tma_atom_a, mA_tma, tma_atom_b, mB_tma, a4_layout, b4_layout, mSFA, mSFB, ks, nsf_b
        )
        # ---- shared memory and the fp4 stage barriers (every MMA thread releases a stage)
        storage, full, empty = self.stage_barriers(src, tidx, warp_idx, p.mma_threads)

        # ============================================================== producer warp
        if warp_idx == p.producer_warp:
            tile = CtaTile(m_tile, n_tile, m0, n0, M, N)
            self.producer(src, storage, full, empty, tile, 0, k_tiles, lane)  # all of K

        # ============================================================== MMA warpgroups
        if wg_idx < p.mma_warpgroups:
            sA = storage.sA.get_tensor(sA_layout.outer, swizzle=sA_layout.inner)
            sB = storage.sB.get_tensor(sB_layout.outer, swizzle=sB_layout.inner)
            thr_wg = tiled_mma.get_slice(wg_idx * 128)
            tCrA = tiled_mma.make_fragment_A(thr_wg.partition_A(sA))
            tCrB = tiled_mma.make_fragment_B(thr_wg.partition_B(sB))
            cC = cute.make_identity_tensor((p.tile_m, p.tile_n))
            tCcC = tiled_mma.get_slice(tidx).partition_C(cC)
            accs = []
            for _ in range_constexpr(p.acc_sets):
                acc_set = cute.make_rmem_tensor(tCcC.shape, Float32)
                acc_set.fill(0.0)
                accs.append(acc_set)
            acc = accs[0]
            tiled_mma.set(warpgroup.Field.ACCUMULATE, True)
            num_kb = cute.size(tCrA, mode=[2])

            # Decode k-tile t+1 into bf16 stage (t+1) % 3 while wgmma(t-1), wgmma(t) run.
            uc = self.unit_consts(tidx, m0, n0, M, N)
            self.transform_ktile(storage, full, empty, 0, 0, uc)
            cute.arch.barrier(barrier_id=1, number_of_threads=p.mma_threads)
            for kt in cutlass.range(k_tiles, unroll=1):
                st2 = kt % p.stages_bf16
                warpgroup.fence()
                for kb in range_constexpr(num_kb):
                    cute.gemm(
                        tiled_mma,
                        accs[kb % p.acc_sets],
                        tCrA[(None, None, kb, st2)],
                        tCrB[(None, None, kb, st2)],
                        accs[kb % p.acc_sets],
                    )
                warpgroup.commit_group()
                if kt + 1 < k_tiles:
                    self.transform_ktile(storage, full, empty, kt + 1, (kt + 1) % p.stages_bf16, uc)
                warpgroup.wait_group(1)  # wgmma(t-1) done before the barrier
                cute.arch.barrier(barrier_id=1, number_of_threads=p.mma_threads)
            warpgroup.wait_group(0)

            # ---- epilogue: registers -> global, predicated
            alpha = self.alpha(mGA, mGB)
            if const_expr(p.acc_sets > 1):
                for i in range_constexpr(cute.size(acc)):
                    acc[i] = self.sum_sets(accs, i, 0, p.acc_sets)
            for i in range_constexpr(cute.size(acc)):
                mm, nn = tCcC[i]
                gm = m0 + mm
                gn = n0 + nn
                if (gm < M) & (gn < N):
                    self.store_output(mC, mBias, gm, gn, acc[i] * alpha)

    def sum_sets(self, accs: list, i: int, lo: int, hi: int) -> Float32:
        """Element i of accumulator sets lo..hi-1 summed as a balanced tree ((a0 + a1) +
        (a2 + a3)), the sets' partial sums added pairwise (plain Python: unrolled in the
        trace)."""
        if hi - lo == 1:
            return accs[lo][i]
        mid = (lo + hi) // 2
        return self.sum_sets(accs, i, lo, mid) + self.sum_sets(accs, i, mid, hi)

    # ------------------------------------------------------------------------------------------
    @cute.jit
    def unit_consts(self, tid, m0, n0, M, N) -> UnitConsts:
        """Per-thread constants of its decode units u = tid + i * mma_threads (row r = u // 2
        of A then B, 32-value half c = u % 2)."""
        p = self.p
        src_off = []  # code byte offset inside a stage (A or B region)
        sf_off = []  # scale byte offset inside a stage
        dst_off = []  # bf16 row offset inside a stage (A or B region)
        chunk = []  # (4c) ^ (r % 8): swizzled 16-byte chunk of the unit's first word
        is_a = []
        valid = []
        for i in range_constexpr(p.units_per_thread):
            u = tid + i * p.mma_threads
            # the last unit of a thread may be past the tile's: clamped, so that the loads
            # stay inside the stage
            last = p.partial_units and i == p.units_per_thread - 1
            if const_expr(last):
                u = cutlass.min(u, p.units - 1)
            r = u >> 1
            c = u & 1
            ia = r < p.tile_m
            rb = r - p.tile_m
            sf_row_b = r
            if const_expr(p.b_sf_2d):  # one B scale row per 16 rows of B
                sf_row_b = p.tile_m + (rb >> 4)
            src_off.append(
                cutlass.select_(ia, r * p.code_row_bytes, rb * p.code_row_bytes) + c * 16
            )
            sf_off.append(cutlass.select_(ia, r, sf_row_b) * p.sf_per_ktile + c * 2)
            dst_off.append(cutlass.select_(ia, r * 128, rb * 128))
            chunk.append((c * 4) ^ (r & 7))
            is_a.append(ia)
            ok = cutlass.select_(ia, m0 + r < M, n0 + rb < N)
            if const_expr(last):
                ok = ok & (tid + i * p.mma_threads < p.units)
            valid.append(ok)
        return src_off, sf_off, dst_off, chunk, is_a, valid

    @cute.jit
    def transform_ktile(self, storage, full, empty, kt, st2, uc: UnitConsts):
        """fp4 stage of k-tile kt -> bf16 stage st2 (wgmma layout), then release the fp4
        stage. The caller's barrier hands the bf16 stage to wgmma."""
        p = self.p
        src_off, sf_off, dst_off, chunk, is_a, valid = uc
        st1 = kt % p.stages_fp4
        cute.arch.mbarrier_wait(full + st1, (kt // p.stages_fp4) & 1)
        a4 = storage.sA4.data_ptr().toint() + st1 * (p.tile_m * p.code_row_bytes)
        b4 = storage.sB4.data_ptr().toint() + st1 * (p.tile_n * p.code_row_bytes)
        sfs = storage.sSF.data_ptr().toint() + st1 * p.sf_stage_bytes
        codes = []
        scales = []
        for i in range_constexpr(p.units_per_thread):
            codes.append(lds_v4(cutlass.select_(is_a[i], a4, b4) + src_off[i]))
            scales.append(self.scale_pair(lds_u16(sfs + sf_off[i])))
        da = storage.sA.data_ptr().toint() + st2 * (p.tile_m * p.tile_k * 2)
        db = storage.sB.data_ptr().toint() + st2 * (p.tile_n * p.tile_k * 2)
        for i in range_constexpr(p.units_per_thread):
            if valid[i]:
                dst = cutlass.select_(is_a[i], da, db) + dst_off[i]
                for w in range_constexpr(4):
                    # words 0, 1: the first 16 values (scale in the low half); 2, 3: the next 16
                    o = self.decode8(codes[i][w], scales[i], w >= 2)
                    sts_v4(dst + ((chunk[i] ^ w) << 4), o[0], o[1], o[2], o[3])
        cute.arch.fence_proxy("async.shared", space="cta")  # generic stores -> wgmma's proxy
        cute.arch.mbarrier_arrive(empty + st1)


class GemmSm90BiasKernel(GemmSm90Kernel):
    """The kernel with a bias, C = alpha * A @ B^T + bias (+ C):
    ``__call__(mA, mSFA, mB, mSFB, mGA, mGB, mC, mBias, stream)`` with mBias fp32 [N]."""

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
        stream: cuda.CUstream,
    ):
        self.launch(mA, mSFA, mB, mSFB, mGA, mGB, mC, mBias, stream)


__all__ = ["GemmSm90BiasKernel", "GemmSm90Kernel", "GemmSm90Params"]
