"""The fused dequantizing GEMM for Hopper (sm_90a) at small M (M <= 64): C = S_a * S_b * A @ B^T
(+ bias) (+ C) with warp-level mma.sync on operands decoded in registers, split-K across CTAs.

What it computes (docs/numerics.md section 6; oracle: ``fp4gen.numerics.gemm_reference``)::

    C[m, n] = S_a * S_b * sum_k (q_a[m, k] * s_a) * (q_b[n, k] * s_b)  (+ bias[n])  (+ C[m, n])

A is e2m1 codes [M, K], ONE CODE PER BYTE (``QuantizedTensor.codes`` as they are: no pack pass
for the activation); B is e2m1 codes [N, K] packed two per byte (element 0 in the low nibble).
Both carry one block-scale code per 16 values along K ([M, K/16]; B's [N, K/16], or
[ceil(N/16), K/16] for 16x16 blocks); with ``a_sf_32`` A's are its 1x32 codes as they are
([M, K/32], rows padded to whole 4-byte words) while B's are repeated to one per 16 values.
S_a and S_b are fp32 device tensors of one element (never read on the host). The epilogue
follows gemm_reference: y = fp32(acc * S_a * S_b) (+ bias[n]) (+ C[m, n]) in fp32, one
rounding to C's dtype. Element x block scale is exact in bf16, so the products are exact and the
result differs from the float64 oracle only by the fp32 summation order.

Design (docs/gemm-sm90.md): at small M the GEMM is a stream over B (N x K / 2 bytes), so the
kernel keeps as many B bytes in flight as the SMs can take and decodes with no shared-memory
round trip, no proxy fence and no named barrier in the mainloop:

grid (M-tiles, N-tiles, splits)
    CTA (m, n, s) computes the tile_m x tile_n tile (m, n) over the s-th of ``splits`` equal
    ranges of stages (ktiles_per_stage k-tiles of 64 values each); splits is the workspace's
    first extent, chosen per shape on the host to fill one wave of ctas_per_sm CTAs per SM.
producer warp (after the compute warps; ``gemm_sm90_base.GemmSm90Base.producer``)
    per stage i (buffer i % stages), for each of its k-tiles: TMA of the A codes [tile_m rows,
    64 B] and the B codes [tile_n rows, 32 B] (back to back: the adjacent sectors of every row
    reach DRAM together); one cp.async of the stage's scale codes per row (4 bytes per k-tile;
    A's 1x32 codes: 2 per k-tile, and a stage of one k-tile copies its stage pair's word);
    all on one mbarrier (arrive.expect_tx + 32 cp.async.mbarrier.arrive.noinc: count 33). Rows
    past M / N: TMA zero-fills the codes, the scale copies are skipped.
compute warps (warps_m along M x warps_n along N x warps_k along K)
    warp (wm, wn, wk) owns rows [wm * warp_m, (wm + 1) * warp_m) and columns [wn * warp_n,
    (wn + 1) * warp_n) of the tile and the k-tiles of the CTA's stages whose index is wk modulo
    warps_k: wait for the stage, load the k-tile's codes and scale codes into registers (lane
    (g, q) = (lane / 4, lane % 4) takes the 16-value block q of its rows: one LDS.128 per A row,
    one LDS.64 per B row), release the stage after its last k-tile (``empty_arrivals``
    arrivals), decode to bf16 in registers and issue mma.sync.m16n8k16 (bf16 x bf16 -> fp32):
    mma_m x mma_n atoms of 16 x 8 per k16 step.
K order
    the decode puts the 64 values of a k-tile into the mma fragments in a permuted K order
    (lane q's registers hold block q; inside it, the order of the decode), the same for A and B,
    so every dot product is unchanged.
reduction
    the warps along K add their tiles in shared memory (the code buffers, once every warp is
    past the mainloop) in a fixed order; with splits > 1 every CTA writes its fp32 tile to the
    workspace, and the last CTA of the tile (an acq_rel atomic counter, reset by that CTA for the
    next call) adds the splits in order 0, 1, ... and stores: deterministic, run to run.
epilogue
    y = acc * alpha (+ bias) (+ C), predicated scalar stores (any M and N).

The e2m1 decodes are passed in: B's (8 packed codes, ``fp4gen.kernels.sm90_decode``'s
``decode8_arith`` or ``decode8_lut``), A's (8 codes one per byte, this module's
``decode8_bytes_arith`` or ``decode8_bytes_lut``, in the same K order) and the scale pair:

* "arith" (e4m3 scales; sm_90 has no e2m1 convert): the bf16 bits (code & 7) << 6 are exactly
  v * 2^-126, the sign goes to bit 15; bf16x2 word j of an 8-value group holds elements (j, j+4)
  (B: shifts of the packed word; A: two prmt gather the byte codes first). One HMUL2.BF16 by
  bf16(s * 2^119) gives v * s * 2^-7 exactly (<= 6 significant bits, normal range); the epilogue
  multiplies alpha by 2^14 (``GemmSm90SmallParams.epilogue_scale``). Relies on HMUL2.BF16
  honouring subnormal bf16 inputs (verified on H100 and H200).
* "lut" (ue8m0 scales): prmt byte tables of the eight bf16 magnitudes plus the sign bit, natural
  K order inside an 8-value group (word j holds elements (2j, 2j+1)), then one HMUL2.BF16 by the
  block scale (exponent arithmetic). Each scale code covers 32 values: A's are read as they are
  (``a_sf_32``: lane q's 16-value block takes code q / 2 of its k-tile's two; no per-call
  expansion of the activation's codes), B's the launcher repeats twice along K once per weight,
  so B has one code per 16 values.

Limits: K % (64 * ktiles_per_stage) == 0 in the kernel (the launcher zero-pads codes and scales,
exact); M, N >= 1 arbitrary; compact row-major operands with 16-byte aligned bases; M * N < 2^31
and max(M, N) * K < 2^31.

A generated module (``fp4gen.codegen.gemm``) binds a spec's ``GemmSm90SmallParams`` and decodes
in a subclass of its own (the kernel symbol names the spec) and adds the host code: the split-K
workspace, the launcher and ``run``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, Uint8, Uint32, const_expr, range_constexpr

from fp4gen.kernels.gemm_sm90_base import CodeSources, CtaTile, GemmSm90Base, GemmSm90BaseParams
from fp4gen.kernels.sm90_decode import MAG_BITS, SIGN_BITS, lut_lookup, times_scale
from fp4gen.kernels.sm90_ptx import (
    atom_add_acq_rel,
    ldg_cg_v4_f32,
    lds_u32,
    lds_v2,
    lds_v4,
    lds_v4_f32,
    mma_16816,
    prmt,
    stg_u32_relaxed,
    stg_v4_f32,
    sts_u32,
    sts_v2_f32,
)


@dataclass(frozen=True)
class GemmSm90SmallParams(GemmSm90BaseParams):
    """Everything the kernel depends on besides its tensors and its decodes: compile-time
    constants (``fp4gen.codegen.gemm`` derives them from the spec and its ``SmallMTile``)."""

    warp_m: int  # rows per warp
    warp_n: int  # columns per warp
    mma_m: int  # m16 atoms per warp (warp_m / 16)
    mma_n: int  # n8 atoms per warp (warp_n / 8)
    acc_regs: int  # fp32 accumulators per thread: mma_m * mma_n * 4
    warps_m: int
    warps_n: int
    warps_k: int  # warps splitting the CTA's k-tiles round robin
    compute_warps: int
    compute_threads: int
    stages: int  # mbarrier-guarded stages of ktiles_per_stage k-tiles each
    ktiles_per_stage: int  # loaded back to back: adjacent sectors of each row
    ctas_per_sm: int  # launch bound (ptxas keeps registers <= 65536 / (threads * this))
    subs: int  # a warp's k-tile slots per stage: sub0 + u * warps_k (u < subs)
    stage_step: int  # a warp's stride through the stages
    empty_arrivals: int  # the lanes of the warps that read a stage
    epi_steps: int  # epilogue chunks (8 consecutive columns of one row) per compute thread

    @property
    def slots(self) -> int:
        """k-tile slots in shared memory."""
        return self.stages * self.ktiles_per_stage

    @property
    def stage_k(self) -> int:
        """Values per stage along K (K is a multiple of it)."""
        return self.tile_k * self.ktiles_per_stage

    @property
    def a_row_bytes(self) -> int:
        """A code bytes of a row per k-tile (one code per byte)."""
        return self.tile_k

    @property
    def b_row_bytes(self) -> int:
        """B code bytes of a row per k-tile (two codes per byte)."""
        return self.tile_k // 2

    @property
    def sf_row_bytes(self) -> int:
        """Scale codes of a row per stage (one cp.async)."""
        return self.sf_per_ktile * self.ktiles_per_stage

    @property
    def stages_fp4(self) -> int:
        """``stages`` by the name GemmSm90Base's producer reads (GemmSm90BaseParams)."""
        return self.stages

    @property
    def a_slot_bytes(self) -> int:
        return self.tile_m * self.a_row_bytes

    @property
    def b_slot_bytes(self) -> int:
        return self.tile_n * self.b_row_bytes

    @property
    def tx_bytes(self) -> int:
        """TMA bytes per stage."""
        return (self.a_slot_bytes + self.b_slot_bytes) * self.ktiles_per_stage

    @property
    def red_stride(self) -> int:
        """fp32 row stride of the reduction buffer (+4: no bank conflicts)."""
        return self.tile_n + 4

    @property
    def tile_elems(self) -> int:
        return self.tile_m * self.tile_n

    @property
    def chunks_per_row(self) -> int:
        """The epilogue's unit: 8 consecutive columns of one row."""
        return self.tile_n // 8

    @property
    def sb_index(self) -> tuple[int, ...]:
        """The scale word (a pair of B scales) of a warp's n8 atom t."""
        if self.b_sf_2d:
            return tuple(t // 4 for t in range(self.mma_n))  # atoms 2u, 2u + 1 share row u
        return tuple(t // 2 for t in range(self.mma_n))

    @property
    def sb_high(self) -> tuple[bool, ...]:
        """Whether n8 atom t takes the high half of its scale word."""
        if self.b_sf_2d:
            return tuple((t // 2) % 2 == 1 for t in range(self.mma_n))
        return tuple(t % 2 == 1 for t in range(self.mma_n))


# 8 e2m1 codes, a bf16x2 scale pair and which half of it -> 4 bf16x2 words (sm90_decode.decode8_*)
Decode8 = Callable[[Uint32, Uint32, bool], tuple[Uint32, Uint32, Uint32, Uint32]]
# 8 e2m1 codes one per byte (two words), a scale pair, which half -> 4 words (decode8_bytes_*)
Decode8Bytes = Callable[[Uint32, Uint32, Uint32, bool], tuple[Uint32, Uint32, Uint32, Uint32]]
# two scale codes (low 16 bits) -> their bf16x2 pair (sm90_decode.scale_pair_*)
ScalePair = Callable[[Uint32], Uint32]


# ----------------------------------------------------------------------------------------------
# A's decodes: 8 e2m1 codes one per byte, in the K order of B's decode8 of the same name
# ----------------------------------------------------------------------------------------------
@cute.jit
def decode8_bytes_arith(lo: Uint32, hi_codes: Uint32, sc: Uint32, hi: cutlass.Constexpr[bool]):
    """8 e2m1 codes one per byte (lo: elements 0-3, hi_codes: 4-7) -> 4 bf16x2 words of
    v * s * 2^-7 in decode8_arith's order: word j holds elements (j, j+4)."""
    m = Uint32(MAG_BITS)
    sg = Uint32(SIGN_BITS)
    ev = prmt(lo, hi_codes, 0x6420)  # bytes: elements 0, 2, 4, 6
    od = prmt(lo, hi_codes, 0x7531)  # elements 1, 3, 5, 7
    w0 = ((ev << Uint32(6)) & m) | ((ev << Uint32(12)) & sg)  # (0, 4)
    w1 = ((od << Uint32(6)) & m) | ((od << Uint32(12)) & sg)  # (1, 5)
    w2 = ((ev >> Uint32(2)) & m) | ((ev << Uint32(4)) & sg)  # (2, 6)
    w3 = ((od >> Uint32(2)) & m) | ((od << Uint32(4)) & sg)  # (3, 7)
    return times_scale((w0, w1, w2, w3), sc, hi)


@cute.jit
def decode4_bytes_lut(x: Uint32):
    """4 e2m1 codes one per byte -> 2 bf16x2 words of their values, (0, 1) and (2, 3)."""
    mm = x & Uint32(0x07070707)
    sel = mm | (mm << Uint32(4))  # selector nibbles: element 0, 0, 1, 1, 2, 2, 3, 3
    sel_hi = sel >> Uint32(16)
    lo01, hi01 = lut_lookup(sel)
    lo23, hi23 = lut_lookup(sel_hi)
    s = x << Uint32(4)  # the sign of element e at bit 7 of byte e
    sign = Uint32(0x80008000)
    w01 = prmt(lo01, hi01, 0x7250) | (prmt(s, s, 0x1000) & sign)
    w23 = prmt(lo23, hi23, 0x7250) | (prmt(s, s, 0x3020) & sign)
    return w01, w23


@cute.jit
def decode8_bytes_lut(lo: Uint32, hi_codes: Uint32, sc: Uint32, hi: cutlass.Constexpr[bool]):
    """8 e2m1 codes one per byte (lo: elements 0-3, hi_codes: 4-7) -> 4 bf16x2 words of v * s
    in decode8_lut's order: word j holds elements (2j, 2j+1)."""
    w0, w1 = decode4_bytes_lut(lo)
    w2, w3 = decode4_bytes_lut(hi_codes)
    return times_scale((w0, w1, w2, w3), sc, hi)


# ----------------------------------------------------------------------------------------------
# The kernel
# ----------------------------------------------------------------------------------------------
class GemmSm90SmallKernel(GemmSm90Base):
    """C = alpha * A @ B^T (+ C) on sm_90a for small M without a bias (module docstring):
    ``__call__(mA, mSFA, mB, mSFB, mGA, mGB, mC, mWs, mCtr, stream)``."""

    p: GemmSm90SmallParams

    def __init__(
        self,
        params: GemmSm90SmallParams,
        decode8: Decode8,
        decode8_bytes: Decode8Bytes,
        scale_pair: ScalePair,
    ) -> None:
        super().__init__(params)
        self.decode8 = decode8  # B: 8 packed codes
        self.decode8_bytes = decode8_bytes  # A: 8 codes one per byte
        self.scale_pair = scale_pair

    # ---- host side: the launch
    @cute.jit
    def __call__(
        self,
        mA: cute.Tensor,  # uint8 [M, K] codes, one per byte
        mSFA: cute.Tensor,  # uint8 [M, K/16] scale codes
        mB: cute.Tensor,  # uint8 [N, K/2] codes, two per byte
        mSFB: cute.Tensor,  # uint8 [N or ceil(N/16), K/16] scale codes
        mGA: cute.Tensor,  # fp32 [1] S_a
        mGB: cute.Tensor,  # fp32 [1] S_b
        mC: cute.Tensor,  # out_dtype [M, N]
        mWs: cute.Tensor,  # fp32 [splits, tiles * tile_elems] split-K partial tiles
        mCtr: cute.Tensor,  # int32 [>= tiles] arrival counters, zero between calls
        stream: cuda.CUstream,
    ):
        self.launch(mA, mSFA, mB, mSFB, mGA, mGB, mC, None, mWs, mCtr, stream)

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
        mWs: cute.Tensor,
        mCtr: cute.Tensor,
        stream: cuda.CUstream,
    ):
        """The TMA descriptors, the shared-memory layout and the grid of the kernel."""
        p = self.p
        a_layout, b_layout, tma_atom_a, tma_a, tma_atom_b, tma_b = self.code_tma(mA, mB)

        @cute.struct
        class SharedStorage:
            full: cute.struct.MemRange[Int64, p.stages]
            empty: cute.struct.MemRange[Int64, p.stages]
            flag: cute.struct.MemRange[Int32, 4]
            # sA4 then sB4, back to back (a_slot_bytes * slots is a multiple of 1024): after the
            # mainloop the warps' partial tiles reuse them
            sA4: cute.struct.Align[cute.struct.MemRange[Uint8, p.a_slot_bytes * p.slots], 1024]
            sB4: cute.struct.Align[cute.struct.MemRange[Uint8, p.b_slot_bytes * p.slots], 1024]
            sSF: cute.struct.Align[cute.struct.MemRange[Uint8, p.sf_stage_bytes * p.stages], 128]

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
            mWs,
            mCtr,
            a_layout,
            b_layout,
        ).launch(
            grid=[m_tiles, n_tiles, mWs.shape[0]],
            block=[p.threads, 1, 1],
            min_blocks_per_mp=p.ctas_per_sm,
            preferred_smem_carveout=100,  # all of L1 as shared memory: ctas_per_sm CTAs fit
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
        mWs: cute.Tensor,
        mCtr: cute.Tensor,
        a_layout: cute.Layout,
        b_layout: cute.Layout,
    ):
        p = self.p
        tidx, _, _ = cute.arch.thread_idx()
        m_tile, n_tile, split = cute.arch.block_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        lane = cute.arch.lane_idx()

        M = mC.shape[0]
        N = mC.shape[1]
        ks = mSFB.shape[1]  # K / 16 (A's are K / 32 with a_sf_32; B's always one per 16)
        k_stages = ks // p.sf_row_bytes
        nsf_b = mSFB.shape[0]
        splits = mWs.shape[0]
        # this CTA's stages (of ktiles_per_stage k-tiles): [k_begin, k_begin + nk)
        kt_per = (k_stages + splits - 1) // splits
        k_begin = split * kt_per
        nk = cutlass.max(cutlass.min(kt_per, k_stages - k_begin), 0)
        tile = CtaTile(m_tile, n_tile, m_tile * p.tile_m, n_tile * p.tile_n, M, N)
        src = CodeSources(
            tma_atom_a, mA_tma, tma_atom_b, mB_tma, a_layout, b_layout, mSFA, mSFB, ks, nsf_b
        )

        # ---- shared memory and the stage barriers (the lanes of the warps that read a stage)
        storage, full, empty = self.stage_barriers(src, tidx, warp_idx, p.empty_arrivals)

        # ============================================================== producer warp
        if warp_idx == p.producer_warp:
            self.producer(src, storage, full, empty, tile, k_begin, nk, lane)

        # ============================================================== compute warps
        if warp_idx < p.compute_warps:
            acc = cute.make_rmem_tensor((p.acc_regs,), Float32)
            acc.fill(0.0)
            self.mainloop(storage, full, empty, k_begin, nk, warp_idx, lane, acc)
            part = cute.make_rmem_tensor((p.epi_steps * 8,), Float32)
            self.reduce_warps(storage, warp_idx, lane, tidx, acc, part)
            self.finish(storage, mGA, mGB, mC, mBias, mWs, mCtr, part, tidx, tile, split, splits)

    # ------------------------------------------------------------------------------------------
    def warp_coords(self, warp, lane) -> tuple[Int32, Int32, Int32, Int32, Int32]:
        """Warp (wm, wn, wk) of the warps_m x warps_n x warps_k compute warps (M fastest) and
        its lane's mma fragment coordinates (g, q) = (lane / 4, lane % 4)."""
        p = self.p
        wm = warp % p.warps_m
        wn = (warp // p.warps_m) % p.warps_n
        wk = warp // (p.warps_m * p.warps_n)
        g = lane >> 2
        q = lane & 3
        return wm, wn, wk, g, q

    @cute.jit
    def mainloop(self, storage, full, empty, k_begin, nk, warp, lane, acc):
        """Warp (wm, wn, wk): its k-tile slots of the CTA's stages (the CTA's first is stage
        ``k_begin`` of the whole K), decoded in registers."""
        p = self.p
        wm, wn, wk, g, q = self.warp_coords(warp, lane)
        # byte offsets inside a slot: A rows wm * warp_m + 16 i + g (+ 8), B rows
        # wn * warp_n + 8 t + g, lane q's 16-value block (16 A bytes, 8 B bytes); scale rows
        # inside a stage (sf_row_bytes each, 4 per k-tile slot)
        a_off = []
        sfa_off = []
        for i in range_constexpr(p.mma_m):
            for r in range_constexpr(2):
                a_off.append((wm * p.warp_m + 16 * i + 8 * r + g) * p.a_row_bytes + q * 16)
                sfa_off.append((wm * p.warp_m + 16 * i + 8 * r + g) * p.sf_row_bytes)
        b_off = []
        for t in range_constexpr(p.mma_n):
            b_off.append((wn * p.warp_n + 8 * t + g) * p.b_row_bytes + q * 8)
        sfb_off = []
        if const_expr(p.b_sf_2d):
            # one scale row per 16 B rows: n8 atoms 2u and 2u+1 share row u
            for u in range_constexpr(p.mma_n // 2):
                sfb_off.append((p.tile_m + wn * (p.warp_n // 16) + u) * p.sf_row_bytes)
        else:
            for t in range_constexpr(p.mma_n):
                sfb_off.append((p.tile_m + wn * p.warp_n + 8 * t + g) * p.sf_row_bytes)
        sel = Uint32(q) | (Uint32(q + 4) << Uint32(4))  # prmt: byte q of two scale words
        a_base = storage.sA4.data_ptr().toint()
        b_base = storage.sB4.data_ptr().toint()
        sf_base = storage.sSF.data_ptr().toint()
        kps = p.ktiles_per_stage
        sub0 = wk % kps if const_expr(p.warps_k >= kps) else wk
        first = wk // kps if const_expr(p.warps_k >= kps) else 0
        for i in cutlass.range(first, nk, p.stage_step, unroll=1):
            st = i % p.stages
            cute.arch.mbarrier_wait(full + st, (i // p.stages) & 1)
            for u in range_constexpr(p.subs):
                sub = sub0 + u * p.warps_k
                slot = st * kps + sub
                sf_stage = sf_base + st * p.sf_stage_bytes
                sf_slot = sf_stage + sub * p.sf_per_ktile
                sfa_slot, sel_a = sf_slot, sel
                if const_expr(p.a_sf_32):
                    # A's row of the stage holds its 1x32 codes as they are: k-tile ``sub``
                    # has two, at bytes 2 sub and 2 sub + 1 (one k-tile per stage: the word
                    # of the stage pair, this stage's at 2 (stage % 2)); lane q's 16-value
                    # block takes code q / 2
                    if const_expr(kps == 1):
                        j = (Uint32(k_begin + i) & Uint32(1)) * Uint32(2) + (Uint32(q) >> 1)
                        sfa_slot = sf_stage
                    else:
                        j = (Uint32(sub) & Uint32(1)) * Uint32(2) + (Uint32(q) >> 1)
                        sfa_slot = sf_stage + (sub >> 1) * 4
                    sel_a = j | ((j + Uint32(4)) << Uint32(4))
                self.ktile(
                    a_base + slot * p.a_slot_bytes,
                    b_base + slot * p.b_slot_bytes,
                    sf_slot,
                    sfa_slot,
                    a_off,
                    sfa_off,
                    b_off,
                    sfb_off,
                    sel,
                    sel_a,
                    empty + st,
                    u == p.subs - 1,
                    acc,
                )

    @cute.jit
    def ktile(
        self,
        a_slot,
        b_slot,
        sf_slot,
        sfa_slot,
        a_off,
        sfa_off,
        b_off,
        sfb_off,
        sel,
        sel_a,
        empty_bar,
        release: cutlass.Constexpr[bool],
        acc,
    ):
        """One k-tile slot: codes and scale codes to registers (then, for the warp's last slot
        of the stage, release the stage), decode, mma_m x mma_n x 4 mma. ``sfa_slot`` and
        ``sel_a``: where A's scale words of the k-tile are and which byte is lane q's (with
        one code per 16 values, ``sf_slot`` and ``sel``, as for B)."""
        p = self.p
        xa = []
        for r in range_constexpr(2 * p.mma_m):
            xa.append(lds_v4(a_slot + a_off[r]))
        yb = []
        for t in range_constexpr(p.mma_n):
            yb.append(lds_v2(b_slot + b_off[t]))
        # scale codes of lane q's block, two per word: (row g, row g + 8) for A,
        # (atom 2p, atom 2p + 1) for B (1x16) or (scale row 2p, 2p + 1) (16x16)
        sa_codes = []
        for i2 in range_constexpr(p.mma_m):
            sa_codes.append(
                prmt(
                    lds_u32(sfa_slot + sfa_off[2 * i2]),
                    lds_u32(sfa_slot + sfa_off[2 * i2 + 1]),
                    sel_a,
                )
            )
        sb_codes = []
        for j in range_constexpr(len(sfb_off) // 2):
            sb_codes.append(
                prmt(lds_u32(sf_slot + sfb_off[2 * j]), lds_u32(sf_slot + sfb_off[2 * j + 1]), sel)
            )
        if const_expr(release):
            cute.arch.mbarrier_arrive(empty_bar)  # the stage is in registers

        sa = []
        for i2 in range_constexpr(p.mma_m):
            sa.append(self.scale_pair(sa_codes[i2]))
        sb = []
        for j in range_constexpr(len(sb_codes)):
            sb.append(self.scale_pair(sb_codes[j]))
        # A words: wa[2 i + r][h][j] = row 16 i + 8 r + g, elements of half h, word j
        wa = []
        for r in range_constexpr(2 * p.mma_m):
            halves = []
            for h in range_constexpr(2):
                halves.append(
                    self.decode8_bytes(xa[r][2 * h], xa[r][2 * h + 1], sa[r // 2], r % 2 == 1)
                )
            wa.append(halves)
        # B atom by atom: its 8 words live only while its 4 x mma_m mma issue; the A words
        # of all four k16 steps (fewer: warp_m <= warp_n) stay in registers
        for t in range_constexpr(p.mma_n):
            wb0 = self.decode8(yb[t][0], sb[p.sb_index[t]], p.sb_high[t])
            wb1 = self.decode8(yb[t][1], sb[p.sb_index[t]], p.sb_high[t])
            for j in range_constexpr(4):
                for i2 in range_constexpr(p.mma_m):
                    lo, hi = wa[2 * i2], wa[2 * i2 + 1]  # rows g, g + 8
                    base = (i2 * p.mma_n + t) * 4
                    d = mma_16816(
                        (lo[0][j], hi[0][j], lo[1][j], hi[1][j]),
                        (wb0[j], wb1[j]),
                        (acc[base], acc[base + 1], acc[base + 2], acc[base + 3]),
                    )
                    for e in range_constexpr(4):
                        acc[base + e] = d[e]

    # ------------------------------------------------------------------------------------------
    @cute.jit
    def reduce_warps(self, storage, warp, lane, tidx, acc, part):
        """Sum the warps_k partial tiles in shared memory (warp order) into ``part``: thread
        tidx holds chunks c = tidx + s * compute_threads (8 consecutive columns of one row)."""
        p = self.p
        wm, wn, wk, g, q = self.warp_coords(warp, lane)
        red = storage.sA4.data_ptr().toint()  # the code slots, read by every warp by now
        cute.arch.barrier(barrier_id=1, number_of_threads=p.compute_threads)
        for i2 in range_constexpr(p.mma_m):
            for t in range_constexpr(p.mma_n):
                base = (i2 * p.mma_n + t) * 4
                col = wn * p.warp_n + 8 * t + 2 * q
                row = wk * p.tile_m + wm * p.warp_m + 16 * i2 + g
                sts_v2_f32(red + (row * p.red_stride + col) * 4, acc[base], acc[base + 1])
                sts_v2_f32(red + ((row + 8) * p.red_stride + col) * 4, acc[base + 2], acc[base + 3])
        cute.arch.barrier(barrier_id=1, number_of_threads=p.compute_threads)
        for s in range_constexpr(p.epi_steps):
            c = tidx + s * p.compute_threads
            row = c // p.chunks_per_row
            col = (c % p.chunks_per_row) * 8
            for w in range_constexpr(p.warps_k):
                addr = red + ((w * p.tile_m + row) * p.red_stride + col) * 4
                v0 = lds_v4_f32(addr)
                v1 = lds_v4_f32(addr + 16)
                for e in range_constexpr(4):
                    if const_expr(w == 0):
                        part[s * 8 + e] = v0[e]
                        part[s * 8 + 4 + e] = v1[e]
                    else:
                        part[s * 8 + e] = part[s * 8 + e] + v0[e]
                        part[s * 8 + 4 + e] = part[s * 8 + 4 + e] + v1[e]

    # ------------------------------------------------------------------------------------------
    @cute.jit
    def finish(
        self,
        storage,
        mGA,
        mGB,
        mC,
        mBias,
        mWs,
        mCtr,
        part,
        tidx,
        tile: CtaTile,
        split,
        splits,
    ):
        """Split-K (workspace, counter, ordered sum by the last CTA), then the epilogue."""
        p = self.p
        m_tile, n_tile, m0, n0, M, N = tile
        flag = storage.flag.data_ptr().toint()
        m_tiles, n_tiles, _ = cute.arch.grid_dim()
        tile_id = n_tile * m_tiles + m_tile
        tiles = m_tiles * n_tiles
        ws = mWs.iterator.toint()
        if splits > 1:
            for s in range_constexpr(p.epi_steps):
                c = tidx + s * p.compute_threads
                addr = ws + (Int64(split * tiles + tile_id) * p.tile_elems + Int64(c * 8)) * 4
                stg_v4_f32(addr, part[s * 8], part[s * 8 + 1], part[s * 8 + 2], part[s * 8 + 3])
                stg_v4_f32(
                    addr + 16, part[s * 8 + 4], part[s * 8 + 5], part[s * 8 + 6], part[s * 8 + 7]
                )
            cute.arch.fence_acq_rel_gpu()
            cute.arch.barrier(barrier_id=1, number_of_threads=p.compute_threads)
            if tidx == 0:
                ctr = mCtr.iterator.toint() + Int64(tile_id) * 4
                old = atom_add_acq_rel(ctr, Uint32(1))
                last = old == Uint32(splits - 1)
                if last:
                    stg_u32_relaxed(ctr, Uint32(0))  # ready for the next call
                sts_u32(flag, cutlass.select_(last, Uint32(1), Uint32(0)))
        else:
            if tidx == 0:
                sts_u32(flag, Uint32(1))
        cute.arch.barrier(barrier_id=1, number_of_threads=p.compute_threads)
        if lds_u32(flag) != Uint32(0):
            if splits > 1:
                # the last CTA of the tile: the partial tiles in split order (deterministic)
                cute.arch.fence_acq_rel_gpu()
                part.fill(0.0)
                for sp in cutlass.range(splits, unroll=1):
                    for s in range_constexpr(p.epi_steps):
                        c = tidx + s * p.compute_threads
                        addr = ws + (Int64(sp * tiles + tile_id) * p.tile_elems + Int64(c * 8)) * 4
                        v0 = ldg_cg_v4_f32(addr)
                        v1 = ldg_cg_v4_f32(addr + 16)
                        for e in range_constexpr(4):
                            part[s * 8 + e] = part[s * 8 + e] + v0[e]
                            part[s * 8 + 4 + e] = part[s * 8 + 4 + e] + v1[e]
            # ---- epilogue: y = acc * alpha (+ bias) (+ C), predicated stores
            alpha = self.alpha(mGA, mGB)
            for s in range_constexpr(p.epi_steps):
                c = tidx + s * p.compute_threads
                gm = m0 + c // p.chunks_per_row
                gn0 = n0 + (c % p.chunks_per_row) * 8
                if gm < M:
                    for e in range_constexpr(8):
                        gn = gn0 + e
                        if gn < N:
                            self.store_output(mC, mBias, gm, gn, part[s * 8 + e] * alpha)


class GemmSm90SmallBiasKernel(GemmSm90SmallKernel):
    """The kernel with a bias, C = alpha * A @ B^T + bias (+ C):
    ``__call__(mA, mSFA, mB, mSFB, mGA, mGB, mC, mBias, mWs, mCtr, stream)`` with mBias fp32
    [N]."""

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
        mWs: cute.Tensor,
        mCtr: cute.Tensor,
        stream: cuda.CUstream,
    ):
        self.launch(mA, mSFA, mB, mSFB, mGA, mGB, mC, mBias, mWs, mCtr, stream)


__all__ = [
    "GemmSm90SmallBiasKernel",
    "GemmSm90SmallKernel",
    "GemmSm90SmallParams",
    "decode8_bytes_arith",
    "decode8_bytes_lut",
]
