"""Grouped rowwise quantize kernels: the rowwise copies of several groups of rows of one tensor in
one launch, each group quantized as ``fp4gen.kernels.quantize`` quantizes a tensor of its own
(its own global amax and S_dec, its own Philox seed and offset, its stochastic rounding indexed
from its first element), bit for bit the per-group reference (``fp4gen.numerics.quantize`` of
each group's rows).

What a Mixture-of-Experts layer quantizes this way: the routed tokens of every expert, sorted by
expert ([T, K], expert e's rows contiguous), and the expert weights as one batched tensor
([E * N, K], equal groups of N rows). The groups are rows, so a 1xN block never spans two
groups; the kernels reuse ``RowwiseAmaxKernel``'s and ``RowwiseQuantizeKernel``'s device code
per unit (``RowwiseParams``: the same compile-time variants), and differ only in which units a
CTA reads and which group's scalars it uses.

The CTA table. The host (``fp4gen.runtime.grouped_quantize.cta_table``, built on the device by
``cta_table_tensor``) gives every CTA one
tile of one group's units: a row (group, first unit of the tile, end unit of the group, first
unit of the group) per CTA, int32. A CTA's loads are clamped to its group's last unit (a
duplicate unit changes no max and is never stored), so a CTA's amax is its group's, reduced as
the rowwise amax kernel reduces it and folded with one atomic max into the group's slot. An
empty group has no CTA (its slots keep what the host wrote). Per group (int32 [G, 4]): the
Philox seed and offset as (lo, hi) words; fp32 [G]: the global amax and S_dec.

The global scale's scope (docs/numerics.md 13). A group reads the amax slot of its group column;
for one amax over every group (``global per tensor``) the host
(``fp4gen.runtime.grouped_quantize``) runs the amax kernel with a table of one group holding
every row and fills every group's slot with that amax before the quantize kernel: the kernels
are the same for both scopes.

The stochastic rounding stream of group g is its own tensor's: the flat index of an element
inside the group (row - first row of g) * K + col, with g's seed and offset (docs/numerics.md 5),
so each group draws what quantizing it alone draws.

Not here (yet): the swizzled scale layout (the grouped GEMMs decode the compact scales), a
device-counter Philox offset (the experts never run from a CUDA graph: host offsets), the block
options of docs/numerics.md 11 (block targets, stochastic block scales), columnwise copies (the
tile kernels).
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Uint32, const_expr, range_constexpr

from fp4gen.kernels.philox import philox_keys, random_fields, random_words
from fp4gen.kernels.quantize import (
    RowwiseAmaxKernel,
    RowwiseParams,
    RowwiseQuantizeKernel,
    _units,
    absmax,
    absmax_bf16,
    fmax_nan,
)
from fp4gen.kernels.scale import NAN_BITS, NONFINITE_BITS, global_scales

# the columns of the CTA table
GROUP, TILE_START, GROUP_END, GROUP_START = range(4)
TABLE_COLUMNS = 4


def grouped_reason(params: RowwiseParams) -> str | None:
    """None where the grouped kernels serve these rowwise params, else why not."""
    if params.swizzled:
        return "the grouped quantize writes compact scales only"
    if getattr(params, "target_invs", ()) or getattr(params, "scale_sr", False):
        return "block targets and stochastic block scales are not in the grouped quantize"
    # the options below compile here but no GPU test holds them to the reference per group:
    # refused (each group is quantized on its own) rather than served unchecked
    if getattr(params, "global_rows", False):
        return "per-row global scales: the grouped kernels keep one global amax per group"
    if getattr(params, "rht_runtime_signs", False):
        return "RHT signs drawn per layer or step: one launch would need every group's signs"
    if getattr(params, "eden_group", 0):
        return "the MS-EDEN correction is not in the grouped quantize's GPU tests"
    return None


class GroupedRowwiseAmaxKernel(RowwiseAmaxKernel):
    """Each group's max |x| (of the RHT'd values with an RHT) into a zeroed fp32 [G] buffer:
    a CTA reduces one tile of one group (module docstring) and issues one atomic max into the
    group's slot."""

    @cute.jit
    def __call__(
        self,
        mX: cute.Tensor,
        mTable: cute.Tensor,
        mAmax: cute.Tensor,
        n_ctas: Int32,
        stream: cuda.CUstream,
    ):
        p = self.p
        gX, _ = _units(mX, p.unit)
        self.kernel(gX, mTable, mAmax).launch(
            grid=[n_ctas, 1, 1], block=[p.amax_threads, 1, 1], stream=stream
        )

    @cute.kernel
    def kernel(self, gX: cute.Tensor, mTable: cute.Tensor, mAmax: cute.Tensor):
        p = self.p
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        group = mTable[bidx, GROUP]
        last = mTable[bidx, GROUP_END] - 1
        base = mTable[bidx, TILE_START] + tidx

        frags = []
        for v in range_constexpr(p.amax_units):  # issue every load first
            frag = cute.make_rmem_tensor((p.unit,), p.input_type)
            # clamped to the group's last unit (or RHT chunk): a duplicate does not change a max
            cute.autovec_copy(gX[self.clamped(base + v * p.amax_threads, last), None], frag)
            frags.append(frag)
        acc = Float32(0.0)
        for v in range_constexpr(p.amax_units):
            if const_expr(p.rht_size > 0):
                acc = fmax_nan(acc, absmax(self.rht_values(frags[v])))
            elif const_expr(p.input_dtype == "bf16"):
                acc = fmax_nan(acc, absmax_bf16(self.unit_words(frags[v])))
            else:
                acc = fmax_nan(acc, absmax(self.to_f32(frags[v])))

        # the rowwise amax kernel's CTA reduction, then one atomic max into the group's slot
        acc = cute.arch.warp_reduction(acc, fmax_nan)
        smem = cutlass.memory.SmemAllocator()
        red = smem.allocate_tensor(
            Float32, cute.make_layout(p.amax_threads // 32), byte_alignment=16
        )
        warp = cute.arch.warp_idx()
        lane = cute.arch.lane_idx()
        if lane == 0:
            red[warp] = acc
        cute.arch.barrier()
        if warp == 0:
            w = Float32(0.0)
            if lane < p.amax_threads // 32:
                w = red[lane]
            w = cute.arch.warp_reduction(w, fmax_nan)
            if lane == 0:
                cute.arch.atomic_fmax(mAmax.iterator + group, w, sign_bit=False)


class GroupedRowwiseQuantizeKernel(RowwiseQuantizeKernel):
    """The rowwise quantization of each group of rows (module docstring): per unit the rowwise
    kernel's ``quantize_unit``, with the CTA's group's global scales, Philox keys and offset, and
    the stochastic rounding index counted from the group's first element."""

    @cute.jit
    def __call__(
        self,
        mX: cute.Tensor,
        mQ: cute.Tensor,
        mS: cute.Tensor,
        mTable: cute.Tensor,
        mAmax: cute.Tensor,
        mSdec: cute.Tensor,
        mPhilox: cute.Tensor,
        n_ctas: Int32,
        stream: cuda.CUstream,
    ):
        """mX (M, K) input, every group's rows contiguous; mQ (M, K * bits / 8) uint8 packed
        codes; mS (M, K / block) scale codes (fp32 values for fp32 scales); mTable (CTAs, 4)
        int32; mAmax (G,) fp32 global amaxes (unread without a global scale); mSdec (G,) fp32
        S_dec (out with a global scale; else 1.0 from the host, NaN for a non-finite group);
        mPhilox (G, 4) int32 seed and offset words (unread without stochastic rounding)."""
        p = self.p
        gX, num_units = _units(mX, p.unit)
        gQ = cute.make_tensor(
            cute.recast_ptr(mQ.iterator, dtype=self.store_type),
            cute.make_layout((num_units, p.store_n), stride=(p.store_n, 1)),
        )
        nbk = mX.shape[1] // p.block  # blocks per row
        gS = cute.make_tensor(mS.iterator, cute.make_layout(mX.shape[0] * nbk))
        self.kernel(gX, gQ, gS, mTable, mAmax, mSdec, mPhilox).launch(
            grid=[n_ctas, 1, 1], block=[p.quant_threads, 1, 1], stream=stream
        )

    @cute.kernel
    def kernel(
        self,
        gX: cute.Tensor,
        gQ: cute.Tensor,
        gS: cute.Tensor,
        mTable: cute.Tensor,
        mAmax: cute.Tensor,
        mSdec: cute.Tensor,
        mPhilox: cute.Tensor,
    ):
        p = self.p
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        group = mTable[bidx, GROUP]
        tile_start = mTable[bidx, TILE_START]
        end = mTable[bidx, GROUP_END]
        group_start = mTable[bidx, GROUP_START]
        last = end - 1
        base = tile_start + tidx

        frags = []
        for v in range_constexpr(p.quant_units):  # clamped to the group's last unit
            frag = cute.make_rmem_tensor((p.unit,), p.input_type)
            cute.autovec_copy(gX[self.clamped(base + v * p.quant_threads, last), None], frag)
            frags.append(frag)

        if const_expr(p.global_scale):
            s_enc, s_dec = global_scales(mAmax[group], p.global_num)
            if tile_start == group_start:  # noqa: SIM102 (the group's first CTA writes S_dec)
                if tidx == 0:
                    mSdec[group] = s_dec
            k_enc = s_enc * Float32(p.elem.inv_max)
        else:
            s_enc = s_dec = None
            k_enc = Float32(p.elem.inv_max)
        keys = off_lo = off_hi = None
        if const_expr(p.sr_bits):
            keys = philox_keys(Uint32(mPhilox[group, 0]), Uint32(mPhilox[group, 1]))
            off_lo, off_hi = Uint32(mPhilox[group, 2]), Uint32(mPhilox[group, 3])
        seen = None
        if const_expr(not p.global_scale):
            seen = Float32(0.0)

        for v in range_constexpr(p.quant_units):
            u = base + v * p.quant_threads
            rand = None
            if const_expr(p.sr_bits):
                # the element's index inside its group: the group's own stream
                i0 = Uint32(u - group_start) * Uint32(p.unit)
                if const_expr(p.rand_words):
                    rand = random_words(i0, p.unit, p.sr_bits, keys, off_lo, off_hi)
                else:
                    rand = random_fields(i0, p.unit, p.sr_bits, keys, off_lo, off_hi)
            vals, scales, seen_v = self.quantize_unit(frags[v], k_enc, s_enc, s_dec, rand)
            if const_expr(not p.global_scale):
                seen = fmax_nan(seen, seen_v)
            q = cute.make_rmem_tensor((p.store_n,), self.store_type)
            for i in range_constexpr(p.store_n):
                q[i] = vals[i]
            if u < end:
                cute.autovec_copy(q, gQ[u, None])
                if const_expr(p.threads_per_block > 1):
                    if tidx % p.threads_per_block == 0:
                        gS[u // p.threads_per_block] = self.scale_out(scales[0])
                else:
                    for g in range_constexpr(p.blocks_per_unit):
                        gS[u * p.blocks_per_unit + g] = self.scale_out(scales[g])

        if const_expr(not p.global_scale):  # noqa: SIM102
            if seen.bitcast(Uint32) >= Uint32(NONFINITE_BITS):
                mSdec[group] = Uint32(NAN_BITS).bitcast(Float32)


__all__ = [
    "GROUP",
    "GROUP_END",
    "GROUP_START",
    "TABLE_COLUMNS",
    "TILE_START",
    "GroupedRowwiseAmaxKernel",
    "GroupedRowwiseQuantizeKernel",
    "grouped_reason",
]
